// Tile sizes of the sm80 backward kernels.
#pragma once

namespace flash_ext::sm80 {

// Both backward kernels run 4 warps of 16 rows:
// - dK/dV kernel: a CTA owns kBlockKeys = 64 keys (16 per warp; the warp's rows are keys) and
//   walks the query blocks of kBlockQueries that can see them. Q, dO, lse and D of a query block
//   are double-buffered (the next block loads while this one computes) where shared memory
//   allows it without losing a CTA per SM (see dkdv_stages in bwd_launch_template.cuh).
// - dQ kernel (deterministic path only): a CTA owns kBlockQueries = 64 queries (16 per warp) and
//   walks key blocks of kDqBlockKeys (32 above head_dim 128, where its 16 x head_dim dQ
//   accumulator takes half the registers; 64 spilled there).
// Registers: the dK/dV kernel holds two accumulators of 16 x head_dim (dK and dV, head_dim / 2
// floats each per thread) beside two 16 x 64 score tiles (32 each). Above head_dim 128 that
// does not fit, so dV and dK are produced by two launches (kSplitDkDv), each recomputing P.
template <int kHeadDim_>
struct BwdTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockKeys = 16 * kWarps;
  static constexpr int kBlockQueries = 64;
  static constexpr int kSmemRowPitch = kHeadDim + 8;       // elements; padding as FwdTile's
  static constexpr int kDsRowPitch = kBlockQueries + 8;    // dSᵀ tile (keys x queries), same padding rule
  static constexpr int kDqBlockKeys = kHeadDim <= 128 ? 64 : 32;
  static constexpr bool kSplitDkDv = kHeadDim > 128;

  // dK/dV kernel: K and V, the dSᵀ tile (for the fused dQ), then per stage a Q and a dO tile
  // and the block's lse and D.
  static constexpr int dkdv_smem_bytes(int stages) {
    return (2 * kBlockKeys * kSmemRowPitch + kBlockKeys * kDsRowPitch) * 2 +
           stages * (2 * kBlockQueries * kSmemRowPitch * 2 + 2 * kBlockQueries * 4);
  }
  // dQ kernel: Q, dO, K and V tiles.
  static constexpr int kDqSmemBytes = (2 * kBlockQueries + 2 * kDqBlockKeys) * kSmemRowPitch * 2;

  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "head dims are multiples of 32 up to 256");
  static_assert(kBlockQueries == 16 * kWarps, "the dQ kernel's warps own 16 query rows each");
  static_assert(kThreads >= kBlockQueries, "one thread copies each query row's lse and D");
};

}  // namespace flash_ext::sm80
