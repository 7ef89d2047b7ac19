// Launch of the decode kernels for one (dtype, head dim); included by the generated translation units in
// csrc/instantiations/.
#pragma once

#include "../common/launch.cuh"
#include "../sm90/launch_common.cuh"  // device_is_sm90, has_sm90_code
#include "decode_kernel.cuh"
#include "launch.h"

#include <type_traits>

namespace flash_ext::decode {

template <Elem16 kElem, int kHeadDim>
void run_attention_decode(const DecodeParams& params, cudaStream_t stream) {
  using Element = ElementOf<kElem>;
  const dim3 grid(params.num_splits, params.heads_kv * params.row_chunks, params.batch);
  auto launch = [&](auto row_tiles, auto wgmma) {
    constexpr int kRowTiles = decltype(row_tiles)::value;
    constexpr int kSmemBytes = smem_bytes(kHeadDim, kRowTiles);
    static_assert(resident_ctas_per_sm(kHeadDim, kRowTiles) >= 1, "a decode CTA's shared memory fits an SM");
    auto* kernel = &attention_decode_kernel<Element, kHeadDim, kRowTiles, decltype(wgmma)::value>;
    if (kSmemBytes > 48 * 1024) set_smem_limit(kernel, kSmemBytes, "the decode kernel");
    launch_kernel(kernel, grid, dim3(kThreads), kSmemBytes, stream, false, "launching the decode kernel", params);
  };
  if (row_tiles(params.heads_q / params.heads_kv * params.seqlen_q) == 1) {
    launch(std::integral_constant<int, 1>{}, std::false_type{});
  } else if (sm90::device_is_sm90() &&
             sm90::has_sm90_code<attention_decode_kernel<Element, kHeadDim, kWarps, true>>()) {
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
