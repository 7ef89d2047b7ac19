// Split-KV decode: the attention of a few query rows against a long KV cache, a memory-bound problem.
//
// A CTA (4 warps) takes one (split of the keys, kv head, chunk of rows, sequence): its rows are the query
// rows of all heads_q / heads_kv query heads that share the kv head (GQA packed), so each K / V byte is read
// once per chunk rather than once per query head; the key splits give every SM work when batch x heads_kv
// alone would not. Each warp walks tiles of 32 keys of its split: lane j computes the scores of key j for
// every row (CUDA-core FMAs: with a handful of rows the tensor cores would idle), the rows' online softmax
// runs across the warp, and P·V has lane l own head_dim / 32 columns, so each V row is one coalesced load.
// The warps' states merge in shared memory; the CTA writes its split's normalised output and lse, or, with
// one split, the final out and lse. attention_decode_combine_kernel merges the splits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "decode_params.h"

namespace flash_ext::decode {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <typename Element>
__device__ __forceinline__ float to_float(Element x) {
  if constexpr (std::is_same_v<Element, __nv_bfloat16>) {
    return __bfloat162float(x);
  } else {
    return __half2float(x);
  }
}

template <typename Element>
__device__ __forceinline__ Element from_float(float x) {
  if constexpr (std::is_same_v<Element, __nv_bfloat16>) {
    return __float2bfloat16(x);
  } else {
    return __float2half(x);
  }
}

// The cache offset (elements) of position `pos` of sequence b, kv head `head`.
__device__ __forceinline__ int64_t cache_offset(const DecodeParams& p, int b, int64_t pos, int head) {
  int64_t base;
  if (p.block_table != nullptr) {
    const int64_t block = p.block_table[b * p.block_table_stride + pos / p.page_size];
    base = block * p.cache_batch_stride + (pos % p.page_size) * p.cache_row_stride;
  } else {
    const int64_t row = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
    base = row * p.cache_batch_stride + pos * p.cache_row_stride;
  }
  return base + int64_t{head} * p.cache_head_stride;
}

template <typename Element, int kHeadDim, int kRows>
__global__ void __launch_bounds__(kThreads) attention_decode_kernel(const DecodeParams p) {
  constexpr int kCols = kHeadDim / 32;  // P·V columns per lane
  __shared__ float q_s[kRows][kHeadDim];
  __shared__ float o_s[kWarps][kRows][kHeadDim];  // each warp's rescaled P·V, summed in a fixed order
  __shared__ float max_s[kWarps][kRows];
  __shared__ float sum_s[kWarps][kRows];

  const int split = blockIdx.x, b = blockIdx.z;
  const int kv_head = blockIdx.y / p.row_chunks, chunk = blockIdx.y % p.row_chunks;
  const int group = p.heads_q / p.heads_kv;
  const int row0 = chunk * kRows;
  const int rows = min(kRows, group * p.seqlen_q - row0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // Row r is query i = (row0 + r) / group of head kv_head * group + (row0 + r) % group.
  auto query_of = [&](int r) { return (row0 + r) / group; };
  auto head_of = [&](int r) { return kv_head * group + (row0 + r) % group; };

  const Element* q = static_cast<const Element*>(p.q);
  for (int index = threadIdx.x; index < kRows * kHeadDim; index += kThreads) {
    const int r = index / kHeadDim, c = index % kHeadDim;
    float value = 0.f;
    if (r < rows) {
      value = to_float(q[((int64_t{b} * p.seqlen_q + query_of(r)) * p.heads_q + head_of(r)) * kHeadDim + c]);
    }
    q_s[r][c] = value;
  }
  __syncthreads();

  const int64_t key_begin = p.leftpad != nullptr ? p.leftpad[b] : 0;
  const int64_t key_end = (p.seqlens != nullptr ? int64_t{p.seqlens[b]} : p.capacity) + p.seqlen_new;
  const int64_t len_k = key_end - key_begin;
  const int64_t split_begin = int64_t{split} * p.keys_per_split;  // sequence-relative key indices
  const int64_t split_end = len_k < split_begin + p.keys_per_split ? len_k : split_begin + p.keys_per_split;

  float slope[kRows];
  int64_t diagonal[kRows];  // i + len_k - seqlen_q: the key each row's causal mask ends at
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    diagonal[r] = r < rows ? query_of(r) + len_k - p.seqlen_q : 0;
    slope[r] = (p.alibi_slopes != nullptr && r < rows) ? p.alibi_slopes[b * p.alibi_batch_stride + head_of(r)] : 0.f;
  }

  float row_max[kRows], row_sum[kRows], acc[kRows][kCols];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[r][c] = 0.f;
  }

