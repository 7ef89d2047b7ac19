// Launch of the decode kernels for one (dtype, head dim); included by the generated translation units in
// csrc/instantiations/.
#pragma once

#include "../common/launch.cuh"
#include "../sm90/launch_common.cuh"  // device_is_sm90, has_sm90_code
#include "decode_kernel.cuh"
#include "launch.h"

#include <type_traits>

namespace flash_ext::decode {

// The caches' TMA tensor maps (boxes of 64 columns x kWarpKeys positions); false where TMA cannot describe them.
template <typename Element>
bool encode_cache_maps(DecodeTensorMaps* maps, const DecodeParams& params) {
  TensorStrides strides;
  strides.batch = params.cache_batch_stride;
  strides.row = params.cache_row_stride;
  strides.head = params.cache_head_stride;
  strides = sm90::with_unit_dims_filled(strides, params.cache_positions, params.heads_kv, params.cache_rows,
                                        params.head_dim);
  const auto encode = [&](CUtensorMap* map, const void* base) {
    return sm90::tma_compatible(base, strides) &&
           sm90::encode_tensor_map<Element, kWarpKeys>(map, base, strides, params.cache_positions, params.heads_kv,
                                                       params.cache_rows, params.head_dim);
  };
  return encode(&maps->k, params.k_cache) && encode(&maps->v, params.v_cache);
}

template <Elem16 kElem, int kHeadDim>
void run_attention_decode(const DecodeParams& params, cudaStream_t stream) {
  using Element = ElementOf<kElem>;
  const dim3 grid(params.num_splits, params.heads_kv * params.row_chunks, params.batch);
  DecodeTensorMaps maps{};
  auto launch = [&](auto row_tiles, auto sm90) {
    constexpr int kRowTiles = decltype(row_tiles)::value;
    constexpr bool kTma = decltype(sm90)::value && kRowTiles == 1;
    constexpr int kSmemBytes = smem_bytes(kHeadDim, kRowTiles, kTma);
    static_assert(resident_ctas_per_sm(kHeadDim, kRowTiles) >= 1, "a decode CTA's shared memory fits an SM");
    // The host's split count (ops_kvcache_cuda.cpp) assumes the cp.async shape's CTAs per SM.
    static_assert(resident_ctas_per_sm(kHeadDim, kRowTiles, kTma) == resident_ctas_per_sm(kHeadDim, kRowTiles),
                  "the TMA copies' barriers keep the CTAs an SM holds");
    auto* kernel = &attention_decode_kernel<Element, kHeadDim, kRowTiles, decltype(sm90)::value>;
    if (kSmemBytes > 48 * 1024) set_smem_limit(kernel, kSmemBytes, "the decode kernel");
    launch_kernel(kernel, grid, dim3(kThreads), kSmemBytes, stream, false, "launching the decode kernel", params,
                  maps);
  };
  const bool sm90 = sm90::device_is_sm90();
  if (row_tiles(params.heads_q / params.heads_kv * params.seqlen_q) == 1) {
    // TMA copies where every warp slice lies in one page (dense caches; pages of whole slices, no leftpad).
    const bool slices_in_pages =
        params.block_table == nullptr || (params.page_size % kWarpKeys == 0 && params.leftpad == nullptr);
    if (sm90 && slices_in_pages && sm90::has_sm90_code<attention_decode_kernel<Element, kHeadDim, 1, true>>() &&
        encode_cache_maps<Element>(&maps, params)) {
      launch(std::integral_constant<int, 1>{}, std::true_type{});
    } else {
      launch(std::integral_constant<int, 1>{}, std::false_type{});
    }
  } else if (sm90 && sm90::has_sm90_code<attention_decode_kernel<Element, kHeadDim, kWarps, true>>()) {
    launch(std::integral_constant<int, kWarps>{}, std::true_type{});
  } else {
    launch(std::integral_constant<int, kWarps>{}, std::false_type{});
  }
  if (params.num_splits > 1) {
    const int64_t rows_all = int64_t{params.batch} * params.seqlen_q * params.heads_q;
    launch_kernel(&attention_decode_combine_kernel<Element, kHeadDim>, dim3(static_cast<unsigned>(rows_all)),
                  dim3(kCombineThreads), 0, stream, true, "launching the decode combine kernel", params);
  }
}

}  // namespace flash_ext::decode
