// Launch of the sm80 backward kernels for one (dtype, head dim): the plan's tail split and the three
// steps of bwd_plan.h. Included by the generated translation units in csrc/instantiations/.
#pragma once

#include <algorithm>
#include <type_traits>

#include "../common/launch.cuh"
#include "bwd_convert_kernels.cuh"
#include "bwd_dkdv_kernel.cuh"
#include "bwd_dq_kernel.cuh"
#include "bwd_preprocess_kernel.cuh"
#include "launch.h"

namespace flash_ext::sm80 {

// Buffers for the tiles a backward kernel streams (the dK/dV kernel's query blocks, the dQ kernel's
// key blocks): 2 (the next block loads while this one computes) unless the second buffer costs a
// CTA per SM or does not fit. The dK/dV kernel (8 warps of up to 255 registers) fits one CTA per SM
// anyway, so for it this is a question of fitting: on an H200 (227 KB per block) every head_dim
// double-buffers; on an A100 (163 KB) head_dim 32, 96 and 160. The dQ kernel (4 warps) fits two.
template <typename Tile>
int buffer_stages() {
  const DeviceInfo& device = current_device_info();
  constexpr int kReservedPerCta = 1024;  // the driver's per-CTA shared memory reservation
  constexpr int kCtasAllowedByRegisters = std::max(1, 65536 / (Tile::kThreads * 255));
  auto ctas_per_sm = [&](int stages) {
    const int bytes = Tile::smem_bytes(stages);
    return bytes > device.smem_per_block_optin
               ? 0
               : std::min(kCtasAllowedByRegisters, device.smem_per_sm / (bytes + kReservedPerCta));
  };
  if (ctas_per_sm(1) == 0) throw std::runtime_error("flash_ext: the backward's tiles do not fit in shared memory");
  return ctas_per_sm(2) >= ctas_per_sm(1) ? 2 : 1;
}

// The plain dK/dV kernel, its buffer stages and its shared memory, as every step launches it.
template <Elem16 kElem, int kHeadDim, bool kExtras, bool kPieces>
struct DkDvLaunch {
  using Tile = BwdDkDvTile<kHeadDim, kExtras>;
  static constexpr auto kernel = attention_bwd_dkdv_kernel<Tile, ElementOf<kElem>, kPieces>;
  int num_stages = buffer_stages<Tile>();
  int smem_bytes = Tile::smem_bytes(num_stages);
};

// Whether and how to split the dK/dV kernel's tail walks (TailSplit, params.h). Only where every walk has
// the same length (no causal mask, window or varlen), for plain attention (params.has_extras() false). With W
// walks, S = SMs x CTAs per SM slots and T = W mod S tail walks, the kernel without a split takes
// ceil(W / S) walk times; the whole waves take W / S of them, and the tail walks, split into p pieces each
// (pieces of length / p query blocks), take ceil(T p / S) rounds of (length / p + kPieceOverheadBlocks)
// block times: p is the cheapest of 1 .. length / 4 by that count. The overhead -- a piece's K / V load,
// its dK / dV atomics -- is an estimate in query-block times.
template <Elem16 kElem, int kHeadDim>
TailSplit best_tail_split(const BwdParams& params) {
  using Launch = DkDvLaunch<kElem, kHeadDim, false, false>;
  using Tile = typename Launch::Tile;
  constexpr int kPieceOverheadBlocks = 3;
  const bool uniform_walks = !params.is_varlen() && params.window_left == FwdParams::kUnbounded &&
                             params.window_right == FwdParams::kUnbounded;
  if (params.has_extras() || !uniform_walks) return {};
  const Launch launch;
  set_smem_limit(Launch::kernel, launch.smem_bytes, "the dK/dV kernel");
  const int64_t slots = int64_t{current_device_info().num_sms} *
                        occupancy_ctas_per_sm(Launch::kernel, Tile::kThreads, launch.smem_bytes);
  const int64_t walks = int64_t{(params.seqlen_k + Tile::kBlockKeys - 1) / Tile::kBlockKeys} * params.heads_kv *
                        params.batch;
  if (slots <= 0) return {};
  const int64_t tail = walks % slots;
  const int64_t length =  // (query head, query block) pairs per walk
      int64_t{params.heads_per_kv()} * ((params.seqlen_q + Tile::kBlockQueries - 1) / Tile::kBlockQueries);
  if (tail == 0) return {};
  int64_t best_pieces = 1;
  double best_cost = static_cast<double>(length);
  for (int64_t pieces = 2; pieces <= length / 4; ++pieces) {
    const double cost = static_cast<double>((tail * pieces + slots - 1) / slots) *
                        (static_cast<double>(length) / pieces + kPieceOverheadBlocks);
    if (cost < best_cost) {
      best_cost = cost;
      best_pieces = pieces;
    }
  }
  if (best_pieces == 1) return {};
  return {static_cast<int>(walks - tail), static_cast<int>(best_pieces)};
}

template <Elem16 kElem, int kHeadDim>
void plan_tail_split(const BwdParams& params, BwdPlan& plan) {
  using Tile = BwdDkDvTile<kHeadDim, false>;
  plan.tail_split = best_tail_split<kElem, kHeadDim>(params);
  if (plan.tail_split.pieces > 1) {
    const int64_t walks = int64_t{(params.seqlen_k + Tile::kBlockKeys - 1) / Tile::kBlockKeys} * params.heads_kv *
                          params.batch;
    plan.dkv_accum_floats = (walks - plan.tail_split.first_walk) * 2 * Tile::kBlockKeys * kHeadDim;
  }
}

template <Elem16 kElem, int kHeadDim>
void run_attention_bwd_preprocess(const BwdParams& params, const BwdPlan& plan, cudaStream_t stream) {
  check_grid_limits(params, "backward");
  // The preprocess kernel numbers rows through the batch; a variable-length batch is one packed batch
  // of total_q (= lse_head_stride) rows.
  const int64_t rows_per_batch = params.is_varlen() ? params.lse_head_stride : params.seqlen_q;
  const int64_t num_rows = params.is_varlen() ? params.lse_head_stride : int64_t{params.batch} * params.seqlen_q;
  // D = rowsum(dO ∘ O) (and row_stats): preprocess_lanes_per_row threads per (query row, head); the same
  // kernel zeroes the fp32 dQ accumulator, all of it (padding rows too), and the counters that follow it.
  const int64_t zero_floats = plan.dq_scratch_elements();
  static_assert(kHeadDim % 4 == 0 && kFinishedCounterStride % 4 == 0, "the zeroed region is whole 16-byte chunks");
  const int64_t num_threads = num_rows * params.heads_q * preprocess_lanes_per_row(kHeadDim);
  attention_bwd_preprocess_kernel<kHeadDim, ElementOf<kElem>>
      <<<static_cast<unsigned>((num_threads + 255) / 256), 256, 0, stream>>>(
          params, rows_per_batch, num_rows, reinterpret_cast<float4*>(params.dq_accum), zero_floats / 4);
  throw_on_cuda_error(cudaGetLastError(), "launching the backward preprocess kernel");
}

template <Elem16 kElem, int kHeadDim, bool kExtras>
void launch_dkdv(const BwdParams& params, const BwdPlan& plan, cudaStream_t stream) {
  using Launch = DkDvLaunch<kElem, kHeadDim, kExtras, false>;
  using Tile = typename Launch::Tile;
  const Launch launch;
  set_smem_limit(Launch::kernel, launch.smem_bytes, "the dK/dV kernel");
  const TailSplit split = kExtras ? TailSplit{} : plan.tail_split;
  const dim3 grid((params.seqlen_k + Tile::kBlockKeys - 1) / Tile::kBlockKeys, params.heads_kv, params.batch);
  Launch::kernel<<<grid, Tile::kThreads, launch.smem_bytes, stream>>>(params, launch.num_stages, split);
  throw_on_cuda_error(cudaGetLastError(), "launching the dK/dV kernel");
  if constexpr (!kExtras) {
    if (split.pieces > 1) {
      using Pieces = DkDvLaunch<kElem, kHeadDim, false, true>;
      const int num_split_walks = static_cast<int>(grid.x * grid.y * grid.z - static_cast<unsigned>(split.first_walk));
      throw_on_cuda_error(cudaMemsetAsync(params.dkv_accum, 0,
                                          sizeof(float) * num_split_walks * 2 * Tile::kBlockKeys * kHeadDim, stream),
                          "zeroing the dK / dV sums of the split walks");
      set_smem_limit(Pieces::kernel, launch.smem_bytes, "the dK/dV kernel (pieces)");
      Pieces::kernel<<<dim3(split.pieces, num_split_walks), Tile::kThreads, launch.smem_bytes, stream>>>(
          params, launch.num_stages, split);
      throw_on_cuda_error(cudaGetLastError(), "launching the dK/dV kernel (pieces)");
      const int64_t num_chunks = int64_t{num_split_walks} * 2 * Tile::kBlockKeys * (kHeadDim / 8);
      attention_bwd_convert_dkv_kernel<kHeadDim, Tile::kBlockKeys, ElementOf<kElem>>
          <<<static_cast<unsigned>((num_chunks + 255) / 256), 256, 0, stream>>>(params, split, num_split_walks);
      throw_on_cuda_error(cudaGetLastError(), "launching the dK / dV conversion kernel");
    }
  }
}

template <Elem16 kElem, int kHeadDim>
void run_attention_bwd_dkdv(const BwdParams& params, const BwdPlan& plan, cudaStream_t stream) {
  if (params.has_extras()) {
    launch_dkdv<kElem, kHeadDim, true>(params, plan, stream);
  } else {
    launch_dkdv<kElem, kHeadDim, false>(params, plan, stream);
  }
}

template <Elem16 kElem, int kHeadDim>
void run_attention_bwd_dq(const BwdParams& params, const BwdPlan& plan, int overlap_keys_per_walk,
                          cudaStream_t stream) {
  using Element = ElementOf<kElem>;
  if (plan.dq_by_atomics) {
    // A warp per (group of 8 accumulator rows, head, two 16-column tiles): dense, each sequence's groups;
    // variable-length, the groups of the whole accumulator before the overhang.
    const int64_t row_groups =
        params.is_varlen() ? (params.dq_accum_rows - DqAccumLayout::kOverhangRows) / DqAccumLayout::kTileRows
                           : (params.seqlen_q + DqAccumLayout::kTileRows - 1) / DqAccumLayout::kTileRows;
    const int64_t num_warps = (params.is_varlen() ? 1 : params.batch) * params.heads_q * row_groups *
                              (kHeadDim / (2 * DqAccumLayout::kTileCols));
    // After the sm90 kernel: launched as its programmatic dependent, to run on the SMs its persistent CTAs
    // leave as they run out of walks, each warp waiting for its own sequence's walks (common/finished_walks.cuh).
    DkDvWait wait;
    const bool overlap = overlap_keys_per_walk > 0;
    if (overlap) {
      wait.keys_per_walk = overlap_keys_per_walk;
      wait.key_blocks_launched = (params.seqlen_k + wait.keys_per_walk - 1) / wait.keys_per_walk;
    }
    launch_kernel(attention_bwd_convert_dq_kernel<kHeadDim, Element>, dim3(static_cast<unsigned>((num_warps + 7) / 8)),
                  dim3(256), 0, stream, overlap, "launching the dQ conversion kernel", params, row_groups, wait);
  } else {
    using DqTile = BwdDqTile<kHeadDim>;
    const auto dq_kernel = params.has_extras() ? attention_bwd_dq_kernel<DqTile, Element, true>
                                               : attention_bwd_dq_kernel<DqTile, Element, false>;
    const int num_stages = buffer_stages<DqTile>();
    const int smem_bytes = DqTile::smem_bytes(num_stages);
    set_smem_limit(dq_kernel, smem_bytes, "the dQ kernel");
    const dim3 grid((params.seqlen_q + DqTile::kBlockQueries - 1) / DqTile::kBlockQueries, params.heads_q,
                    params.batch);
    dq_kernel<<<grid, DqTile::kThreads, smem_bytes, stream>>>(params, num_stages);
    throw_on_cuda_error(cudaGetLastError(), "launching the dQ kernel");
  }
}

}  // namespace flash_ext::sm80
