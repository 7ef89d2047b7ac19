// The sm80 backward's conversion kernels: fp32 sums to the gradients' 16-bit dtype. The dQ conversion
// scales and rounds the dQ accumulator that the dK/dV kernels (sm80 or sm90) add into; the dK/dV
// conversion rounds the sums of the split tail walks' pieces (TailSplit).
#pragma once

#include <cstdint>

#include "../common/dq_accum_layout.h"
#include "../common/finished_walks.cuh"
#include "../common/ptx.cuh"
#include "../params.h"

namespace flash_ext::sm80 {

// dq = softmax_scale · dq_accum, rounded to the input dtype. A warp per (row group of 8 accumulator rows,
// head, pair of 16-column tiles): the accumulator is read in memory order, each load instruction one whole
// 512-byte tile (lane l: row l / 4, float4 l % 4 of it), and the warp's 1 KB is contiguous. (One thread per
// tile row, the warps' lanes 512 bytes apart: 64.3 us at hd128, 16k x 16 heads on the H200, 3.1 TB/s.)
// Float4 q of a row holds columns 2q, 2q + 1 (x, y) and 8 + 2q, 8 + 2q + 1 (z, w) (DqAccumLayout); two
// shuffles within each quad give lane q of it columns 4q .. 4q + 3, so each store instruction writes 8 rows
// x 32 contiguous bytes.
// Warp order: dense, batch, then head, then the sequence's row groups (row_groups per sequence): the order
// in which the dK/dV kernel finishes them, for the overlap of finished_walks.cuh; variable-length, head, then
// all row_groups of the accumulator (padding groups between sequences are read, not stored).
// wait.keys_per_walk > 0: launched to overlap the sm90 dK/dV kernel, each warp first waits for its
// sequence's (batch, kv head) walks (params.dkdv_finished).
struct DkDvWait {
  int keys_per_walk = 0;        // the dK/dV kernel's keys per walk; 0: it has finished (no wait)
  int key_blocks_launched = 0;  // its key blocks per (batch, kv head)
};

template <int kHeadDim, typename Element>
__global__ void __launch_bounds__(256)
    attention_bwd_convert_dq_kernel(const __grid_constant__ BwdParams params, const int64_t row_groups,
                                    const DkDvWait wait) {
  static_assert(kHeadDim % (2 * DqAccumLayout::kTileCols) == 0, "whole pairs of tiles");
  constexpr int kTilePairs = kHeadDim / (2 * DqAccumLayout::kTileCols);
  const int64_t warp_id = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int pair = warp_id % kTilePairs;
  const int64_t unit = warp_id / kTilePairs;
  if (unit >= params.heads_q * row_groups * (params.is_varlen() ? 1 : params.batch)) return;  // whole warps
  const int64_t group = unit % row_groups;
  int sequence, head;
  int64_t begin, length, accum_row0;
  if (params.is_varlen()) {
    head = static_cast<int>(unit / row_groups);
    accum_row0 = group * DqAccumLayout::kTileRows;
    // The sequence whose accumulator rows hold this group: the last b with first_row(b) <= accum_row0
    // (sequences are 8-aligned there, DqAccumLayout::first_row).
    int lo = 0, hi = params.batch;
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (DqAccumLayout::first_row(params.cu_seqlens_q[mid], mid) <= accum_row0) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    sequence = lo;
    begin = params.cu_seqlens_q[sequence];
    length = params.cu_seqlens_q[sequence + 1] - begin;
    accum_row0 -= DqAccumLayout::first_row(begin, sequence);  // within the sequence, from here on
  } else {
    head = static_cast<int>(unit / row_groups % params.heads_q);
    sequence = static_cast<int>(unit / row_groups / params.heads_q);
    begin = int64_t{sequence} * params.seqlen_q;
    length = params.seqlen_q;
    accum_row0 = group * DqAccumLayout::kTileRows;
  }
  const int64_t row = accum_row0 + lane / 4;  // within the sequence
  const bool stored = row < length;
  // A variable-length batch is one packed entry: its rows are numbered through all sequences.
  Element* dq = static_cast<Element*>(params.dq) +
                (params.is_varlen() ? (begin + row) * params.dq_strides.row
                                    : sequence * params.dq_strides.batch + row * params.dq_strides.row) +
                head * params.dq_strides.head;
  if (wait.keys_per_walk > 0) {
    const int kv_head = head / params.heads_per_kv();
    const int64_t counter = kFinishedCounterStride * (int64_t{sequence} * params.heads_kv + kv_head);
    wait_for_finished_walks(
        &params.dkdv_finished[counter],
        counted_walks(params.key_span(sequence).length, wait.keys_per_walk, wait.key_blocks_launched));
  }

  const DqAccumLayout layout{params.dq_accum_rows, kHeadDim};
  const int first_col = 2 * pair * DqAccumLayout::kTileCols;
  const float4* src = reinterpret_cast<const float4*>(
      params.dq_accum + layout.tile_offset(DqAccumLayout::first_row(begin, sequence) + accum_row0, head, first_col));
  float4 f[2];
#pragma unroll
  for (int t = 0; t < 2; ++t) f[t] = __ldcg(&src[t * 32 + lane]);  // tiles are 32 float4 long and adjacent

  // Quad lane q holds a = columns 2q, 2q + 1 and b = 8 + 2q, 8 + 2q + 1 of its row; it is to store
  // 4q .. 4q + 3, i.e. lanes 0, 1 the a's of lanes (0, 1), (2, 3), lanes 2, 3 the b's of (0, 1), (2, 3).
  // First shuffle: from lane ((q & 1) << 1) | (q >> 1), which sends a if it is even, b if odd; second:
  // from that lane ^ 1, which sends the other kind.
  const int q = lane % 4;
  const int source = (lane & ~3) | ((q & 1) << 1) | (q >> 1);
  const float s = params.softmax_scale;
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const uint32_t a = pack_float2<Element>(f[t].x * s, f[t].y * s);
    const uint32_t b = pack_float2<Element>(f[t].z * s, f[t].w * s);
    const uint32_t first = __shfl_sync(0xffffffff, q % 2 == 0 ? a : b, source);
    const uint32_t second = __shfl_sync(0xffffffff, q % 2 == 1 ? a : b, source ^ 1);
    if (stored) {
      *reinterpret_cast<uint2*>(dq + first_col + t * DqAccumLayout::kTileCols + 4 * q) =
          q < 2 ? make_uint2(first, second) : make_uint2(second, first);
    }
  }
}

