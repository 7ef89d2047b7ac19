// Entry point of the decode kernels (decode_kernel.cuh), callable from host C++, and the tile facts the host's
// split heuristic needs. Each (dtype, head dim) of kernel_configs.h's decode list is compiled in its own
// translation unit under csrc/instantiations/.
#pragma once

#include <cuda_runtime_api.h>

#include "../kernel_configs.h"
#include "decode_params.h"

namespace flash_ext::decode {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
// Packed (query, head of the group) rows of one kv head per CTA: one mma.sync M tile.
constexpr int kRowsPerCta = 16;
// Keys one warp takes per pipeline stage (one P·V k-step).
constexpr int kWarpKeys = 16;
// Keys a CTA takes per round of its warps; splits are multiples of it.
constexpr int kCtaKeys = kWarps * kWarpKeys;

// Stages of each warp's K/V ring: three slices in flight per warp at head_dim 64 (2 KB each of K and V),
// two at 128 / 256 (4 / 8 KB), so the SM holds 64-128 KB of copies in flight.
constexpr int stages(int head_dim) { return head_dim <= 64 ? 4 : 3; }
// Dynamic shared memory: the Q tile, then each warp's ring of K and V slices (reused for the warps' merge).
constexpr int smem_bytes(int head_dim) {
  const int ring = kWarps * stages(head_dim) * 2 * kWarpKeys * head_dim * 2;
  const int merge = kWarps * kRowsPerCta * (head_dim + 1) * 4;
  return kRowsPerCta * head_dim * 2 + (ring > merge ? ring : merge);
}
// CTAs one SM holds (227 KB of shared memory, 1 KB reserved per CTA).
constexpr int resident_ctas_per_sm(int head_dim) { return 227 * 1024 / (smem_bytes(head_dim) + 1024); }

// Writes params.out and params.lse (through out_partial / lse_partial when num_splits > 1).
template <Elem16 kElem, int kHeadDim>
void run_attention_decode(const DecodeParams& params, cudaStream_t stream);

}  // namespace flash_ext::decode
