// Counter-based random numbers for dropout: Philox4x32-10 (Salmon et al., "Parallel random
// numbers: as easy as 1, 2, 3", SC'11), and the mapping from an attention-probability element to
// its random word.
//
// Why counter-based: the backward must drop exactly the elements the forward dropped, without
// storing an N x N mask. With Philox the random word of an element is a pure function of
// (seed, offset, batch, head, row, column), so any thread on any device can regenerate it in any
// order. The CPU path (csrc/cpu) and the CUDA kernels call the functions below, so they drop the
// same elements for the same seed and offset.
//
// Mapping (one Philox call = 4 random words = 8 consecutive columns of one row, 16 bits each):
//
//   stream  = offset + batch * heads_q + head                  (uint64, wraps)
//   key     = (seed & 0xffffffff,  seed >> 32)
//   counter = (column / 8,  row,  stream & 0xffffffff,  stream >> 32)
//   word i of philox4x32_10(counter, key): its low 16 bits decide column 8 * (column / 8) + 2 i,
//     its high 16 bits column 8 * (column / 8) + 2 i + 1
//   the element is dropped  iff  its 16 bits < drop_threshold,  drop_threshold = floor(dropout_p * 2^16)
//
// 16 bits per element rather than a word: half the Philox calls per probability (the kernels' dropout
// cost is mostly Philox rounds: with a word per element the hd128 dropout forward takes 2.5x the plain
// one, H200, 8k, 2026-12-01), with p still resolved to 2^-16.
// row and column are positions inside the element's own sequence (for variable-length batches,
// `batch` is the index of the sequence), so the decision does not depend on the other sequences'
// lengths nor on the tile sizes. Distinct (stream, row, column / 8) give distinct counters while
// row < 2^32 and column < 2^35.
//
// Where seed and offset come from (torch's default generator of the tensors' device, so that
// torch.manual_seed reproduces a run):
//   CPU   the CPU generator (mt19937) has no Philox offset: each call draws a fresh 64-bit seed
//         from it (holding its mutex) and uses offset 0.
//   CUDA  (to come) at::CUDAGeneratorImpl::philox_cuda_state(increment) under the generator's
//         mutex, with increment = batch * heads_q rounded up to a multiple of 4: each call then
//         owns the streams [offset, offset + batch * heads_q), and the next call's offset starts
//         after them. Under CUDA-graph capture the seed and offset are only known on the device
//         (at::cuda::philox::unpack), so the kernel, not the host, writes them to the rng_state
//         output the backward reads.
#pragma once

#include <cstdint>

#include "host_device.h"

namespace flash_ext {

struct PhiloxWords {
  uint32_t w[4];
};

namespace philox_detail {

// Multipliers and Weyl key increments of Philox4x32 (Random123's constants).
constexpr uint32_t kMul0 = 0xD2511F53u;
constexpr uint32_t kMul1 = 0xCD9E8D57u;
constexpr uint32_t kKeyStep0 = 0x9E3779B9u;  // golden ratio
constexpr uint32_t kKeyStep1 = 0xBB67AE85u;  // sqrt(3) - 1

FLASH_EXT_HOST_DEVICE inline uint32_t mul_hi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

}  // namespace philox_detail

// Philox4x32 with 10 rounds: a bijection of the 128-bit counter, keyed by 64 bits.
FLASH_EXT_HOST_DEVICE inline PhiloxWords philox4x32_10(PhiloxWords counter, uint32_t key0, uint32_t key1) {
  using namespace philox_detail;
  uint32_t* c = counter.w;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key0 += kKeyStep0;
      key1 += kKeyStep1;
    }
    const uint32_t lo0 = kMul0 * c[0], hi0 = mul_hi(kMul0, c[0]);
    const uint32_t lo1 = kMul1 * c[2], hi1 = mul_hi(kMul1, c[2]);
    const PhiloxWords next = {{hi1 ^ c[1] ^ key0, lo1, hi0 ^ c[3] ^ key1, lo0}};
    counter = next;
  }
  return counter;
}

constexpr int kDropoutColumnsPerCall = 8;  // columns decided by one Philox call

// The 4 random words of columns 8 * column_group .. 8 * column_group + 7 of `row` of one
// (batch, head): see the mapping at the top of this file.
FLASH_EXT_HOST_DEVICE inline PhiloxWords dropout_random_words(uint64_t seed, uint64_t offset, uint64_t batch_head,
                                                              uint64_t row, uint64_t column_group) {
  const uint64_t stream = offset + batch_head;
  const PhiloxWords counter = {{static_cast<uint32_t>(column_group), static_cast<uint32_t>(row),
                                static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)}};
  return philox4x32_10(counter, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
}

// 16 random bits below the threshold drop their element. floor(p * 2^16) makes the drop probability
// p to within 2^-16. Host-side (double precision); p must be in [0, 1).
inline uint32_t dropout_drop_threshold(double dropout_p) { return static_cast<uint32_t>(dropout_p * 65536.0); }

// Whether column 8 * column_group + i (i < 8) of the call's `words` is kept.
FLASH_EXT_HOST_DEVICE inline bool dropout_keeps(const PhiloxWords& words, int i, uint32_t drop_threshold) {
  return (words.w[i / 2] >> (16 * (i % 2)) & 0xffffu) >= drop_threshold;
}

// Whether element (row, column) of (batch, head) is kept: one element at a time. Kernels and the
// CPU loops call dropout_random_words once per 8 columns instead.
FLASH_EXT_HOST_DEVICE inline bool dropout_keeps_element(uint64_t seed, uint64_t offset, uint32_t drop_threshold,
                                                        uint64_t batch_head, uint64_t row, uint64_t column) {
  const PhiloxWords words = dropout_random_words(seed, offset, batch_head, row, column / kDropoutColumnsPerCall);
  return dropout_keeps(words, static_cast<int>(column % kDropoutColumnsPerCall), drop_threshold);
}

// The seed and offset of a call: the values in params, or read from device memory (see
// FwdParams::philox_seed_ptr).
struct PhiloxSeedOffset {
  uint64_t seed;
  uint64_t offset;
};

template <typename Params>
FLASH_EXT_HOST_DEVICE inline PhiloxSeedOffset philox_seed_offset(const Params& params) {
  if (params.philox_seed_ptr == nullptr) return {params.philox_seed, params.philox_offset};
  return {static_cast<uint64_t>(*params.philox_seed_ptr),
          static_cast<uint64_t>(*params.philox_offset_ptr) + params.philox_offset_intragraph};
}

}  // namespace flash_ext
