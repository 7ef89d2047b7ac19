// Tile sizes of the sm80 backward kernels.
#pragma once

namespace flash_ext::sm80 {

// dK/dV kernel: a CTA of kWarps warps owns kBlockKeys = 16 * kWarps keys (16 per warp: the warp's
// rows are keys) and walks the query blocks of kBlockQueries that can see them. Q, dO, lse and D
// of a query block are double-buffered (the next block loads while this one computes) where the
// per-block shared memory allows it (see dkdv_stages in bwd_launch_template.cuh).
// Registers: each thread holds the dK and dV accumulators of 16 x head_dim (head_dim / 2 floats
// each) beside two 16 x 64 score tiles (32 each). Above head_dim 128 that does not fit, so dV and
// dK are produced by two launches (kSplitDkDv), each recomputing P.
template <int kHeadDim_, int kWarps_>
struct BwdDkDvTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarps = kWarps_;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockKeys = 16 * kWarps;
  static constexpr int kBlockQueries = 64;
  static constexpr int kSmemRowPitch = kHeadDim + 8;     // elements; padding as FwdTile's
  static constexpr int kDsRowPitch = kBlockQueries + 8;  // dSᵀ tile (keys x queries), same padding rule
  static constexpr bool kSplitDkDv = kHeadDim > 128;

  // K and V, the dSᵀ tile (for the fused dQ), then per stage a Q and a dO tile and the block's
  // lse and D.
  static constexpr int smem_bytes(int stages) {
    return (2 * kBlockKeys * kSmemRowPitch + kBlockKeys * kDsRowPitch) * 2 +
           stages * (2 * kBlockQueries * kSmemRowPitch * 2 + 2 * kBlockQueries * 4);
  }

  static_assert(kHeadDim % 32 == 0 && kHeadDim <= 256, "head dims are multiples of 32 up to 256");
  static_assert(kThreads >= kBlockQueries, "one thread copies each query row's lse and D");
};

// dQ kernel (deterministic path only): a CTA of 4 warps owns kBlockQueries = 64 queries (16 per
// warp) and walks key blocks of kBlockKeys (32 above head_dim 128, where its 16 x head_dim dQ
// accumulator takes half the registers; 64 spilled there).
template <int kHeadDim_>
struct BwdDqTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kWarps = 4;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockQueries = 16 * kWarps;
  static constexpr int kBlockKeys = kHeadDim <= 128 ? 64 : 32;
  static constexpr int kSmemRowPitch = kHeadDim + 8;
  // Q, dO, K and V tiles.
  static constexpr int kSmemBytes = (2 * kBlockQueries + 2 * kBlockKeys) * kSmemRowPitch * 2;
};

// The dK/dV kernel's warps. 8 (128 keys per CTA) against 4 (64): each dQ element gets half as
// many atomic adds, at the same registers per thread (1 CTA of 8 warps per SM instead of 2 of 4).
template <int kHeadDim>
using BwdDkDvTileFor = BwdDkDvTile<kHeadDim, 8>;

}  // namespace flash_ext::sm80
