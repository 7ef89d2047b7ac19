// Entry points of the sm90 (Hopper, wgmma + TMA) kernels, callable from torch-side C++. Each
// (dtype, head dim) is compiled in its own translation unit under csrc/instantiations/.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdlib>
#include <cstring>

#include "../params.h"
#include "../sm80/launch.h"  // Elem16

namespace flash_ext::sm90 {

using sm80::Elem16;

// Runs the forward and returns true where the sm90 kernel takes the call: a compute capability 9.0
// device, a build with sm_90a code, TMA-compatible tensors (16-byte aligned bases, 16-byte multiples as
// strides, none 0). Returns false, having launched nothing, otherwise (the caller runs the sm80 kernel).
template <Elem16 kElem, int kHeadDim>
bool run_attention_fwd(const FwdParams& params, cudaStream_t stream);

// The head dims with an sm90 dK/dV kernel.
constexpr bool has_bwd_kernel(int head_dim) { return head_dim == 64 || head_dim == 128 || head_dim == 256; }
// Keys per walk of the sm90 dK/dV kernel (BwdSm90Tile::kBlockN): what the dQ conversion counts its walks by.
constexpr int bwd_keys_per_walk(int head_dim) { return head_dim > 128 ? 64 : 128; }

// Runs the backward's dK/dV kernel (between the sm80 launcher's preprocess and dQ conversion: dK, dV
// written, dQ added into params.dq_accum) and returns true where the sm90 kernel takes the call: as the
// forward's conditions, and deterministic = false (params.dq_accum and params.row_stats set). Returns
// false, having launched nothing, otherwise (also without params.dkdv_finished and dkdv_tile_counter: its
// CTAs are persistent and take tiles from the latter). Defined where has_bwd_kernel(kHeadDim). Each walk is
// counted in params.dkdv_finished when done, for the dQ conversion's overlap (common/finished_walks.cuh).
template <Elem16 kElem, int kHeadDim>
bool run_attention_bwd_dkdv(const BwdParams& params, cudaStream_t stream);

// FLASH_EXT_DISABLE_SM90=1 sends every call to the sm80 kernels (for comparisons and for testing both
// paths on one Hopper GPU).
inline bool sm90_disabled() {
  const char* value = std::getenv("FLASH_EXT_DISABLE_SM90");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

}  // namespace flash_ext::sm90
