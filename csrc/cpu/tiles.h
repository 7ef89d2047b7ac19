// Tiled CPU FlashAttention: the executable specification the GPU kernels are held to (attention_cpu.h is
// its interface). This header holds what the forward (attention_fwd_cpu.cpp) and the backward
// (attention_bwd_cpu.cpp) share: tiles of kBlockM query rows x kBlockN key rows, their loads and stores, the
// vector kernels over head_dim, the band of keys each query sees, the score function, the dropout decisions
// and the dtype dispatch. All arithmetic is fp32: inputs are widened when a tile is loaded, outputs rounded
// when stored.
//
// Features (see params.h for their definitions):
//   variable-length batches  each task works inside one sequence: rows are offset by the sequence's
//                            start in the packed tensors and masks use the sequence's own lengths.
//   sliding window / causal  only the key tiles that intersect a query tile's band are visited (and
//                            only the query tiles that see a key tile in the backward), so the cost
//                            grows with the window, not with seqlen_q * seqlen_k.
//   softcap, ALiBi           applied to each score (ScoreFn); the backward multiplies dS by the
//                            softcap's derivative 1 - tanh^2.
//   dropout                  keep decisions come from common/philox.h (dropout_mask_cpu.cpp), regenerated
//                            in the backward.
//
// Everything here is in an unnamed namespace: each translation unit that includes it gets its own copy with
// internal linkage, as the private helpers of a single source file have, so no definition needs `inline`.
#pragma once

#include "attention_cpu.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace flash_ext::cpu {
namespace {

constexpr int kBlockM = 64;  // query rows per tile
constexpr int kBlockN = 64;  // key rows per tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- Tensor access -------------------------------------------------------------------------

// The rows of one head of one sequence: a (batch, head) slice of a (batch, seqlen, heads, head_dim)
// tensor, or of a packed (total, heads, head_dim) one starting at the sequence's first row.
template <typename T>
struct HeadRows {
  T* base;             // element (row 0 of the sequence, dim 0)
  int64_t row_stride;  // elements from one row to the next
  T* row(int64_t r) const { return base + r * row_stride; }
};

template <typename T>
HeadRows<T> head_rows(T* data, const TensorStrides& strides, int64_t b, int64_t h, const SequenceSpan& span) {
  return {data + b * strides.batch + h * strides.head + span.begin * strides.row, strides.row};
}

// Sequence b of the batch: its query rows and key rows.
struct Sequence {
  int64_t b;
  SequenceSpan q, k;
};

Sequence sequence_at(const FwdParams& p, int64_t b) { return {b, p.query_span(b), p.key_span(b)}; }

// A run of consecutive rows of a sequence.
struct Block {
  int64_t begin;
  int size;
};

int64_t num_blocks(int64_t len, int block_size) { return (len + block_size - 1) / block_size; }

// Block `index` of a sequence of length `len` cut into blocks of `block_size` (the last may be short).
Block block_at(int64_t index, int block_size, int64_t len) {
  const int64_t begin = index * block_size;
  return {begin, static_cast<int>(std::min<int64_t>(block_size, len - begin))};
}

// Widens the block's rows into a dense float tile (block.size x head_dim).
template <typename T>
void load_tile(HeadRows<const T> src, Block block, int head_dim, float* tile) {
  for (int r = 0; r < block.size; ++r) {
    const T* row = src.row(block.begin + r);
    float* dst = tile + static_cast<int64_t>(r) * head_dim;
    for (int d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(row[d]);
  }
}

// Stores scale * tile into the block's rows, rounded to T.
template <typename T>
void store_tile(const float* tile, float scale, int head_dim, Block block, HeadRows<T> dst) {
  for (int r = 0; r < block.size; ++r) {
    const float* src = tile + static_cast<int64_t>(r) * head_dim;
    T* row = dst.row(block.begin + r);
    for (int d = 0; d < head_dim; ++d) row[d] = static_cast<T>(src[d] * scale);
  }
}

// ---- Vector kernels over head_dim (contiguous, so the compiler vectorises them) -------------

// fp32 dot product. Without -ffast-math the compiler may not reorder a single running sum, so
// eight independent partial sums give it lanes to vectorise.
float dot(const float* a, const float* b, int n) {
  constexpr int kLanes = 8;
  float partial[kLanes] = {};
  int d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int lane = 0; lane < kLanes; ++lane) partial[lane] += a[d + lane] * b[d + lane];
  }
  float sum = 0.f;
  for (; d < n; ++d) sum += a[d] * b[d];
  for (int lane = 0; lane < kLanes; ++lane) sum += partial[lane];
  return sum;
}

