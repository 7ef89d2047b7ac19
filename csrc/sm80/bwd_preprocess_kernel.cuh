// The sm80 backward's preprocess kernel: D = rowsum(dO ∘ O) per query row, the sm90 dK/dV kernel's
// row_stats, and the zeroing of the fp32 dQ accumulator and counters, in one pass. Every CUDA backward
// launches it first, the sm90 one too.
#pragma once

#include <cstdint>

#include "../common/dq_accum_layout.h"
#include "../common/ptx.cuh"
#include "../params.h"
#include "bwd_common.cuh"

namespace flash_ext::sm80 {

// The dQ accumulator row (DqAccumLayout) of query row `row` of batch entry `batch`, numbered as the
// preprocess kernel numbers them: a variable-length batch is one packed entry whose
// sequence is looked up in cu_seqlens_q (binary search: the last b with cu_seqlens_q[b] <= row, which
// skips sequences of length 0).
__device__ __forceinline__ int64_t dq_accum_row(const BwdParams& params, int64_t batch, int64_t row) {
  if (!params.is_varlen()) return DqAccumLayout::first_row(batch * params.seqlen_q, batch) + row;
  int lo = 0, hi = params.batch;  // cu_seqlens_q[lo] <= row < cu_seqlens_q[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (params.cu_seqlens_q[mid] <= row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return DqAccumLayout::first_row(params.cu_seqlens_q[lo], lo) + row - params.cu_seqlens_q[lo];
}

// The preprocess kernel's lanes per (row, head): the row's 16-byte chunks of 16-bit elements, two per lane
// (more loads in flight per thread, and each warp's index arithmetic shared by more rows), rounded up to a
// power of 2 (a shuffle reduction within the lanes' group of the warp).
constexpr int kPreprocessChunksPerLane = 2;
constexpr int preprocess_lanes_per_row(int head_dim) {
  const int lanes = (head_dim / 8 + kPreprocessChunksPerLane - 1) / kPreprocessChunksPerLane;
  return lanes <= 1 ? 1 : lanes <= 2 ? 2 : lanes <= 4 ? 4 : lanes <= 8 ? 8 : 16;
}

// D = sum_d dout * out per query row, in fp32, and with params.row_stats the row's lse * log2(e) and D
// copied there too (the sm90 dK/dV kernel's layout). kLanesPerRow lanes per (row, head), two 16-byte chunks
// of dout and of out each, so that every lane has loads in flight (H200, 16k tokens x 16 heads, hd128: one
// warp per row, half of its lanes idle, took 95.7 us with the accumulator's zeroing; one chunk per lane 48.8
// us, two 42.1 us, four 44.3 us; rows fastest 41.3 us, heads fastest 42.0).
// Rows are numbered through the batch: rows_per_batch is seqlen_q for a dense batch; a variable-length batch
// is one packed "batch" of total_q rows (its batch strides are 0).
// It also zeroes `zeros` (the fp32 dQ accumulator and the sm90 kernel's counters after it, zero_count 16-byte
// chunks, and the turns after them; none without the accumulator): each thread a strided share, 16-byte stores, instead of a memset of
// its own before this kernel (H200, hd128, 16k x 16 heads: 69.3 us against 30.5 + 41.2 us).
template <int kHeadDim, typename Element>
__global__ void __launch_bounds__(256)
    attention_bwd_preprocess_kernel(const __grid_constant__ BwdParams params, const int64_t rows_per_batch,
                                    const int64_t num_rows, float4* zeros, const int64_t zero_count) {
  // The sm90 dK/dV kernel is launched as a programmatic dependent: it sets up and loads K / V while this
  // grid's last CTAs run, and waits for all of it before reading anything this kernel writes.
  allow_dependent_launch();
  {
    const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < zero_count; i += threads) {
      zeros[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  constexpr int kElementsPerChunk = 16 / sizeof(Element);
  constexpr int kChunks = kHeadDim / kElementsPerChunk;
  static_assert(kHeadDim % kElementsPerChunk == 0 && kChunks <= 32, "the preprocess kernel's head dims");
  constexpr int kLanesPerRow = preprocess_lanes_per_row(kHeadDim);
  static_assert(kChunks <= kLanesPerRow * kPreprocessChunksPerLane, "preprocess_lanes_per_row covers the row");
  // Rows fastest, then heads: a warp's rows are consecutive in lse, D and row_stats, so its 4-byte reads and
  // writes of them coalesce (with heads fastest, each was a sector of its own).
  const int64_t row_id = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLanesPerRow;
  const int chunk = threadIdx.x % kLanesPerRow;
  const bool valid_row = row_id < num_rows * params.heads_q;
  int head = 0;
  int64_t row = 0, batch = 0;
  float sum = 0.f;
  if (valid_row) {
    head = static_cast<int>(row_id / num_rows);
    const int64_t token = row_id - head * num_rows;
    batch = token / rows_per_batch;
    row = token - batch * rows_per_batch;
    const Element* dout = static_cast<const Element*>(params.dout) + batch * params.dout_strides.batch +
                          row * params.dout_strides.row + head * params.dout_strides.head;
    const Element* out = static_cast<const Element*>(params.out) + batch * params.out_strides.batch +
                         row * params.out_strides.row + head * params.out_strides.head;
    uint4 dout_chunks[kPreprocessChunksPerLane], out_chunks[kPreprocessChunksPerLane];
#pragma unroll
    for (int c = 0; c < kPreprocessChunksPerLane; ++c) {  // chunks chunk, chunk + kLanesPerRow
      const int col = (chunk + c * kLanesPerRow) * kElementsPerChunk;
      if (col < kHeadDim) {
        dout_chunks[c] = *reinterpret_cast<const uint4*>(dout + col);
        out_chunks[c] = *reinterpret_cast<const uint4*>(out + col);
      } else {
        dout_chunks[c] = out_chunks[c] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int c = 0; c < kPreprocessChunksPerLane; ++c) {
      const Element* dout_values = reinterpret_cast<const Element*>(&dout_chunks[c]);
      const Element* out_values = reinterpret_cast<const Element*>(&out_chunks[c]);
#pragma unroll
      for (int e = 0; e < kElementsPerChunk; ++e) sum += to_float(dout_values[e]) * to_float(out_values[e]);
    }
  }
  // The row's lanes are kLanesPerRow consecutive lanes of one warp.
#pragma unroll
  for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
  if (!valid_row || chunk != 0) return;
  params.softmax_d[batch * params.lse_batch_stride + head * params.lse_head_stride + row] = sum;
  if (params.row_stats != nullptr) {
    const int64_t at = head * params.dq_accum_rows + dq_accum_row(params, batch, row);
    params.row_stats[at] = params.lse[params.lse_index(batch, head, row)] * kLog2e;
    params.row_stats[params.heads_q * params.dq_accum_rows + at] = sum;
  }
}

}  // namespace flash_ext::sm80
