// Warp-level GEMMs on mma.sync m16n8k16 over shared-memory tiles and register fragments: the
// building blocks every attention GEMM here is written with (forward: S = Q·Kᵀ, O += P·V;
// backward: Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, dV += Pᵀ·dO, dK += dSᵀ·Q, S = Q·Kᵀ, dP = dO·Vᵀ, dQ += dS·K).
//
// Shared tiles are row-major in one of the layouts of smem_rows.cuh (a Rows type: PaddedRows or
// SwizzledRows), which also says how lane addresses move. Two kinds of B operand appear:
//   "B rows are N": the tile's rows are the output columns, contiguous along K (K in Q·Kᵀ);
//                   loaded with plain ldmatrix.
//   "B rows are K": the tile's rows run along K, contiguous along N (V in P·V); loaded with
//                   ldmatrix.trans.
// Accumulators are float acc[kMTiles][kNTiles][4] in the mma D layout (ptx.cuh).
#pragma once

#include <cstdint>

#include "ptx.cuh"
#include "smem_rows.cuh"

namespace flash_ext {

// Lane addresses for one x4 ldmatrix at (first_row, first_col) of a tile at shared address `tile`
// (see ldmatrix_x4 in ptx.cuh for the lane -> matrix map); Rows::move moves them.

// A operand (16 rows x 16 k): matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15) -> a0..a3.
template <typename Rows>
__device__ __forceinline__ uint32_t a_lane_address(uint32_t tile, int first_row, int first_col) {
  const int lane = threadIdx.x % 32;
  return tile + Rows::offset(first_row + lane % 16, first_col + lane / 16 * 8);
}
// The same for a given lane (e.g. from a re-read thread index, ptx.cuh). Separate bodies on purpose: as a
// default argument, or with the 3-argument form calling this one, ptxas (CUDA 13.0) allocated the hd128
// forward kernels differently (their SASS changed; one spilled 16 B more).
template <typename Rows>
__device__ __forceinline__ uint32_t a_lane_address(uint32_t tile, int first_row, int first_col, int lane) {
  return tile + Rows::offset(first_row + lane % 16, first_col + lane / 16 * 8);
}

// A operand (16 rows x 16 k) from a tile stored transposed (its rows are k, contiguous along
// the A rows), loaded with ldmatrix.trans: matrices (k 0-7, rows 0-7), (k 0-7, rows 8-15),
// (k 8-15, rows 0-7), (k 8-15, rows 8-15) -> a0..a3 after the transpose.
template <typename Rows>
__device__ __forceinline__ uint32_t a_transposed_lane_address(uint32_t tile, int first_row, int first_col) {
  const int lane = threadIdx.x % 32;
  return tile + Rows::offset(first_row + lane % 8 + lane / 16 * 8, first_col + (lane / 8 % 2) * 8);
}

// B operand, rows are N (two n-tiles of 8 x 16 k): matrices (n 0-7, k 0-7), (n 0-7, k 8-15),
// (n 8-15, k 0-7), (n 8-15, k 8-15) -> {b0, b1} of n-tile 0, then of n-tile 1.
template <typename Rows>
__device__ __forceinline__ uint32_t b_rows_n_lane_address(uint32_t tile, int first_row, int first_col) {
  const int lane = threadIdx.x % 32;
  return tile + Rows::offset(first_row + lane % 8 + lane / 16 * 8, first_col + (lane / 8 % 2) * 8);
}
// The same for a given lane (e.g. from a re-read thread index, ptx.cuh).
template <typename Rows>
__device__ __forceinline__ uint32_t b_rows_n_lane_address(uint32_t tile, int first_row, int first_col, int lane) {
  return tile + Rows::offset(first_row + lane % 8 + lane / 16 * 8, first_col + (lane / 8 % 2) * 8);
}

// B operand, rows are K (16 k x two n-tiles of 8), transposed on load: matrices (k 0-7, n 0-7),
// (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15) -> {b0, b1} of n-tile 0, then of n-tile 1.
template <typename Rows>
__device__ __forceinline__ uint32_t b_rows_k_lane_address(uint32_t tile, int first_row, int first_col) {
  const int lane = threadIdx.x % 32;
  return tile + Rows::offset(first_row + lane % 8 + (lane / 8 % 2) * 8, first_col + lane / 16 * 8);
}
// The same for a given lane (e.g. from a re-read thread index, ptx.cuh).
template <typename Rows>
__device__ __forceinline__ uint32_t b_rows_k_lane_address(uint32_t tile, int first_row, int first_col, int lane) {
  return tile + Rows::offset(first_row + lane % 8 + (lane / 8 % 2) * 8, first_col + lane / 16 * 8);
}

// How an operand tile lies in shared memory: kRowsAreMN, the tile's rows are the operand's M (A) or
// N (B) index, contiguous along k ("B rows are N": K in Q·Kᵀ); kRowsAreK, the tile's rows run along
// k, contiguous along M or N ("B rows are K": V in P·V; for A, a transposed tile such as dSᵀ read
// as dS), loaded with ldmatrix.trans. The lane address comes from a_lane_address,
// a_transposed_lane_address, b_rows_n_lane_address or b_rows_k_lane_address respectively.
enum class SmemLayout { kRowsAreMN, kRowsAreK };
constexpr SmemLayout kRowsAreMN = SmemLayout::kRowsAreMN;
constexpr SmemLayout kRowsAreK = SmemLayout::kRowsAreK;

// An operand's lane addresses inside a GEMM. A column move is an XOR in the swizzled layout
// (smem_rows.cuh), kept out of the inner loops: a kRowsAreMN operand moves along its columns (k) once
// per k-step (start_kstep); a kRowsAreK operand moves along its columns (m or n) inside every k-step,
// so its column variants are formed once per GEMM. Row moves are adds (immediate offsets).
template <SmemLayout kLayout, typename Rows>
struct OperandLanes {
  uint32_t lane_addr;                       // kRowsAreMN: the lane address; moved per k-step below
  uint32_t kstep_addr;                      // kRowsAreMN: the lane address at this k-step
  typename Rows::ColumnVariants variants;  // kRowsAreK