  const Element* k_cache = static_cast<const Element*>(p.k_cache);
  const Element* v_cache = static_cast<const Element*>(p.v_cache);
  for (int64_t tile = split_begin + 32 * warp; tile < split_end; tile += 32 * kWarps) {
    const int64_t j = tile + lane;  // this lane's key, sequence-relative
    const bool in_range = j < split_end;
    const int64_t offset = in_range ? cache_offset(p, b, key_begin + j, kv_head) : 0;

    // Scores of key j for every row, in log2 units; -inf where masked.
    float score[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) score[r] = 0.f;
    if (in_range) {
      const uint4* k_row = reinterpret_cast<const uint4*>(k_cache + offset);
#pragma unroll 4
      for (int chunk8 = 0; chunk8 < kHeadDim / 8; ++chunk8) {
        const uint4 packed = k_row[chunk8];
        const Element* k8 = reinterpret_cast<const Element*>(&packed);
        float kf[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) kf[e] = to_float(k8[e]);
#pragma unroll
        for (int r = 0; r < kRows; ++r) {
          const float4 qa = *reinterpret_cast<const float4*>(&q_s[r][chunk8 * 8]);
          const float4 qb = *reinterpret_cast<const float4*>(&q_s[r][chunk8 * 8 + 4]);
          score[r] += qa.x * kf[0] + qa.y * kf[1] + qa.z * kf[2] + qa.w * kf[3] + qb.x * kf[4] + qb.y * kf[5] +
                      qb.z * kf[6] + qb.w * kf[7];
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      bool visible = in_range && r < rows;
      if (p.window_left >= 0) visible = visible && j >= diagonal[r] - p.window_left;
      if (p.window_right >= 0) visible = visible && j <= diagonal[r] + p.window_right;
      float s = score[r] * p.softmax_scale;
      if (p.softcap > 0.f) s = p.softcap * tanhf(s / p.softcap);
      s -= slope[r] * fabsf(static_cast<float>(diagonal[r] - j));
      score[r] = visible ? s * kLog2e : -INFINITY;
    }

    // Online softmax across the warp's 32 keys, then P·V over them.
    float prob[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float tile_max = score[r];
#pragma unroll
      for (int stride = 16; stride > 0; stride /= 2) tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, stride));
      const float new_max = fmaxf(row_max[r], tile_max);
      const float base = new_max == -INFINITY ? 0.f : new_max;
      const float rescale = exp2f(row_max[r] - base);  // 0 while the row was empty
      prob[r] = exp2f(score[r] - base);
      row_sum[r] = row_sum[r] * rescale + prob[r];
      row_max[r] = new_max;
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[r][c] *= rescale;
    }
    const int keys = split_end - tile < 32 ? static_cast<int>(split_end - tile) : 32;
    for (int t = 0; t < keys; ++t) {
      const int64_t v_offset = __shfl_sync(0xffffffff, offset, t);
      const Element* v_row = v_cache + v_offset + lane * kCols;
      float vf[kCols];
      if constexpr (kCols == 8) {
        const uint4 packed = *reinterpret_cast<const uint4*>(v_row);
        const Element* v8 = reinterpret_cast<const Element*>(&packed);
#pragma unroll
        for (int c = 0; c < 8; ++c) vf[c] = to_float(v8[c]);
      } else if constexpr (kCols == 4) {
        const uint2 packed = *reinterpret_cast<const uint2*>(v_row);
        const Element* v4 = reinterpret_cast<const Element*>(&packed);
#pragma unroll
        for (int c = 0; c < 4; ++c) vf[c] = to_float(v4[c]);
      } else {
#pragma unroll
        for (int c = 0; c < kCols; ++c) vf[c] = to_float(v_row[c]);
      }
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        const float pt = __shfl_sync(0xffffffff, prob[r], t);
#pragma unroll
        for (int c = 0; c < kCols; ++c) acc[r][c] += pt * vf[c];
      }
    }
  }

  // Merge the warps: each warp's rows rescaled to the CTA's max, then summed in warp order (bitwise
  // repeatable).
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float sum = row_sum[r];
#pragma unroll
    for (int stride = 16; stride > 0; stride /= 2) sum += __shfl_xor_sync(0xffffffff, sum, stride);
    if (lane == 0) {
      max_s[warp][r] = row_max[r];
      sum_s[warp][r] = sum;
    }
  }
  __syncthreads();
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float cta_max = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) cta_max = fmaxf(cta_max, max_s[w][r]);
    const float base = cta_max == -INFINITY ? 0.f : cta_max;
    const float factor = exp2f(row_max[r] - base);
