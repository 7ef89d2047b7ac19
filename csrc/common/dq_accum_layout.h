// Layout of the fp32 dQ accumulator of the CUDA backward (bwd_plan.h, dq_by_atomics): scratch that
// only the backward launcher (zeroes it with a memset), the dK/dV kernel (adds into it with atomics) and the
// convert kernel (reads it back into dq) touch, so its layout is chosen for the atomics.
//
// Why not q's row-major layout: the dK/dV kernel adds mma accumulator fragments, in which a lane
// holds columns 2 (lane % 4) and + 1 of row lane / 4 of each 8-column n-tile (and the same of the row
// + 8). Row-major, one warp-wide float2 atomic spans 8 rows: 8 L2 requests for 256 bytes. ncu on the
// H200 (hd128, 8k) counted 4x FlashAttention-2's L2 requests for the same sectors.
//
// Here the buffer is cut into tiles of 8 rows x 16 columns (512 bytes), and the 16 columns of each
// row are stored so that a lane's four values of two neighbouring n-tiles are adjacent: column
// 8 h + 2 q + e (n-tile h, lane % 4 = q, element e) at 4 q + 2 h + e. Lane l's four floats of a tile
// then sit at 4 l: a warp adds a whole tile with one 16-byte-per-lane atomic (sm90:
// red.global.add.v4.f32) into 512 contiguous bytes.
//
// Tiles are ordered by head, then group of 8 rows, then group of 16 columns: the tiles a warp of the
// dK/dV kernel adds (consecutive row groups, neighbouring columns, one head) are compile-time offsets
// from one address, so its atomics need no address arithmetic. Rows: sequence b's first row is
// first_row(begin, b), 8-aligned, and sequences are at least their length rounded up to 8 apart, so no
// tile holds rows of two sequences. The dK/dV kernel adds whole query blocks (up to kOverhangRows
// rows) without checking where the sequence ends: the rows past it hold dS = 0, so it adds zeros to
// padding, to the next sequence's rows, or (the last sequence) to the overhang allocated for that.
#pragma once

#include <cstdint>

#include "host_device.h"

namespace flash_ext {

struct DqAccumLayout {
  static constexpr int kTileRows = 8;
  static constexpr int kTileCols = 16;
  static constexpr int kTileFloats = kTileRows * kTileCols;
  static constexpr int kOverhangRows = 128;  // >= the dK/dV kernel's query block (BwdDkDvTile::kBlockQueries)

  int64_t rows;  // per head, as allocated: rows_for(total, batch)
  int head_dim;  // a multiple of kTileCols

  // Rows per head to allocate for `total_rows` query rows in `batch` sequences: first_row's padding,
  // rounded up to whole tiles, and the overhang.
  FLASH_EXT_HOST_DEVICE static int64_t rows_for(int64_t total_rows, int64_t batch) {
    return (total_rows + kTileRows * batch + kTileRows - 1) / kTileRows * kTileRows + kOverhangRows;
  }
  // The first row of sequence b, whose query rows start at row `begin` of q (b * seqlen_q when dense).
  // Sequence b + 1 starts at or after begin + length, so first_row(b + 1) >= first_row(b) + length
  // rounded up to 8; the last sequence ends before rows_for(total, batch) - kOverhangRows.
  FLASH_EXT_HOST_DEVICE static int64_t first_row(int64_t begin, int64_t b) {
    return begin / kTileRows * kTileRows + kTileRows * b;
  }
  // Offset (in floats) of the tile holding accumulator row `row` and column `col` of `head`.
  FLASH_EXT_HOST_DEVICE int64_t tile_offset(int64_t row, int head, int col) const {
    return ((head * (rows / kTileRows) + row / kTileRows) * (head_dim / kTileCols) + col / kTileCols) * kTileFloats;
  }
  // Floats from a tile to the tile of the next 8 rows (same head and columns).
  FLASH_EXT_HOST_DEVICE static constexpr int row_group_stride(int head_dim) { return head_dim * kTileRows; }
  // Offset of row `row`'s 16 floats within its tile.
  FLASH_EXT_HOST_DEVICE static int row_in_tile(int64_t row) { return static_cast<int>(row % kTileRows) * kTileCols; }
};

}  // namespace flash_ext