  __device__ __forceinline__ explicit OperandLanes(uint32_t address) : lane_addr(address), kstep_addr(address) {
    if constexpr (kLayout == SmemLayout::kRowsAreK) variants = Rows::column_variants(address);
  }
  __device__ __forceinline__ void start_kstep(int kstep) {
    if constexpr (kLayout == SmemLayout::kRowsAreMN) kstep_addr = Rows::move(lane_addr, 0, kstep * 16);
  }
  // The x4 ldmatrix (plain or transposed) at the operand's rows / columns `offset` (its m or n
  // index: 16 per A tile, 8 per B n-tile) of the current k-step.
  __device__ __forceinline__ void load(uint32_t (&frag)[4], int offset, int kstep) const {
    if constexpr (kLayout == SmemLayout::kRowsAreMN) {
      ldmatrix_x4(frag, Rows::move(kstep_addr, offset, 0));
    } else {
      ldmatrix_x4_trans(frag, Rows::move(variants, kstep * 16, offset));
    }
  }
};

// acc += A · B with A (kMTiles*16 x kKSteps*16) and B (kKSteps*16 x kNTiles*8) both in shared
// memory, laid out as kA and kB say.
template <typename Element, int kMTiles, int kNTiles, int kKSteps, SmemLayout kA, typename ARows, SmemLayout kB,
          typename BRows>
__device__ __forceinline__ void gemm_smem(float (&acc)[kMTiles][kNTiles][4], uint32_t a_lane_addr,
                                          uint32_t b_lane_addr) {
  static_assert(kNTiles % 2 == 0, "B fragments are loaded two n-tiles at a time");
  OperandLanes<kA, ARows> a(a_lane_addr);
  OperandLanes<kB, BRows> b(b_lane_addr);
#pragma unroll
  for (int kstep = 0; kstep < kKSteps; ++kstep) {
    a.start_kstep(kstep);
    b.start_kstep(kstep);
    uint32_t a_frag[kMTiles][4];
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) a.load(a_frag[mi], mi * 16, kstep);
#pragma unroll
    for (int nj = 0; nj < kNTiles; nj += 2) {
      uint32_t b_frag[4];  // {b0, b1} of n-tile nj, then of nj + 1
      b.load(b_frag, nj * 8, kstep);
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
        mma_m16n8k16<Element>(acc[mi][nj], a_frag[mi], b_frag[0], b_frag[1]);
        mma_m16n8k16<Element>(acc[mi][nj + 1], a_frag[mi], b_frag[2], b_frag[3]);
      }
    }
  }
}

// acc += A · B with A in registers (16-bit A fragments, one per 16-row block and k-step) and B
// (kKSteps*16 rows x kNTiles*8) in shared memory, B's rows running along k.
template <typename Element, int kMTiles, int kNTiles, int kKSteps, typename BRows>
__device__ __forceinline__ void gemm_rs_ab(float (&acc)[kMTiles][kNTiles][4],
                                           const uint32_t (&a_frag)[kMTiles][kKSteps][4], uint32_t b_lane_addr) {
  static_assert(kNTiles % 2 == 0, "B fragments are loaded two n-tiles at a time");
  const OperandLanes<SmemLayout::kRowsAreK, BRows> b(b_lane_addr);
#pragma unroll
  for (int kstep = 0; kstep < kKSteps; ++kstep) {
#pragma unroll
    for (int nj = 0; nj < kNTiles; nj += 2) {
      uint32_t b_frag[4];
      b.load(b_frag, nj * 8, kstep);
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
        mma_m16n8k16<Element>(acc[mi][nj], a_frag[mi][kstep], b_frag[0], b_frag[1]);
        mma_m16n8k16<Element>(acc[mi][nj + 1], a_frag[mi][kstep], b_frag[2], b_frag[3]);
      }
    }
  }
}

// An accumulator (rows x kNTiles*8) rounded to 16 bits as the A operand of a following mma:
// accumulator n-tiles (2j, 2j+1) of a row block are exactly A's k-step j (registers d0d1 ->
// a0 / a2, d2d3 -> a1 / a3). This is how P (and dS) go from one GEMM to the next in registers.
template <typename Element, int kMTiles, int kNTiles>
__device__ __forceinline__ void accumulator_to_a_fragments(const float (&acc)[kMTiles][kNTiles][4],
                                                           uint32_t (&frag)[kMTiles][kNTiles / 2][4]) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int kstep = 0; kstep < kNTiles / 2; ++kstep) {
      frag[mi][kstep][0] = pack_float2<Element>(acc[mi][2 * kstep][0], acc[mi][2 * kstep][1]);
      frag[mi][kstep][1] = pack_float2<Element>(acc[mi][2 * kstep][2], acc[mi][2 * kstep][3]);
      frag[mi][kstep][2] = pack_float2<Element>(acc[mi][2 * kstep + 1][0], acc[mi][2 * kstep + 1][1]);
      frag[mi][kstep][3] = pack_float2<Element>(acc[mi][2 * kstep + 1][2], acc[mi][2 * kstep + 1][3]);
    }
  }
}

}  // namespace flash_ext
