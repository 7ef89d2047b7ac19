// Entry points of the sm90 (Hopper, wgmma + TMA) kernels, callable from host C++. Each (dtype, head dim)
// of kernel_configs.h's sm90 lists is compiled in its own translation unit under csrc/instantiations/.
#pragma once

#include <cuda_runtime_api.h>

#include "../kernel_configs.h"
#include "../params.h"

namespace flash_ext::sm90 {

// Whether the sm90 forward can take the call: a compute capability 9.0 device, a build with sm_90a code
// for this kernel, TMA-compatible tensors (16-byte aligned bases, 16-byte multiples as strides).
template <Elem16 kElem, int kHeadDim>
bool fwd_applies(const FwdParams& params);
// Runs the sm90 forward and returns true, or returns false having launched nothing where it does not
// apply (then the caller runs the sm80 one).
template <Elem16 kElem, int kHeadDim>
bool run_attention_fwd(const FwdParams& params, cudaStream_t stream);

// Keys per walk of the sm90 dK/dV kernel (BwdSm90Tile::kBlockN): what the dQ conversion counts its walks by.
constexpr int bwd_keys_per_walk(int head_dim) { return head_dim > 128 ? 64 : 128; }

// Whether the sm90 dK/dV kernel can take a backward: as fwd_applies, for q, dout, k and v, with dk and dv
// 4-byte aligned. (It adds dQ with atomics; with deterministic = true in a fixed order, common/ordered_dq.cuh.)
template <Elem16 kElem, int kHeadDim>
bool bwd_dkdv_applies(const BwdParams& params);
// Runs the backward's dK/dV step (bwd_plan.h: dK, dV written, dQ added into params.dq_accum, each walk
// counted in params.dkdv_finished) and returns true; false, having launched nothing, where a tensor map
// cannot be encoded after all.
template <Elem16 kElem, int kHeadDim>
bool run_attention_bwd_dkdv(const BwdParams& params, cudaStream_t stream);

}  // namespace flash_ext::sm90
