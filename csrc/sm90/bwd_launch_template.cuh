// Launch of the sm90 dK/dV kernel for one (dtype, head dim): whether it can take a call and its TMA
// descriptors. Included by the generated translation units in csrc/instantiations/.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "bwd_kernel.cuh"
#include "launch.h"
#include "launch_common.cuh"

namespace flash_ext::sm90 {

// The dK/dV kernel's instantiations and the tile each uses (the plain one persistent and warp-specialised);
// kOrderedDq: those of deterministic = true.
template <typename Element, int kHeadDim, bool kOrderedDq>
struct DkDvKernels : Sm90Variants<attention_bwd_dkdv_sm90_kernel<Element, kHeadDim, false, false, kOrderedDq>,
                                  attention_bwd_dkdv_sm90_kernel<Element, kHeadDim, true, false, kOrderedDq>,
                                  attention_bwd_dkdv_sm90_kernel<Element, kHeadDim, true, true, kOrderedDq>> {
  using PlainTile = BwdSm90Tile<kHeadDim, false>;
  using ExtrasTile = BwdSm90Tile<kHeadDim, true>;
};

// The tensors as TMA sees them (as in the forward): a variable-length batch is one packed batch entry.
struct BwdTmaShape {
  int64_t batch, rows_q, rows_k;
  TensorStrides q, dout, k, v, dk, dv;

