// Tile sizes of the sm80 backward kernels.
#pragma once

#include "../common/smem_rows.cuh"

namespace flash_ext::sm80 {

// dK/dV kernel: a CTA of 8 warps owns kBlockKeys keys and walks the query blocks of
// kBlockQueries that can see them (128 up to head_dim 64, where the GEMMs' k-dimension is short and
// the per-block costs -- syncs, softmax, atomics -- weigh more; 64 above, where registers are the
// limit, and in the variant with softcap / ALiBi / dropout (kExtras), which spills 68-220 bytes with
// 128). Q, dO, lse and D of a query block are double-buffered (the next block loads while this one
// computes) where shared memory allows (buffer_stages in bwd_launch_template.cuh). Per query block,
// three phases with differently shaped warp tiles, the score tiles handed between them through
// shared memory (FlashAttention-2's layout):
//   1. Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ (keys x queries): kBlockKeys/32 x the rest warps of 32 keys x
//      kScoreQueries; Pᵀ and dSᵀ go to shared memory as 16-bit tiles;
//   2. dV += Pᵀ·dO, dK += dSᵀ·Q (keys x head_dim, accumulated in registers over the whole walk):
//      warps of kGradKeys (32, or 16 where the columns would not be a multiple of 16) x kGradCols;
//   3. dQ += dS·K (queries x head_dim, added to the fp32 buffer with atomics): warps of 32 queries
//      x (head_dim / (8 / row warps)) columns, or of 16 queries where that column count is not a
//      multiple of 16 (head_dim 96, 160, 224); columns in chunks of at most 32 accumulator floats.
// 32-row warp tiles read each shared operand fragment for two 16-row mma blocks: about 25% fewer
// shared-memory bytes per mma than 16-key warps that keep P and dS in registers (192 -> 144 x4
// ldmatrix per warp and block at head_dim 128), the resource the backward is bound by (ncu: L1 busy
// 72-84% with 16-key warps).
// Registers: dK and dV accumulators take kBlockKeys * head_dim / 256 floats each per thread. Up to
// head_dim 128 a CTA owns 128 keys; above, 64 (FlashAttention-2's choice too): 128 keys' accumulators
// do not fit beside the score tiles there.
template <int kHeadDim_, bool kExtras_>
struct BwdDkDvTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kExtras = kExtras_;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockKeys = kHeadDim <= 128 ? 128 : 64;
  static constexpr int kBlockQueries = kHeadDim <= 64 && !kExtras ? 128 : 64;
  using Rows = HeadDimRows<kHeadDim>;         // shared layout of the K, V, Q and dO tiles (smem_rows.cuh)
  static constexpr bool kRereadThreadIndex = false;  // tile copies keep threadIdx.x (ptx.cuh)
  using ScoreRows = PaddedRows<kBlockQueries>;  // Pᵀ and dSᵀ tiles (keys x queries), written by st.shared
  // Column warps of a warp grid over (rows x kHeadDim) whose warps own 32 rows; halved (16-row warps)
  // where a warp's column count would not be a multiple of 16 (two n-tiles per B load).
  static constexpr int col_warps(int rows) {
    const int for_32_rows = kWarps / (rows / 32);
    return (kHeadDim / for_32_rows) % 16 == 0 ? for_32_rows : for_32_rows / 2;
  }
  // Phase 1: warp (w % kScoreKeyWarps, w / kScoreKeyWarps) computes keys 32 (...) and queries kScoreQueries (...).
  static constexpr int kScoreKeyWarps = kBlockKeys / 32;
  static constexpr int kScoreQueries = kBlockQueries / (kWarps / kScoreKeyWarps);
  // Phase 2: warp (w % kGradKeyWarps, w / kGradKeyWarps) accumulates keys kGradKeys (...) and columns kGradCols (...).
  static constexpr int kGradKeyWarps = kWarps / col_warps(kBlockKeys);
  static constexpr int kGradKeys = kBlockKeys / kGradKeyWarps;
  static constexpr int kGradCols = kHeadDim / col_warps(kBlockKeys);
  // Phase 3: warp (w % kDqRowWarps, w / kDqRowWarps) adds queries kDqRows (...) x columns kDqCols (...).
  static constexpr int kDqRowWarps = kWarps / col_warps(kBlockQueries);
  static constexpr int kDqRows = kBlockQueries / kDqRowWarps;
  static constexpr int kDqCols = kHeadDim / col_warps(kBlockQueries);
  // The widest multiple of 16 columns dividing kDqCols whose accumulator is <= 32 floats per thread.
  static constexpr int dq_chunk_cols() {
    int best = 16;
    for (int cols = 16; cols <= kDqCols; cols += 16) {
      if (kDqCols % cols == 0 && (kDqRows / 16) * (cols / 8) * 4 <= 32) best = cols;
    }
    return best;
  }
  static constexpr int kDqChunkCols = dq_chunk_cols();

  // K and V, the 16-bit Pᵀ and dSᵀ, then per stage a Q and a dO tile and the block's lse and D.
  static constexpr int smem_bytes(int stages) {
    return 2 * kBlockKeys * (Rows::kRowBytes + ScoreRows::kRowBytes) +
           stages * (2 * kBlockQueries * Rows::kRowBytes + 2 * kBlockQueries * 4);
  }

  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "head dims are multiples of 32 up to 256");
  static_assert(kWarps % kScoreKeyWarps == 0 && kScoreQueries % 16 == 0, "phase 1 warp grid");
  static_assert(kGradKeys % 16 == 0 && kGradCols % 16 == 0, "phase 2 warp grid");
  static_assert(kDqRows % 16 == 0 && kDqCols % 16 == 0, "phase 3 warp grid");
  static_assert(kThreads >= kBlockQueries, "one thread copies each query row's lse and D");
  // sm80 is the oldest target: single-buffered, every tile fits the A100's 163 KB per block.
  static_assert(smem_bytes(1) <= 163 * 1024, "the dK/dV tiles fit an A100");
};

// dQ kernel (deterministic path only): a CTA of 4 warps owns kBlockQueries = 64 queries (16 per
// warp) and walks key blocks of kBlockKeys (32 above head_dim 128, where its 16 x head_dim dQ
// accumulator takes half the registers; 64 spilled there). K and V are double-buffered where that
// costs no CTA per SM (buffer_stages in bwd_launch_template.cuh): at head_dim 256 the second buffer
// took the H200 from 2 CTAs per SM to 1 and the kernel lost 5-7%; at 64 / 128 it gained 4-5%.
template <int kHeadDim_>
struct BwdDqTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockQueries = 16 * kWarps;
  static constexpr int kBlockKeys = kHeadDim <= 128 ? 64 : 32;
  using Rows = HeadDimRows<kHeadDim>;  // shared layout of the Q, dO, K and V tiles (smem_rows.cuh)
  static constexpr bool kRereadThreadIndex = false;  // tile copies keep threadIdx.x (ptx.cuh)
  // Q and dO tiles, and per stage a K and a V tile.
  static constexpr int smem_bytes(int stages) {
    return (2 * kBlockQueries + stages * 2 * kBlockKeys) * Rows::kRowBytes;
  }
  static_assert(smem_bytes(1) <= 163 * 1024, "the dQ tiles fit an A100 (163 KB per block)");
};

}  // namespace flash_ext::sm80
