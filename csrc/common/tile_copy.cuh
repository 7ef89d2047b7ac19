// Global -> shared copies of (rows x head_dim) tiles with cp.async, into the tile layout
// (smem_rows.cuh) the kernels' ldmatrix addressing assumes.
#pragma once

#include <cstdint>

#include "ptx.cuh"
#include "smem_rows.cuh"

namespace flash_ext {

// Config provides kHeadDim, kThreads, Rows (the shared tile layout, smem_rows.cuh) and
// kRereadThreadIndex.
// Copies `rows` x kHeadDim elements (row r at gmem + r * gmem_row_stride) into a shared tile;
// rows at or past `valid_rows` are zero-filled.
//
// Thread layout, where a row is a whole number of 128-byte segments (head_dim 64, 128, 192, 256; 192 is
// not measured separately): consecutive threads copy one segment, so a warp's copy instruction covers 4 rows x 128
// bytes (FlashAttention-2's pattern); a row's segments are immediate offsets from one address. Against a warp covering
// whole rows (256-512 contiguous bytes; H200, bf16, seqlen 8k, 2026-11-30): forward hd256 277 -> 290 TFLOP/s
// (kernel 3.92 -> 3.70 ms); hd64 / hd128 and the backward within run-to-run noise (1-2%); 64-byte segments (8 rows per
// instruction) cost hd256 19% (235). ncu counted the same L2 sectors and requests either way, so the gain is not fewer
// L2 transactions; where it comes from is not established. Other head dims (32, 96, 160, 224) keep whole-row
// layouts (segments untimed there). The row loop is not unrolled: unrolled, ptxas keeps every chunk's address live
// across the main loop (hd128: ~60 more registers, and spills).
//
// kWholeTilePath: whole tiles (valid_rows >= kRows, a uniform branch) are copied by an unrolled loop:
// no per-row bounds test or zero-fill select, shared addresses as immediate offsets. SASS (dK/dV kernel,
// hd64): 4 copies in 11 instructions instead of 4 x 14 in the checked loop (ncu: load_query_block was
// ~210 of ~1400 instructions per warp and query block). ptxas: no new spills in the dK/dV kernel.
template <typename Config, int kRows, bool kWholeTilePath = false, typename Element>
__device__ __forceinline__ void load_tile_async(Element* smem, const Element* gmem, int64_t gmem_row_stride,
                                                int valid_rows) {
  constexpr int kChunksPerRow = Config::kHeadDim * sizeof(Element) / 16;
  constexpr int kElementsPerChunk = 16 / sizeof(Element);
  if constexpr (kChunksPerRow % 8 == 0 || Config::kThreads % kChunksPerRow == 0) {
    // Segments of 8 chunks (128 bytes), or the whole row where it is shorter (head_dim 32).
    constexpr int kSegmentChunks = kChunksPerRow % 8 == 0 ? 8 : kChunksPerRow;
    constexpr int kSegmentsPerRow = kChunksPerRow / kSegmentChunks;
    constexpr int kRowsPerPass = Config::kThreads / kSegmentChunks;
    // Config::kRereadThreadIndex: threadIdx.x re-read (S2R) per copy rather than kept live (ptx.cuh).
    unsigned thread = threadIdx.x;
    if constexpr (Config::kRereadThreadIndex) thread = thread_index_reread();
    int row = thread / kSegmentChunks;  // unsigned division: a shift
    const int col = thread % kSegmentChunks * kElementsPerChunk;
    static_assert(kRowsPerPass % 8 == 0, "a pass moves whole 8-row groups (the swizzle repeats every 8 rows)");
    using Rows = typename Config::Rows;
    const Element* src = gmem + row * gmem_row_stride + col;
    uint32_t dst = smem_address(smem) + Rows::offset(row, col);
    if (kWholeTilePath && valid_rows >= kRows) {
#pragma unroll
      for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
#pragma unroll
        for (int segment = 0; segment < kSegmentsPerRow; ++segment) {
          cp_async_16(dst + pass * kRowsPerPass * Rows::kRowBytes + segment * 128,
                      src + pass * kRowsPerPass * gmem_row_stride + segment * kSegmentChunks * kElementsPerChunk, true);
        }
      }
      return;
    }
#pragma unroll 1
    for (; row < kRows; row += kRowsPerPass) {
      const bool valid = row < valid_rows;
      const Element* row_src = valid ? src : gmem;  // zero-filled rows read nothing; row 0 is a valid address
#pragma unroll
      for (int segment = 0; segment < kSegmentsPerRow; ++segment) {
        // Segment s is 128-byte line s of the row in either layout.
        cp_async_16(dst + segment * 128, row_src + segment * kSegmentChunks * kElementsPerChunk, valid);
      }
      src += kRowsPerPass * gmem_row_stride;
      dst += kRowsPerPass * Rows::kRowBytes;
    }
  } else {
#pragma unroll 1
    for (int chunk_id = threadIdx.x; chunk_id < kRows * kChunksPerRow; chunk_id += Config::kThreads) {
      const int row = chunk_id / kChunksPerRow;
      const int col = chunk_id % kChunksPerRow * kElementsPerChunk;
      const bool valid = row < valid_rows;
      const Element* src = valid ? gmem + row * gmem_row_stride + col : gmem;
      cp_async_16(smem_address(smem) + Config::Rows::offset(row, col), src, valid);
    }
  }
}

}  // namespace flash_ext
