// Dropout keep decisions on the CPU (attention_cpu.h): the forward's and the backward's (the Dropout class of
// tiles.h) and the tests' whole keep mask. They come from common/philox.h, the functions the kernels call,
// so that CPU and CUDA drop the same elements.

#include "attention_cpu.h"

#include "../common/philox.h"

#include <ATen/Parallel.h>

#include <cstdint>

namespace flash_ext::cpu {

void fill_dropout_keep_flags(uint64_t seed, uint64_t offset, uint32_t drop_threshold, uint64_t batch_head,
                             int64_t row, int64_t col_begin, int64_t col_end, uint8_t* keep) {
  // One Philox call per group of 8 columns; the range's first and last groups may be partial.
  constexpr int kColumns = kDropoutColumnsPerCall;
  for (int64_t group = col_begin / kColumns; group * kColumns < col_end; ++group) {
    const PhiloxWords words = dropout_random_words(seed, offset, batch_head, row, group);
    for (int i = 0; i < kColumns; ++i) {
      const int64_t col = group * kColumns + i;
      if (col >= col_begin && col < col_end) keep[col - col_begin] = dropout_keeps(words, i, drop_threshold);
    }
  }
}

void dropout_keep_mask(uint64_t seed, uint64_t offset, uint32_t drop_threshold, int64_t batch, int64_t heads,
                       int64_t seqlen_q, int64_t seqlen_k, uint8_t* mask) {
  at::parallel_for(0, batch * heads * seqlen_q, 1, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t row = index % seqlen_q, batch_head = index / seqlen_q;
      fill_dropout_keep_flags(seed, offset, drop_threshold, batch_head, row, 0, seqlen_k, mask + index * seqlen_k);
    }
  });
}

}  // namespace flash_ext::cpu
