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
// Thread layout: kThreads / kRows consecutive threads share a row (one thread per row when the tile
// has at least as many rows as the CTA has threads), and a thread copies every
// (threads per row)-th 16-byte chunk of its row. All of a thread's chunks of a row are then
// immediate offsets from one global and one shared address: per chunk one LDGSTS instruction and no
// address arithmetic. (The loop this replaces, one fixed column per thread and a 64-bit pointer
// step per row, took 13 instructions per chunk: ~300 of the ~1140 a dK/dV warp executed per query
// block at head_dim 128, where FlashAttention-2 executes ~1010 in all -- ncu, H200.)
template <typename Config, int kRows, typename Element>
__device__ __forceinline__ void load_tile_async(Element* smem, const Element* gmem, int64_t gmem_row_stride,
                                                int valid_rows) {
  constexpr int kElementsPerChunk = 16 / sizeof(Element);
  constexpr int kChunksPerRow = Config::kHeadDim / kElementsPerChunk;
  constexpr int kThreadsPerRow = Config::kThreads > kRows ? Config::kThreads / kRows : 1;
  constexpr int kRowsPerPass = Config::kThreads / kThreadsPerRow;
  constexpr int kChunksPerThread = kChunksPerRow / kThreadsPerRow;
  static_assert(Config::kThreads % kRows == 0 || kRows % Config::kThreads == 0, "whole rows per thread group");
  static_assert(kChunksPerRow % kThreadsPerRow == 0, "a row's chunks split evenly among its threads");
  const int tid = thread_index_here();  // not hoisted: the offsets below would hold registers across loops
  const int first_row = tid / kThreadsPerRow;
  const int first_col = tid % kThreadsPerRow * kElementsPerChunk;
#pragma unroll
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
    const int row = first_row + pass * kRowsPerPass;
    const bool valid = row < valid_rows;
    // Zero-filled rows read nothing; their source address is row 0's, which every caller's tile has.
    const Element* src = gmem + (valid ? row : 0) * gmem_row_stride + first_col;
    const uint32_t dst = smem_address(smem + row * Config::kSmemRowPitch + first_col);
#pragma unroll
    for (int chunk = 0; chunk < kChunksPerThread; ++chunk) {
      cp_async_16(dst + chunk * kThreadsPerRow * 16, src + chunk * kThreadsPerRow * kElementsPerChunk, valid);
    }
  }
}

// The same copy as load_tile_async, each thread at one fixed column of every few rows, in a loop that is
// not unrolled: 13 instructions per chunk, but few registers. The forward uses it: at head_dim 128 it
// runs at 254 registers, and with load_tile_async's unrolled copies ptxas spilled 150-300 bytes there
// (CUDA 13.0, sm_90a; tried: other thread layouts, a rolled chunk loop, an opaque pass count).
template <typename Config, int kRows, typename Element>
__device__ __forceinline__ void load_tile_async_by_columns(Element* smem, const Element* gmem, int64_t gmem_row_stride,
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
