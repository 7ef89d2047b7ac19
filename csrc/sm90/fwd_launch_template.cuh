// Launch of the sm90 forward kernels for one (dtype, head dim): whether they can take a call, their TMA
// descriptors, and which instantiation runs it: the persistent kernel (plain or score modifiers, keys in
// packed rows or read in place from a KV cache) for every call without dropout, the one-tile kernel with dropout.
// Included by the generated translation units in csrc/instantiations/.
#pragma once

#include <cstdint>

#include "fwd_kernel.cuh"
#include "fwd_persistent_kernel.cuh"
#include "launch.h"
#include "launch_common.cuh"

namespace flash_ext::sm90 {

// The one-tile kernel's instantiation: dropout, with the score modifiers compiled in.
template <typename Element, int kHeadDim>
constexpr auto kFwdDropoutKernel = attention_fwd_sm90_kernel<Element, kHeadDim>;

// The persistent kernel's instantiation for a call without dropout.
template <typename Element, int kHeadDim, bool kKeysInCache>
constexpr auto persistent_kernel_of(bool score_mods) {
  return score_mods ? attention_fwd_sm90_persistent_kernel<Element, kHeadDim, true, kKeysInCache>
                    : attention_fwd_sm90_persistent_kernel<Element, kHeadDim, false, kKeysInCache>;
}

// The tensors as TMA sees them: (batch, rows, heads, head_dim); a variable-length batch is one packed batch
// entry of total rows; keys in a cache are its (rows, positions, heads, head_dim).
struct FwdTmaShape {
  int64_t batch, rows_q, batch_k, rows_k;
  TensorStrides q, k, v;

  FwdTmaShape(const FwdParams& params, int head_dim)
      : batch(params.is_varlen() ? 1 : params.batch),
        rows_q(params.is_varlen() ? params.total_q : params.seqlen_q),
        batch_k(params.keys_in_cache() ? params.cache_batch : batch),
        rows_k(params.keys_in_cache() ? params.cache_seqlen : params.is_varlen() ? params.total_k : params.seqlen_k),
        q(with_unit_dims_filled(params.q_strides, rows_q, params.heads_q, batch, head_dim)),
        k(with_unit_dims_filled(params.k_strides, rows_k, params.heads_kv, batch_k, head_dim)),
        v(with_unit_dims_filled(params.v_strides, rows_k, params.heads_kv, batch_k, head_dim)) {}
};

// Keys in a cache: TMA coordinates (rows, positions) in int32.
inline bool cache_layout_readable(const FwdParams& params) {
  if (!params.keys_in_cache()) return true;
  return params.cache_batch > 0 && params.cache_batch <= INT32_MAX && params.cache_seqlen > 0 &&
         params.cache_seqlen <= INT32_MAX;
}

// The persistent kernel's grid of tiles (a variable-length batch: seqlen_q is its longest sequence): it needs a
// per-call tile counter and counts tiles in int32 (2^31 tiles would be a q of terabytes).
inline int64_t fwd_num_tiles(const FwdParams& params, int block_m) {
  return (params.seqlen_q + block_m - 1) / block_m * params.heads_q * params.batch;
}

// Whether this build has the sm_90a code of these kernels (all of one translation unit: one answers for all).
template <typename Element, int kHeadDim>
bool fwd_has_code() {
  return has_sm90_code<attention_fwd_sm90_persistent_kernel<Element, kHeadDim, false, false>>();
}

template <Elem16 kElem, int kHeadDim>
bool fwd_applies(const FwdParams& params) {
  if (!device_is_sm90() || !fwd_has_code<ElementOf<kElem>, kHeadDim>()) return false;
  if (!params.has_dropout() && (params.tile_counter == nullptr ||
                                fwd_num_tiles(params, FwdSm90PersistentTile<kHeadDim>::kBlockM) > INT32_MAX)) {
    return false;
  }
  // Keys in a cache: the persistent kernel reads them (a variable-length q); a page holds whole key blocks.
  if (params.keys_in_cache() && (!params.is_varlen() || params.has_dropout())) return false;
  if (params.key_pages != nullptr && params.cache_seqlen % FwdSm90PersistentTile<kHeadDim>::kBlockN != 0) return false;
  if (!cache_layout_readable(params)) return false;
  const FwdTmaShape shape(params, kHeadDim);
  return shape.rows_q > 0 && shape.rows_k > 0 && tma_compatible(params.q, shape.q) &&
         tma_compatible(params.k, shape.k) && tma_compatible(params.v, shape.v) &&
         reinterpret_cast<uintptr_t>(params.out) % 16 == 0;
}

template <Elem16 kElem, int kHeadDim>
bool run_attention_fwd(const FwdParams& params, cudaStream_t stream) {
  using Tile = FwdSm90Tile<kHeadDim>;
  using Element = ElementOf<kElem>;
  if (!fwd_applies<kElem, kHeadDim>(params)) return false;
  const FwdTmaShape shape(params, kHeadDim);
  FwdTensorMaps maps;
  if (!encode_tensor_map<Element, Tile::kBlockM>(&maps.q, params.q, shape.q, shape.rows_q, params.heads_q,
                                                 shape.batch, kHeadDim) ||
      !encode_tensor_map<Element, Tile::kBlockN>(&maps.k, params.k, shape.k, shape.rows_k, params.heads_kv,
                                                 shape.batch_k, kHeadDim) ||
      !encode_tensor_map<Element, Tile::kBlockN>(&maps.v, params.v, shape.v, shape.rows_k, params.heads_kv,
                                                 shape.batch_k, kHeadDim)) {
    return false;
  }

  check_grid_limits(params, "forward");
  const int64_t num_m_blocks = (params.seqlen_q + Tile::kBlockM - 1) / Tile::kBlockM;
  // Without dropout: the persistent kernel, one CTA per SM.
  if (!params.has_dropout()) {
    using PersistentTile = FwdSm90PersistentTile<kHeadDim>;
    static_assert(PersistentTile::kBlockM == Tile::kBlockM && PersistentTile::kBlockN == Tile::kBlockN,
                  "both kernels read the same TMA boxes");
    const int64_t num_tiles = fwd_num_tiles(params, Tile::kBlockM);
    const auto persistent = params.keys_in_cache()
                                ? persistent_kernel_of<Element, kHeadDim, true>(params.has_score_mods())
                                : persistent_kernel_of<Element, kHeadDim, false>(params.has_score_mods());
    const int num_sms = current_device_info().num_sms;
    set_smem_limit(persistent, PersistentTile::kSmemBytes, "the sm90 persistent forward kernel");
    const unsigned grid = static_cast<unsigned>(num_tiles < num_sms ? num_tiles : num_sms);
    persistent<<<grid, PersistentTile::kThreads, PersistentTile::kSmemBytes, stream>>>(params, maps);
    throw_on_cuda_error(cudaGetLastError(), "launching the sm90 persistent forward kernel");
    return true;
  }
  const auto kernel = kFwdDropoutKernel<Element, kHeadDim>;
  set_smem_limit(kernel, Tile::kSmemBytes, "the sm90 forward kernel");
  const dim3 grid(static_cast<unsigned>(num_m_blocks), params.heads_q, params.batch);
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(params, maps);
  throw_on_cuda_error(cudaGetLastError(), "launching the sm90 forward kernel");
  return true;
}

}  // namespace flash_ext::sm90
