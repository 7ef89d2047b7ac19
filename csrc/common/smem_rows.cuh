// How a tile of 16-bit rows (kCols elements each) lies in shared memory: byte offsets of elements
// and how an ldmatrix lane address moves across the tile. Both layouts keep ldmatrix free of bank
// conflicts: the 8 row addresses of one 8x8 matrix (8 consecutive rows, the same 16-byte chunk)
// fall in 8 different 16-byte bank groups.
//
// PaddedRows: each row padded by 16 bytes, so the row pitch is an odd number of 16-byte units.
// SwizzledRows (rows of 128, 256 or 512 bytes: head dims 64, 128, 256): unpadded; 16-byte chunk c of
//   row r is stored at chunk (c & ~7) | ((c ^ r) & 7), an XOR within its 128-byte line. Why: a warp's
//   cp.async covers 4 rows x 128 contiguous global bytes (tile_copy.cuh), and with padded rows 3 of
//   those 4 rows land across two 128-byte shared lines. ncu (H200, bf16, 8k, forward hd128) counted
//   those copies at 2.6x the ideal shared wavefronts and 1.5x the ideal L2 sectors (FlashAttention-2's
//   swizzled copies: 1.0x), and the warps stalled on them (long scoreboard) for ~8% of their samples.
//   The padded layout stays for the other head dims (rows not a power-of-two number of lines) and
//   for tiles no cp.async writes (the backward's Pᵀ and dSᵀ).
//
// Lane addresses: tile + offset(row, col) with col a multiple of 8 (warp_gemm.cuh's *_lane_address);
// move(address, rows, cols) then adds whole 8-row groups (rows % 8 == 0) and 16-column steps
// (cols % 16 == 0). In the swizzled
// layout a move is an XOR on the chunk bits, which equals the add it stands for only if the lane's
// own chunk (col / 8) and cols / 8 share no set bit among their low three bits. The kernels make lane
// addresses at column W + 8h (h = 0 or 1, W a multiple of the warp's column extent, a power of two
// of at least 16 columns) and move within that extent, which satisfies it.
#pragma once

#include <cstdint>
#include <type_traits>

namespace flash_ext {

template <int kCols>
struct PaddedRows {
  static constexpr int kRowBytes = kCols * 2 + 16;
  static constexpr int kRowElements = kRowBytes / 2;

  __device__ __forceinline__ static uint32_t offset(int row, int col) {
    return static_cast<uint32_t>(row * kRowBytes + col * 2);
  }
  __device__ __forceinline__ static uint32_t move(uint32_t address, int rows, int cols) {
    return address + static_cast<uint32_t>(rows * kRowBytes + cols * 2);
  }

  struct ColumnVariants {
    uint32_t address;
  };
  __device__ __forceinline__ static ColumnVariants column_variants(uint32_t address) { return {address}; }
  __device__ __forceinline__ static uint32_t move(const ColumnVariants& lane, int rows, int cols) {
    return move(lane.address, rows, cols);
  }
};

template <int kCols>
struct SwizzledRows {
  static constexpr int kRowBytes = kCols * 2;
  static constexpr int kRowElements = kCols;
  static_assert(kRowBytes == 128 || kRowBytes == 256 || kRowBytes == 512, "rows of 1, 2 or 4 whole 128-byte lines");

  // The tile's base address must be 128-byte aligned (tile bases are multiples of kRowBytes).
  __device__ __forceinline__ static uint32_t offset(int row, int col) {
    const int chunk = col / 8;
    const int stored_chunk = (chunk & ~7) | ((chunk ^ row) & 7);
    return static_cast<uint32_t>(row * kRowBytes + stored_chunk * 16 + (col % 8) * 2);
  }
  // One move; an XOR where the column move is not a whole number of lines. The XOR is an asm volatile,
  // so it stays where the move is written (once per k-step in the GEMMs, warp_gemm.cuh) rather than
  // XORed copies of every lane address being hoisted and kept live across the main loop. (A plain `^`
  // gives the shipped kernels the same ptxas spills, but their timings are of this form.)
  __device__ __forceinline__ static uint32_t move(uint32_t address, int rows, int cols) {
    const int chunks = cols / 8;
    return xor_chunks(address, chunks & 7) + static_cast<uint32_t>((chunks & ~7) * 16 + rows * kRowBytes);
  }

  // A lane address at the four XOR patterns of even chunk moves (0, 16, 32, 48 columns within a line),
  // formed once (three XORs) for an operand that moves along its columns inside a loop: every move from
  // it is then an add.
  struct ColumnVariants {
    uint32_t address[4];
  };
  __device__ __forceinline__ static ColumnVariants column_variants(uint32_t address) {
    return {{address, xor_chunks(address, 2), xor_chunks(address, 4), xor_chunks(address, 6)}};
  }
  __device__ __forceinline__ static uint32_t move(const ColumnVariants& lane, int rows, int cols) {
    const int chunks = cols / 8;
    return lane.address[(chunks & 7) / 2] + static_cast<uint32_t>((chunks & ~7) * 16 + rows * kRowBytes);
  }

 private:
  __device__ __forceinline__ static uint32_t xor_chunks(uint32_t address, int chunks) {
    if (chunks == 0) return address;
    uint32_t moved;
    asm volatile("xor.b32 %0, %1, %2;\n" : "=r"(moved) : "r"(address), "r"(chunks * 16));
    return moved;
  }
};

// The layout TMA writes with its 128-byte swizzle and wgmma reads (sm90/ptx_sm90.cuh, swizzle128_descriptor):
// a tile of `rows` rows stored as 64-column regions of rows x 128 bytes, the 16-byte chunk c of row r at chunk
// c ^ (r % 8) of its 128-byte line. Byte offset of (row, col).
__device__ __forceinline__ uint32_t swizzled_offset(int rows, int row, int col) {
  const int chunk = (col % 64) / 8;
  return (col / 64) * rows * 128 + row * 128 + ((chunk ^ (row % 8)) * 16) + (col % 8) * 2;
}

// The same layout for tiles of kRows rows that cp.async fills and wgmma reads (the sm90 speculative-decoding
// kernel's Q tile and K / V stages): offsets only, no ldmatrix lane addresses.
template <int kRows>
struct Swizzle128Regions {
  __device__ __forceinline__ static uint32_t offset(int row, int col) {
    return swizzled_offset(kRows, row, col);
  }
};

// The layout of the (rows x head_dim) tiles that cp.async fills (Q, K, V, dO).
template <int kHeadDim>
using HeadDimRows =
    std::conditional_t<kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, SwizzledRows<kHeadDim>, PaddedRows<kHeadDim>>;

}  // namespace flash_ext
