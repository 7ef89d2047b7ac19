// Launch of the sm90 dK/dV kernel for one (dtype, head dim): its TMA descriptors and the checks that
// decide whether it takes the call. Included by the generated translation units in csrc/instantiations/.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "bwd_kernel.cuh"
#include "launch.h"
#include "launch_common.cuh"

namespace flash_ext::sm90 {

// Launches `kernel` (an instantiation of attention_bwd_dkdv_sm90_kernel with tile Tile) where TMA can
// describe the tensors; false otherwise.
template <typename Element, typename Tile, typename Kernel>
bool launch_dkdv(Kernel kernel, const BwdParams& params, cudaStream_t stream) {
  constexpr int kHeadDim = Tile::kHeadDim;
  static_assert(Tile::kBlockN == bwd_keys_per_walk(kHeadDim), "the dQ conversion counts walks by bwd_keys_per_walk");
  if (!has_sm90_code(kernel)) return false;

  // The tensors as TMA sees them (as in the forward): a variable-length batch is one packed batch entry.
  const int64_t batch = params.is_varlen() ? 1 : params.batch;
  const int64_t rows_q = params.is_varlen() ? params.total_q : params.seqlen_q;
  const int64_t rows_k = params.is_varlen() ? params.total_k : params.seqlen_k;
  if (rows_q == 0 || rows_k == 0) return false;
  const TensorStrides q_strides = with_unit_dims_filled(params.q_strides, rows_q, params.heads_q, batch, kHeadDim);
  const TensorStrides dout_strides =
      with_unit_dims_filled(params.dout_strides, rows_q, params.heads_q, batch, kHeadDim);
  const TensorStrides k_strides = with_unit_dims_filled(params.k_strides, rows_k, params.heads_kv, batch, kHeadDim);
  const TensorStrides v_strides = with_unit_dims_filled(params.v_strides, rows_k, params.heads_kv, batch, kHeadDim);
  if (!tma_compatible(params.q, q_strides) || !tma_compatible(params.dout, dout_strides) ||
      !tma_compatible(params.k, k_strides) || !tma_compatible(params.v, v_strides) ||
      reinterpret_cast<uintptr_t>(params.dk) % 4 != 0 || reinterpret_cast<uintptr_t>(params.dv) % 4 != 0 ||
      reinterpret_cast<uintptr_t>(params.row_stats) % 16 != 0) {
    return false;
  }
  BwdTensorMaps maps;
  if (!encode_tensor_map<Element, Tile::kBlockM>(&maps.q, params.q, q_strides, rows_q, params.heads_q, batch,
                                                 kHeadDim) ||
      !encode_tensor_map<Element, Tile::kBlockM>(&maps.dout, params.dout, dout_strides, rows_q, params.heads_q, batch,
                                                 kHeadDim) ||
      !encode_tensor_map<Element, Tile::kBlockN>(&maps.k, params.k, k_strides, rows_k, params.heads_kv, batch,
                                                 kHeadDim) ||
      !encode_tensor_map<Element, Tile::kBlockN>(&maps.v, params.v, v_strides, rows_k, params.heads_kv, batch,
                                                 kHeadDim)) {
    return false;
  }
  // dK / dV by TMA stores where TMA can describe them too (else the kernel stores them from registers).
  const TensorStrides dk_strides = with_unit_dims_filled(params.dk_strides, rows_k, params.heads_kv, batch, kHeadDim);
  const TensorStrides dv_strides = with_unit_dims_filled(params.dv_strides, rows_k, params.heads_kv, batch, kHeadDim);
  maps.grads_by_tma = Tile::kGradsByTma && tma_compatible(params.dk, dk_strides) &&
                      tma_compatible(params.dv, dv_strides) &&
                      encode_tensor_map<Element, Tile::kBlockN>(&maps.dk, params.dk, dk_strides, rows_k,
                                                                params.heads_kv, batch, kHeadDim) &&
                      encode_tensor_map<Element, Tile::kBlockN>(&maps.dv, params.dv, dv_strides, rows_k,
                                                                params.heads_kv, batch, kHeadDim);

  set_smem_limit(kernel, Tile::kSmemBytes, "the sm90 dK/dV kernel");
  // Persistent: as many CTAs as fit at once (one per SM), or fewer where there are fewer tiles; they take
  // the tiles from params.dkdv_tile_counter. Otherwise a CTA per tile.
  const int64_t num_tiles = int64_t{(params.seqlen_k + Tile::kBlockN - 1) / Tile::kBlockN} * params.heads_kv *
                            params.batch;
  if (num_tiles > std::numeric_limits<int>::max()) return false;
  int device = 0, num_sms = 0, ctas_per_sm = 0;
  throw_on_cuda_error(cudaGetDevice(&device), "querying the current device");
  throw_on_cuda_error(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device),
                      "querying the SM count");
  throw_on_cuda_error(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas_per_sm, kernel, Tile::kThreads, Tile::kSmemBytes),
      "querying the sm90 dK/dV kernel's occupancy");
  const int64_t grid =
      Tile::kPersistent ? std::min<int64_t>(num_tiles, int64_t{num_sms} * std::max(ctas_per_sm, 1)) : num_tiles;
  // As a programmatic dependent of the preprocess, the kernel before it in the stream: its CTAs set up and
  // load K / V under that kernel's tail, then wait for it (attention_bwd_dkdv_sm90_kernel).
  launch_kernel(kernel, dim3(static_cast<unsigned>(grid)), dim3(Tile::kThreads), Tile::kSmemBytes, stream,
                /*programmatic_dependent=*/true, "launching the sm90 dK/dV kernel", params, maps);
  return true;
}

template <Elem16 kElem, int kHeadDim>
bool run_attention_bwd_dkdv(const BwdParams& params, cudaStream_t stream) {
  using Element = ElementOf<kElem>;
  // The tile counter is zeroed with the finished-walk counters (sm80/bwd_launch_template.cuh): both needed.
  if (sm90_disabled() || params.dq_accum == nullptr || params.row_stats == nullptr ||
      params.dkdv_finished == nullptr || params.dkdv_tile_counter == nullptr || !device_is_sm90()) {
    return false;
  }
  const bool score_mods = params.softcap > 0.f || params.alibi_slopes != nullptr;
  if (params.has_dropout()) {
    return launch_dkdv<Element, BwdSm90Tile<kHeadDim, true>>(attention_bwd_dkdv_sm90_kernel<Element, kHeadDim, true, true>,
                                                             params, stream);
  }
  if (score_mods) {
    return launch_dkdv<Element, BwdSm90Tile<kHeadDim, true>>(
        attention_bwd_dkdv_sm90_kernel<Element, kHeadDim, true, false>, params, stream);
  }
  return launch_dkdv<Element, BwdSm90Tile<kHeadDim, false>>(
      attention_bwd_dkdv_sm90_kernel<Element, kHeadDim, false, false>, params, stream);
}

}  // namespace flash_ext::sm90