// dk and dv of the split tail walks (TailSplit) from the pieces' sums in params.dkv_accum: 8 columns of
// one key row of dK or dV per thread.
template <int kHeadDim, int kBlockKeys, typename Element>
__global__ void __launch_bounds__(256)
    attention_bwd_convert_dkv_kernel(const __grid_constant__ BwdParams params, const TailSplit split,
                                     const int num_split_walks) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  const int64_t id = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (id >= int64_t{num_split_walks} * 2 * kBlockKeys * kChunksPerRow) return;
  const int col = id % kChunksPerRow * 8;
  const int key_in_block = id / kChunksPerRow % kBlockKeys;
  const bool is_dv = id / kChunksPerRow / kBlockKeys % 2 == 1;
  const int split_walk = static_cast<int>(id / kChunksPerRow / kBlockKeys / 2);
  const int num_key_blocks = (params.seqlen_k + kBlockKeys - 1) / kBlockKeys;
  const int walk = split.first_walk + split_walk;
  const int key = walk % num_key_blocks * kBlockKeys + key_in_block;
  if (key >= params.seqlen_k) return;
  const int kv_head = walk / num_key_blocks % params.heads_kv;
  const int batch = walk / num_key_blocks / params.heads_kv;
  const float4* src = reinterpret_cast<const float4*>(params.dkv_accum +
                                                      ((int64_t{split_walk} * 2 + is_dv) * kBlockKeys + key_in_block) *
                                                          kHeadDim +
                                                      col);
  const float4 a = src[0], b = src[1];
  const TensorStrides& strides = is_dv ? params.dv_strides : params.dk_strides;
  Element* dst = static_cast<Element*>(is_dv ? params.dv : params.dk) + batch * strides.batch +
                 kv_head * strides.head + key * strides.row + col;
  *reinterpret_cast<uint4*>(dst) = {pack_float2<Element>(a.x, a.y), pack_float2<Element>(a.z, a.w),
                                    pack_float2<Element>(b.x, b.y), pack_float2<Element>(b.z, b.w)};
}

}  // namespace flash_ext::sm80
