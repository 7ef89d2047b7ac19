// Launch of the sm90 forward kernel for one (dtype, head dim): the TMA descriptors of q, k, v and the
// checks that decide whether the kernel takes the call. Included by the generated translation units
// in csrc/instantiations/.
#pragma once

#include <cstdint>

#include "fwd_kernel.cuh"
#include "fwd_persistent_kernel.cuh"
#include "launch.h"
#include "launch_common.cuh"

namespace flash_ext::sm90 {

template <Elem16 kElem, int kHeadDim>
bool run_attention_fwd(const FwdParams& params, cudaStream_t stream) {
  using Tile = FwdSm90Tile<kHeadDim>;
  using Element = ElementOf<kElem>;
  if (!device_is_sm90()) return false;

  const bool score_mods = params.softcap > 0.f || params.alibi_slopes != nullptr;
  const auto kernel = params.has_dropout() ? attention_fwd_sm90_kernel<Element, kHeadDim, true, true>
                      : score_mods         ? attention_fwd_sm90_kernel<Element, kHeadDim, true, false>
                                           : attention_fwd_sm90_kernel<Element, kHeadDim, false, false>;
  if (!has_sm90_code(kernel)) return false;

  // The tensors as TMA sees them: (batch, rows, heads, head_dim); a variable-length batch is one packed
  // batch entry of total rows.
  const int64_t batch = params.is_varlen() ? 1 : params.batch;
  const int64_t rows_q = params.is_varlen() ? params.total_q : params.seqlen_q;
  const int64_t rows_k = params.is_varlen() ? params.total_k : params.seqlen_k;
  if (rows_q == 0 || rows_k == 0) return false;
  const TensorStrides q_strides = with_unit_dims_filled(params.q_strides, rows_q, params.heads_q, batch, kHeadDim);
  const TensorStrides k_strides = with_unit_dims_filled(params.k_strides, rows_k, params.heads_kv, batch, kHeadDim);
  const TensorStrides v_strides = with_unit_dims_filled(params.v_strides, rows_k, params.heads_kv, batch, kHeadDim);
  if (!tma_compatible(params.q, q_strides) || !tma_compatible(params.k, k_strides) ||
      !tma_compatible(params.v, v_strides) || reinterpret_cast<uintptr_t>(params.out) % 16 != 0) {
    return false;
  }
  FwdTensorMaps maps;
  if (!encode_tensor_map<Element, Tile::kBlockM>(&maps.q, params.q, q_strides, rows_q, params.heads_q, batch,
                                                 kHeadDim) ||
      !encode_tensor_map<Element, Tile::kBlockN>(&maps.k, params.k, k_strides, rows_k, params.heads_kv, batch,
                                                 kHeadDim) ||
      !encode_tensor_map<Element, Tile::kBlockN>(&maps.v, params.v, v_strides, rows_k, params.heads_kv, batch,
                                                 kHeadDim)) {
    return false;
  }

  sm80::check_grid_limits(params, "forward");
  const int64_t num_m_blocks = (params.seqlen_q + Tile::kBlockM - 1) / Tile::kBlockM;
  // Sliding windows (a bounded left side) at head_dim 128: the persistent kernel, one CTA per SM.
  if constexpr (kHeadDim == FwdSm90PersistentTile::kHeadDim) {
    const int64_t num_tiles = num_m_blocks * params.heads_q * params.batch;  // the kernel counts them in int32
    if (params.window_left != FwdParams::kUnbounded && !params.is_varlen() && !score_mods && !params.has_dropout() &&
        num_tiles <= INT32_MAX) {
      const auto persistent = attention_fwd_sm90_persistent_kernel<Element>;
      int device = 0, num_sms = 0;
      throw_on_cuda_error(cudaGetDevice(&device), "querying the current device");
      throw_on_cuda_error(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device),
                          "querying the number of SMs");
      set_smem_limit(persistent, FwdSm90PersistentTile::kSmemBytes, "the sm90 persistent forward kernel");
      const unsigned grid = static_cast<unsigned>(num_tiles < num_sms ? num_tiles : num_sms);
      persistent<<<grid, FwdSm90PersistentTile::kThreads, FwdSm90PersistentTile::kSmemBytes, stream>>>(params, maps);
      throw_on_cuda_error(cudaGetLastError(), "launching the sm90 persistent forward kernel");
      return true;
    }
  }
  set_smem_limit(kernel, Tile::kSmemBytes, "the sm90 forward kernel");
  const dim3 grid(static_cast<unsigned>(num_m_blocks), params.heads_q, params.batch);
  kernel<<<grid, Tile::kThreads, Tile::kSmemBytes, stream>>>(params, maps);
  throw_on_cuda_error(cudaGetLastError(), "launching the sm90 forward kernel");
  return true;
}

}  // namespace flash_ext::sm90