// y += alpha * x
void axpy(float alpha, const float* x, float* y, int n) {
  for (int d = 0; d < n; ++d) y[d] += alpha * x[d];
}

// ---- Masking: the band of keys each query sees ----------------------------------------------

// The columns of `keys` (block-local, [0, keys.size)) that query `row` of `seq` sees.
IndexRange visible_columns(const FwdParams& p, const Sequence& seq, int64_t row, Block keys) {
  const IndexRange visible = p.visible_keys(row, seq.q.length, seq.k.length);
  return {std::clamp<int64_t>(visible.begin - keys.begin, 0, keys.size),
          std::clamp<int64_t>(visible.end - keys.begin, 0, keys.size)};
}

// The key blocks that hold every key some row of `queries` sees; blocks outside are skipped.
// Both ends of a row's band grow with the row, so the first row bounds the start and the last
// row the end.
IndexRange key_blocks_seen_by(const FwdParams& p, const Sequence& seq, Block queries) {
  const int64_t first_key = p.visible_keys(queries.begin, seq.q.length, seq.k.length).begin;
  const int64_t end_key = p.visible_keys(queries.begin + queries.size - 1, seq.q.length, seq.k.length).end;
  if (first_key >= end_key) return {0, 0};
  return {first_key / kBlockN, num_blocks(end_key, kBlockN)};
}

// ---- Scores: softmax_scale, softcap, ALiBi ---------------------------------------------------

// What one (sequence, head) does to q.k before the softmax:
//   s = softmax_scale * q.k
//   s = softcap * tanh(s / softcap)             when softcap > 0
//   s = s - slope * |i + len_k - len_q - j|     with ALiBi
// The result is kept in log2 units (times log2(e)): the softmax uses exp2.
class ScoreFn {
 public:
  struct Score {
    float log2;        // s * log2(e)
    float derivative;  // ds / d(softmax_scale * q.k): 1, or 1 - tanh^2 under softcap
  };

  ScoreFn(const FwdParams& p, const Sequence& seq, int64_t h)
      : scale_(p.softmax_scale),
        softcap_(p.softcap),
        inv_softcap_(p.softcap > 0.f ? 1.f / p.softcap : 0.f),
        alibi_slope_(p.alibi_slope(seq.b, h)),
        diagonal_(seq.k.length - seq.q.length) {}

  Score operator()(float qk, int64_t row, int64_t col) const {
    float s = qk * scale_;
    float derivative = 1.f;
    if (softcap_ > 0.f) {
      const float t = std::tanh(s * inv_softcap_);
      s = softcap_ * t;
      derivative = 1.f - t * t;
    }
    if (alibi_slope_ != 0.f) s -= alibi_slope_ * static_cast<float>(std::abs(row + diagonal_ - col));
    return {s * kLog2e, derivative};
  }

 private:
  float scale_, softcap_, inv_softcap_, alibi_slope_;
  int64_t diagonal_;
};

// ---- Dropout ----------------------------------------------------------------------------------

// The keep decisions of one (sequence, head); see common/philox.h for the mapping.
class Dropout {
 public:
  Dropout(const FwdParams& p, const Sequence& seq, int64_t h)
      : enabled_(p.has_dropout()),
        scale_(p.dropout_scale),
        threshold_(p.dropout_threshold),
        seed_(p.philox_seed),
        offset_(p.philox_offset),
        batch_head_(static_cast<uint64_t>(seq.b) * p.heads_q + h) {}

  bool enabled() const { return enabled_; }
  float scale() const { return scale_; }  // 1 / (1 - dropout_p)

  // keep[c - cols.begin] for the columns of `cols` (sequence coordinates) of query `row`.
  void keep_flags(int64_t row, IndexRange cols, uint8_t* keep) const {
    fill_dropout_keep_flags(seed_, offset_, threshold_, batch_head_, row, cols.begin, cols.end, keep);
  }

 private:
  bool enabled_;
  float scale_;
  uint32_t threshold_;
  uint64_t seed_, offset_, batch_head_;
};

// Calls fn with a value of the C++ element type that `dtype` names.
template <typename Fn>
void dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: return fn(float{});
    case DType::kFloat16: return fn(c10::Half{});
    case DType::kBFloat16: return fn(c10::BFloat16{});
  }
}

}  // namespace
}  // namespace flash_ext::cpu
