// Host-side launch helpers shared by the sm80 and sm90 launch templates (included by the generated
// translation units only; torch-free).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

#include "../host/device_info.h"
#include "../kernel_configs.h"
#include "../params.h"

namespace flash_ext {

template <Elem16 kElem>
using ElementOf = std::conditional_t<kElem == Elem16::kBFloat16, __nv_bfloat16, __half>;

inline void throw_on_cuda_error(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("flash_ext: ") + what + ": " + cudaGetErrorString(status));
  }
}

// Above 48 KB a kernel must opt in to its dynamic shared memory (cheap; per launch is fine).
template <typename Kernel>
void set_smem_limit(Kernel kernel, size_t bytes, const char* name) {
  throw_on_cuda_error(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
                      (std::string("setting the shared memory size of ") + name).c_str());
}

// CTAs of `kernel` (with `threads` threads and `smem_bytes` of dynamic shared memory) that fit on one SM of
// the current device; queried once per (kernel, device) and kept.
template <typename Kernel>
int occupancy_ctas_per_sm(Kernel kernel, int threads, int smem_bytes) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};  // 0: not queried yet (a kernel that fits gives >= 1)
  const int device = current_device();
  if (device >= 0 && device < kMaxDevices) {
    const int known = cached[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int count = 0;
  throw_on_cuda_error(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&count, kernel, threads, smem_bytes),
                      "querying a kernel's occupancy");
  if (device >= 0 && device < kMaxDevices && count > 0) cached[device].store(count, std::memory_order_relaxed);
  return count;
}

// Launches kernel<<<grid, block, smem_bytes, stream>>>(args...); with `programmatic_dependent`, as a
// programmatic dependent (PDL) of the kernel before it in the stream: it may start once every CTA of that
// kernel has executed griddepcontrol.launch_dependents (or exited), and must call griddepcontrol.wait
// before it reads what that kernel writes (common/ptx.cuh). Older GPUs ignore the attribute.
template <typename... KernelArgs, typename... Args>
void launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem_bytes, cudaStream_t stream,
                   bool programmatic_dependent, const char* what, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  cudaLaunchAttribute dependent;
  dependent.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  dependent.val.programmaticStreamSerializationAllowed = 1;
  if (programmatic_dependent) {
    config.attrs = &dependent;
    config.numAttrs = 1;
  }
  throw_on_cuda_error(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...), what);
}

inline void check_grid_limits(const FwdParams& params, const char* what) {
  if (params.heads_q > 65535 || params.batch > 65535) {
    throw std::invalid_argument(std::string("flash_ext: the CUDA ") + what +
                                " supports at most 65535 heads and 65535 batch entries");
  }
}

}  // namespace flash_ext
