// Global -> shared copies of (rows x head_dim) tiles with cp.async, into the padded row layout
// the kernels' ldmatrix addressing assumes.
#pragma once

#include <cstdint>

#include "ptx.cuh"

namespace flash_ext {

// Config provides kHeadDim, kThreads and kSmemRowPitch (the shared row pitch in elements).
// Copies `rows` x kHeadDim elements (row r at gmem + r * gmem_row_stride) into a padded
// shared tile; rows at or past `valid_rows` are zero-filled.
template <typename Config, int kRows, typename Element>
__device__ __forceinline__ void load_tile_async(Element* smem, const Element* gmem, int64_t gmem_row_stride,
                                                int valid_rows) {
  constexpr int kChunksPerRow = Config::kHeadDim * sizeof(Element) / 16;
  constexpr int kElementsPerChunk = 16 / sizeof(Element);
  // The loops are not unrolled: unrolled, ptxas keeps every chunk's address live across the
  // main loop (hd128: ~60 more registers, and spills).
  if constexpr (Config::kThreads % kChunksPerRow == 0) {
    // Each thread copies one fixed column of every kRowsPerPass-th row: pointer increments only.
    constexpr int kRowsPerPass = Config::kThreads / kChunksPerRow;
    int row = threadIdx.x / kChunksPerRow;
    const int col = threadIdx.x % kChunksPerRow * kElementsPerChunk;
    const Element* src = gmem + row * gmem_row_stride + col;
    uint32_t dst = smem_address(smem + row * Config::kSmemRowPitch + col);
#pragma unroll 1
    for (; row < kRows; row += kRowsPerPass) {
      cp_async_16(dst, row < valid_rows ? src : gmem, row < valid_rows);
      src += kRowsPerPass * gmem_row_stride;
      dst += kRowsPerPass * Config::kSmemRowPitch * sizeof(Element);
    }
  } else {
#pragma unroll 1
    for (int chunk_id = threadIdx.x; chunk_id < kRows * kChunksPerRow; chunk_id += Config::kThreads) {
      const int row = chunk_id / kChunksPerRow;
      const int col = chunk_id % kChunksPerRow * kElementsPerChunk;
      const bool valid = row < valid_rows;
      const Element* src = valid ? gmem + row * gmem_row_stride + col : gmem;
      cp_async_16(smem_address(smem + row * Config::kSmemRowPitch + col), src, valid);
    }
  }
}

}  // namespace flash_ext
