// Launch of the sm80 forward kernel for one (dtype, head dim); included by the generated
// translation units in csrc/instantiations/.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "fwd_kernel.cuh"
#include "launch_fwd.h"

namespace flash_ext::sm80 {

template <Elem16 kElem>
using ElementOf = std::conditional_t<kElem == Elem16::kBFloat16, __nv_bfloat16, __half>;

inline void throw_on_cuda_error(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("flash_ext: ") + what + ": " + cudaGetErrorString(status));
  }
}

template <Elem16 kElem, int kHeadDim>
void run_attention_fwd(const FwdParams& params, cudaStream_t stream) {
  using Config = typename FwdTileFor<kHeadDim>::type;
  using Element = ElementOf<kElem>;
  const auto kernel = attention_fwd_kernel<Config, Element>;
  constexpr size_t kSmemBytes = Config::kSmemElements * sizeof(Element);
  // Above 48 KB a kernel must opt in to its dynamic shared memory (cheap; per launch is fine).
  throw_on_cuda_error(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes),
                      "setting the forward kernel's shared memory size");

  const int64_t num_m_blocks = (params.seqlen_q + Config::kBlockM - 1) / Config::kBlockM;
  if (params.heads_q > 65535 || params.batch > 65535) {
    throw std::invalid_argument("flash_ext: the CUDA forward supports at most 65535 heads and 65535 batch entries");
  }
  const dim3 grid(static_cast<unsigned>(num_m_blocks), params.heads_q, params.batch);
  kernel<<<grid, Config::kThreads, kSmemBytes, stream>>>(params);
  throw_on_cuda_error(cudaGetLastError(), "launching the forward kernel");
}

}  // namespace flash_ext::sm80
