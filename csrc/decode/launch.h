// Entry point of the decode kernels (decode_kernel.cuh), callable from host C++, and the tile facts the host's
// split heuristic needs. Each (dtype, head dim) of kernel_configs.h's decode list is compiled in its own
// translation unit under csrc/instantiations/.
#pragma once

#include <cuda_runtime_api.h>

#include "../kernel_configs.h"
#include "append_params.h"
#include "decode_params.h"

namespace flash_ext::decode {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
// The most key splits of one call (num_splits beyond it is capped).
constexpr int kMaxSplits = 1024;

// Keys one warp copies per pipeline stage (one P·V k-step); a stage holds kCtaKeys keys, kWarpKeys per warp.
constexpr int kWarpKeys = 16;
constexpr int kCtaKeys = kWarps * kWarpKeys;

// Row tiles (16 packed (query, head of the group) rows of one kv head, one mma M tile) per CTA: one for decode,
// where the 4 warps take different keys of it and merge at the end; kWarps for more rows (speculative
// decoding), where warp w takes tile w over every key and the warps share each stage's K / V, so a byte is
// copied once per 64 rows rather than once per 16.
constexpr int row_tiles(int rows) { return rows <= 16 ? 1 : kWarps; }
constexpr int rows_per_cta(int rows) { return 16 * row_tiles(rows); }

// Stages of the K / V ring: three slices in flight per warp at head_dim 64 (2 KB each of K and V), two at 128
// (4 KB), one at 256 (8 KB; with more, a CTA would not fit an A100's 163 KB), so an H100 / H200 SM holds
// 64-128 KB of copies in flight.
constexpr int stages(int head_dim) { return head_dim <= 64 ? 4 : head_dim <= 128 ? 3 : 2; }
// Dynamic shared memory: the Q tile, then the ring (reused for the warps' merge).
constexpr int smem_bytes(int head_dim, int row_tiles) {
  const int ring = stages(head_dim) * 2 * kCtaKeys * head_dim * 2;
  // The merge: the warps' O rows and lse, merge weights, per row its lse and two indices.
  const int merge = kWarps * 16 * (head_dim + 2) * 4 + 16 * row_tiles * (4 + 16);
  return 16 * row_tiles * head_dim * 2 + (ring > merge ? ring : merge);
}
// CTAs one sm90 SM holds (227 KB of shared memory, 1 KB reserved per CTA).
constexpr int resident_ctas_per_sm(int head_dim, int row_tiles) {
  return 227 * 1024 / (smem_bytes(head_dim, row_tiles) + 1024);
}

// Writes params.out and params.lse (through out_partial / lse_partial when num_splits > 1).
template <Elem16 kElem, int kHeadDim>
void run_attention_decode(const DecodeParams& params, cudaStream_t stream);

// Writes the new keys and values of attention_with_kvcache into the caches (append_kernel.cuh).
template <Elem16 kElem>
void run_kv_append(const KvAppendParams& params, cudaStream_t stream);

}  // namespace flash_ext::decode