  BwdTmaShape(const BwdParams& params, int head_dim)
      : batch(params.is_varlen() ? 1 : params.batch),
        rows_q(params.is_varlen() ? params.total_q : params.seqlen_q),
        rows_k(params.is_varlen() ? params.total_k : params.seqlen_k),
        q(with_unit_dims_filled(params.q_strides, rows_q, params.heads_q, batch, head_dim)),
        dout(with_unit_dims_filled(params.dout_strides, rows_q, params.heads_q, batch, head_dim)),
        k(with_unit_dims_filled(params.k_strides, rows_k, params.heads_kv, batch, head_dim)),
        v(with_unit_dims_filled(params.v_strides, rows_k, params.heads_kv, batch, head_dim)),
        dk(with_unit_dims_filled(params.dk_strides, rows_k, params.heads_kv, batch, head_dim)),
        dv(with_unit_dims_filled(params.dv_strides, rows_k, params.heads_kv, batch, head_dim)) {}
};

template <Elem16 kElem, int kHeadDim>
bool bwd_dkdv_applies(const BwdParams& params) {
  if (!device_is_sm90() || !DkDvKernels<ElementOf<kElem>, kHeadDim, false>::has_code(params)) return false;
  const BwdTmaShape shape(params, kHeadDim);
  const int64_t num_tiles =
      int64_t{(params.seqlen_k + BwdSm90Tile<kHeadDim, false>::kBlockN - 1) / BwdSm90Tile<kHeadDim, false>::kBlockN} *
      params.heads_kv * params.batch;
  return shape.rows_q > 0 && shape.rows_k > 0 && num_tiles <= std::numeric_limits<int>::max() &&
         tma_compatible(params.q, shape.q) && tma_compatible(params.dout, shape.dout) &&
         tma_compatible(params.k, shape.k) && tma_compatible(params.v, shape.v) &&
         reinterpret_cast<uintptr_t>(params.dk) % 4 == 0 && reinterpret_cast<uintptr_t>(params.dv) % 4 == 0;
}

// The deterministic kernel's tile order (BwdWalk::coords_of): (batch, kv head) pairs per group, about
// kOrderedGroupRows query rows (over a GQA group's heads) in a group. In a wider group a head's walks start further
// apart, so that fewer of them wait for one another (at each query block a walk waits for the one of the key
// block above it), but more heads' Q and dO are read at once, from L2 or memory. H200, bf16, 16k tokens,
// deterministic bwd TFLOP/s at widths 1 / 4 / 16 / all pairs (2026-12-03): the best at seqlen 2k was 16, at 8k 4,
// for hd 64, 128 and 256 alike (hd128 8k: 456 / 471 / 460 / 448; hd256 2k: 165 / 208 / 283 / 186).
constexpr int64_t kOrderedGroupRows = 32768;
inline int ordered_tile_group_width(const BwdParams& params) {
  const int64_t pairs = std::max<int64_t>(int64_t{params.batch} * params.heads_kv, 1);
  const int64_t rows_per_pair = std::max<int64_t>(int64_t{params.heads_per_kv()} * params.seqlen_q, 1);
  return static_cast<int>(std::clamp<int64_t>(kOrderedGroupRows / rows_per_pair, 1, pairs));
}

// Launches `kernel` (an instantiation of attention_bwd_dkdv_sm90_kernel with tile Tile); false where a
// tensor map cannot be encoded.
template <typename Element, typename Tile, auto kKernel>
bool launch_dkdv(const BwdParams& params, cudaStream_t stream) {
  constexpr int kHeadDim = Tile::kHeadDim;
  static_assert(Tile::kBlockN == bwd_keys_per_walk(kHeadDim), "the dQ conversion counts walks by bwd_keys_per_walk");
  if (reinterpret_cast<uintptr_t>(params.row_stats) % 16 != 0) return false;
  if (params.deterministic && params.dq_turns == nullptr) return false;  // no turns to order dQ by
  const BwdTmaShape shape(params, kHeadDim);
  BwdTensorMaps maps;
  if (!encode_tensor_map<Element, Tile::kBlockM>(&maps.q, params.q, shape.q, shape.rows_q, params.heads_q,
                                                 shape.batch, kHeadDim) ||
      !encode_tensor_map<Element, Tile::kBlockM>(&maps.dout, params.dout, shape.dout, shape.rows_q, params.heads_q,
                                                 shape.batch, kHeadDim) ||
      !encode_tensor_map<Element, Tile::kBlockN>(&maps.k, params.k, shape.k, shape.rows_k, params.heads_kv,
                                                 shape.batch, kHeadDim) ||
      !encode_tensor_map<Element, Tile::kBlockN>(&maps.v, params.v, shape.v, shape.rows_k, params.heads_kv,
                                                 shape.batch, kHeadDim)) {
    return false;
  }
  // dK / dV by TMA stores where TMA can describe them too (else the kernel stores them from registers).
  maps.grads_by_tma = Tile::kGradsByTma && tma_compatible(params.dk, shape.dk) && tma_compatible(params.dv, shape.dv) &&
                      encode_tensor_map<Element, Tile::kBlockN>(&maps.dk, params.dk, shape.dk, shape.rows_k,
                                                                params.heads_kv, shape.batch, kHeadDim) &&
                      encode_tensor_map<Element, Tile::kBlockN>(&maps.dv, params.dv, shape.dv, shape.rows_k,
                                                                params.heads_kv, shape.batch, kHeadDim);

  set_smem_limit(kKernel, Tile::kSmemBytes, "the sm90 dK/dV kernel");
  // Persistent: as many CTAs as fit at once (one per SM), or fewer where there are fewer tiles; they take
  // the tiles from params.dkdv_tile_counter. Otherwise a CTA per tile.
  const int64_t num_tiles = int64_t{(params.seqlen_k + Tile::kBlockN - 1) / Tile::kBlockN} * params.heads_kv *
                            params.batch;
  const int ctas_per_sm = occupancy_ctas_per_sm(kKernel, Tile::kThreads, Tile::kSmemBytes);
  const int64_t grid =
      Tile::kPersistent ? std::min<int64_t>(num_tiles, int64_t{current_device_info().num_sms} * std::max(ctas_per_sm, 1))
                        : num_tiles;
  // As a programmatic dependent of the preprocess, the kernel before it in the stream: its CTAs set up and
  // load K / V under that kernel's tail, then wait for it (attention_bwd_dkdv_sm90_kernel).
  BwdParams launched = params;
  launched.ordered_head_group = ordered_tile_group_width(params);
  launch_kernel(kKernel, dim3(static_cast<unsigned>(grid)), dim3(Tile::kThreads), Tile::kSmemBytes, stream,
                /*programmatic_dependent=*/true, "launching the sm90 dK/dV kernel", launched, maps);
  return true;
}

template <typename Element, int kHeadDim, bool kOrderedDq>
bool launch_dkdv_variant(const BwdParams& params, cudaStream_t stream) {
  using Kernels = DkDvKernels<Element, kHeadDim, kOrderedDq>;
  if (params.has_dropout()) {
    return launch_dkdv<Element, typename Kernels::ExtrasTile, Kernels::kDropout>(params, stream);
  }
  if (params.has_score_mods()) {
    return launch_dkdv<Element, typename Kernels::ExtrasTile, Kernels::kScoreMods>(params, stream);
  }
  return launch_dkdv<Element, typename Kernels::PlainTile, Kernels::kPlain>(params, stream);
}

template <Elem16 kElem, int kHeadDim>
bool run_attention_bwd_dkdv(const BwdParams& params, cudaStream_t stream) {
  using Element = ElementOf<kElem>;
  if (params.deterministic) return launch_dkdv_variant<Element, kHeadDim, true>(params, stream);
  return launch_dkdv_variant<Element, kHeadDim, false>(params, stream);
}

}  // namespace flash_ext::sm90
