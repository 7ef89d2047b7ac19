// Launch of the sm80 forward kernel for one (dtype, head dim); included by the generated
// translation units in csrc/instantiations/.
#pragma once

#include "../common/launch.cuh"
#include "fwd_kernel.cuh"
#include "launch.h"

namespace flash_ext::sm80 {

template <Elem16 kElem, int kHeadDim>
void run_attention_fwd(const FwdParams& params, cudaStream_t stream) {
  using Config = typename FwdTileFor<kHeadDim>::type;
  using Element = ElementOf<kElem>;
  const auto kernel = params.has_extras() ? attention_fwd_kernel<Config, Element, true>
                                          : attention_fwd_kernel<Config, Element, false>;
  constexpr size_t kSmemBytes = Config::kSmemElements * sizeof(Element);
  set_smem_limit(kernel, kSmemBytes, "the forward kernel");

  const int64_t num_m_blocks = (params.seqlen_q + Config::kBlockM - 1) / Config::kBlockM;
  check_grid_limits(params, "forward");
  const dim3 grid(static_cast<unsigned>(num_m_blocks), params.heads_q, params.batch);
  kernel<<<grid, Config::kThreads, kSmemBytes, stream>>>(params);
  throw_on_cuda_error(cudaGetLastError(), "launching the forward kernel");
}

}  // namespace flash_ext::sm80