#pragma unroll
    for (int c = 0; c < kCols; ++c) o_s[warp][r][lane * kCols + c] = acc[r][c] * factor;
  }
  __syncthreads();

  const int64_t rows_all = int64_t{p.batch} * p.seqlen_q * p.heads_q;
  for (int index = threadIdx.x; index < rows * kHeadDim; index += kThreads) {
    const int r = index / kHeadDim, c = index % kHeadDim;
    float cta_max = -INFINITY, sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) cta_max = fmaxf(cta_max, max_s[w][r]);
    const float base = cta_max == -INFINITY ? 0.f : cta_max;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += sum_s[w][r] * exp2f(max_s[w][r] - base);
    const bool empty = sum == 0.f;  // NaN (a NaN score) is not empty: it propagates
    float weighted = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) weighted += o_s[w][r][c];
    const float value = empty ? 0.f : weighted / sum;
    const float lse = empty ? -INFINITY : (base + log2f(sum)) * kLn2;
    const int i = query_of(r), h = head_of(r);
    const int64_t row = (int64_t{b} * p.seqlen_q + i) * p.heads_q + h;  // out's row order
    if (p.num_splits == 1) {
      static_cast<Element*>(p.out)[row * kHeadDim + c] = from_float<Element>(value);
      if (c == 0) p.lse[(int64_t{b} * p.heads_q + h) * p.seqlen_q + i] = lse;
    } else {
      p.out_partial[(split * rows_all + row) * kHeadDim + c] = value;
      if (c == 0) p.lse_partial[split * rows_all + row] = lse;
    }
  }
}

// Merges the splits of each (sequence, query, head) row: a warp per row, lanes over the columns.
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(256) attention_decode_combine_kernel(const DecodeParams p) {
  const int64_t rows_all = int64_t{p.batch} * p.seqlen_q * p.heads_q;
  const int64_t row = int64_t{blockIdx.x} * 8 + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows_all) return;
  float lse_max = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s) lse_max = fmaxf(lse_max, p.lse_partial[s * rows_all + row]);
  const float base = lse_max == -INFINITY ? 0.f : lse_max;
  float sum = 0.f;
  for (int s = 0; s < p.num_splits; ++s) sum += expf(p.lse_partial[s * rows_all + row] - base);
  const bool empty = sum == 0.f;
  const float lse = empty ? -INFINITY : base + logf(sum);
  for (int c = lane; c < kHeadDim; c += 32) {
    float value = 0.f;
    if (!empty) {
      for (int s = 0; s < p.num_splits; ++s) {
        const float weight = expf(p.lse_partial[s * rows_all + row] - lse);
        value += weight * p.out_partial[(s * rows_all + row) * kHeadDim + c];
      }
    }
    static_cast<Element*>(p.out)[row * kHeadDim + c] = from_float<Element>(value);
  }
  if (lane == 0) {
    const int64_t h = row % p.heads_q, i = (row / p.heads_q) % p.seqlen_q, b = row / (int64_t{p.heads_q} * p.seqlen_q);
    p.lse[(b * p.heads_q + h) * p.seqlen_q + i] = lse;
  }
}

}  // namespace flash_ext::decode
