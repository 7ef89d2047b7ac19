// Global -> shared copies of (rows x head_dim) tiles with cp.async, into the padded row layout
// the kernels' ldmatrix addressing assumes.
#pragma once

#include <cstdint>

#include "ptx.cuh"

namespace flash_ext {

// Config provides kHeadDim, kThreads and kSmemRowPitch (the shared row pitch in elements).
// Copies `rows` x kHeadDim elements (row r at gmem + r * gmem_row_stride) into a padded
// shared tile; rows at or past `valid_rows` are zero-filled.
//
// Thread layout: a row is cut into segments of kSegmentChunks 16-byte chunks (128 bytes, or 64 where
// the row's chunk count is no multiple of 8), and consecutive threads copy one segment: a warp's copy
// instruction covers 4 (or 8) rows x one 128-byte (64-byte) segment, FlashAttention-2's pattern. A warp
// covering whole 256-512-byte row runs instead made the L2 serve 2.5-4x the requests and 1.6-2.2x the
// sectors for the same bytes (ncu, H200: forward hd256 801M sectors / 352M requests vs 500M / 126M;
// backward hd128 417M / 182M vs 188M / 45M), and warps waited on those copies (stalled on the long
// scoreboard 1.42 cycles per instruction in the hd256 forward against FlashAttention-2's 0.10).
// The row loop is not unrolled: unrolled, ptxas keeps every chunk's address live across the main loop
// (hd128: ~60 more registers, and spills); a row's segments are immediate offsets from one address.
template <typename Config, int kRows, typename Element>
__device__ __forceinline__ void load_tile_async(Element* smem, const Element* gmem, int64_t gmem_row_stride,
                                                int valid_rows) {
  constexpr int kChunksPerRow = Config::kHeadDim * sizeof(Element) / 16;
  constexpr int kElementsPerChunk = 16 / sizeof(Element);
  constexpr int kSegmentChunks = kChunksPerRow % 8 == 0 ? 8 : 4;
  constexpr int kSegmentsPerRow = kChunksPerRow / kSegmentChunks;
  constexpr int kRowsPerPass = Config::kThreads / kSegmentChunks;
  static_assert(kChunksPerRow % kSegmentChunks == 0, "whole segments per row");
  int row = threadIdx.x / kSegmentChunks;
  const int col = threadIdx.x % kSegmentChunks * kElementsPerChunk;
  const Element* src = gmem + row * gmem_row_stride + col;
  uint32_t dst = smem_address(smem + row * Config::kSmemRowPitch + col);
#pragma unroll 1
  for (; row < kRows; row += kRowsPerPass) {
    const bool valid = row < valid_rows;
    const Element* row_src = valid ? src : gmem;  // zero-filled rows read nothing; row 0 is a valid address
#pragma unroll
    for (int segment = 0; segment < kSegmentsPerRow; ++segment) {
      cp_async_16(dst + segment * kSegmentChunks * 16, row_src + segment * kSegmentChunks * kElementsPerChunk, valid);
    }
    src += kRowsPerPass * gmem_row_stride;
    dst += kRowsPerPass * Config::kSmemRowPitch * sizeof(Element);
  }
}

}  // namespace flash_ext
