// Tile sizes of the sm80 forward kernel: the geometry type, and the one place a geometry is
// chosen per head dim (FwdTileFor).
#pragma once

#include <type_traits>

#include "../common/smem_rows.cuh"

namespace flash_ext::sm80 {

// kBlockM query rows per CTA, kBlockN keys per inner-loop step, kWarps warps; each warp owns
// kBlockM / kWarps consecutive query rows (a multiple of 16, the mma row count).
// kMinCtasPerSm: the occupancy ptxas must keep (__launch_bounds__), i.e. a register cap; applied
// to plain attention only (the softcap / ALiBi variant spills under it at hd64).
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kWarps_, int kMinCtasPerSm_ = 1>
struct FwdTile {
  static constexpr int kMinCtasPerSm = kMinCtasPerSm_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kRowsPerWarp = kBlockM / kWarps;
  static constexpr int kMTiles = kRowsPerWarp / 16;

  using Rows = HeadDimRows<kHeadDim>;  // shared layout of the Q, K, V tiles (smem_rows.cuh)
  // Tile copies re-read threadIdx.x where registers are capped for occupancy (ptx.cuh).
  static constexpr bool kRereadThreadIndex = kMinCtasPerSm > 1;
  static constexpr int kSmemElements = (kBlockM + 2 * kBlockN) * Rows::kRowElements;  // Q, K, V tiles

  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "head dims are multiples of 32 up to 256");
  static_assert(kBlockM % (16 * kWarps) == 0, "a warp owns whole 16-row mma blocks");
  static_assert(kBlockN % 16 == 0, "kBlockN is a multiple of the mma k extent");
  static_assert(kSmemElements * 2 <= 163 * 1024, "the tiles fit an A100 (163 KB per block)");
};

// A tile geometry whose copies re-read the thread index (ptx.cuh); the forward's softcap / ALiBi / dropout
// variant with 32-row warps copies with it (fwd_kernel.cuh).
template <typename Tile>
struct RereadThreadIndex : Tile {
  static constexpr bool kRereadThreadIndex = true;
};

// The geometry shipped for each head dim.
//
// Reasoning:
// - A warp owning 32 rows reads each K/V fragment from shared memory once for two mma row
//   blocks; with 16 rows a warp reads ~256 bytes of shared memory per mma, above what shared
//   memory feeds at the mma.sync rate (128 B/clk/SM); with 32 rows ~160.
// - Registers: per thread, the O accumulator is rows_per_warp * head_dim / 32 floats and the
//   score tile rows_per_warp * kBlockN / 32. 32-row warps fit up to head_dim 128 with
//   kBlockN = 64 (ptxas, CUDA 13.0, sm_90a: 254 registers at hd128, no spills, with four copies of
//   the key-block body in fwd_kernel.cuh; a fifth made it spill 304 B); above that warps own 16 rows.
// Measured (H200, bf16, 16k tokens, hidden 2048, 2026-11-30; TFLOP/s at seqlen 2k / 8k, non-causal):
//   hd64:  M128 N64 W4 300 / 311    M128 N128 W4 301 / 314 (causal 2k: 269 vs 259)
//   hd128: M128 N64 W4 355 / 363    M128 N32 W4 245 / 260   M128 N64 W8 211 / 221
//   hd256: M64 N64 W4  273 / 279    M128 N64 W8 254 / 266   M128 N32 W8 230 / 237
// hd 160-224 take hd256's geometry (not measured separately).
// hd <= 64 fits 3 CTAs per SM in registers (168 each, no spills; unconstrained, ptxas takes 232 and
// only 2 fit: hd64 ~9% slower, 2026-11-30).
template <int kHeadDim>
struct FwdTileFor {
  using type = std::conditional_t<
      (kHeadDim <= 64), FwdTile<kHeadDim, 128, 64, 4, 3>,
      std::conditional_t<(kHeadDim <= 128), FwdTile<kHeadDim, 128, 64, 4>, FwdTile<kHeadDim, 64, 64, 4>>>;
};

}  // namespace flash_ext::sm80
