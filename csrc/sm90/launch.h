// Entry points of the sm90 (Hopper, wgmma + TMA) kernels, callable from torch-side C++. Each
// (dtype, head dim) is compiled in its own translation unit under csrc/instantiations/.
#pragma once

#include <cuda_runtime_api.h>

#include "../params.h"
#include "../sm80/launch.h"  // Elem16

namespace flash_ext::sm90 {

using sm80::Elem16;

// Runs the forward and returns true where the sm90 kernel takes the call: a compute capability 9.0
// device, a build with sm_90a code, TMA-compatible tensors (16-byte aligned bases, 16-byte multiples as
// strides, none 0). Returns false, having launched nothing, otherwise (the caller runs the sm80 kernel).
template <Elem16 kElem, int kHeadDim>
bool run_attention_fwd(const FwdParams& params, cudaStream_t stream);

}  // namespace flash_ext::sm90
