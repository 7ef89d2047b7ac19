// Warp-level GEMMs on mma.sync m16n8k16 over shared-memory tiles and register fragments: the
// building blocks every attention GEMM here is written with (forward: S = Q·Kᵀ, O += P·V;
// backward: Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ, dV += Pᵀ·dO, dK += dSᵀ·Q, S = Q·Kᵀ, dP = dO·Vᵀ, dQ += dS·K).
//
// Shared tiles are row-major with a row pitch of kPitch elements (see FwdTile::kSmemRowPitch
// for why the padding makes ldmatrix conflict-free). Two kinds of B operand appear:
//   "B rows are N": the tile's rows are the output columns, contiguous along K (K in Q·Kᵀ);
//                   loaded with plain ldmatrix.
//   "B rows are K": the tile's rows run along K, contiguous along N (V in P·V); loaded with
//                   ldmatrix.trans.
// Accumulators are float acc[kMTiles][kNTiles][4] in the mma D layout (ptx.cuh).
#pragma once

#include <cstdint>

#include "ptx.cuh"

namespace flash_ext {

// Lane addresses for one x4 ldmatrix at the tile's origin; add (row * kPitch + col) *
// sizeof(Element) to move it. See ldmatrix_x4 in ptx.cuh for the lane -> matrix map.

// A operand (16 rows x 16 k): matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15) -> a0..a3.
template <int kPitch, typename Element>
__device__ __forceinline__ uint32_t a_lane_address(const Element* tile) {
  const int lane = threadIdx.x % 32;
  return smem_address(tile + (lane % 16) * kPitch + lane / 16 * 8);
}

// A operand (16 rows x 16 k) from a tile stored transposed (its rows are k, contiguous along
// the A rows), loaded with ldmatrix.trans: matrices (k 0-7, rows 0-7), (k 0-7, rows 8-15),
// (k 8-15, rows 0-7), (k 8-15, rows 8-15) -> a0..a3 after the transpose.
template <int kPitch, typename Element>
__device__ __forceinline__ uint32_t a_transposed_lane_address(const Element* tile) {
  const int lane = threadIdx.x % 32;
  return smem_address(tile + (lane % 8 + lane / 16 * 8) * kPitch + (lane / 8 % 2) * 8);
}

// B operand, rows are N (two n-tiles of 8 x 16 k): matrices (n 0-7, k 0-7), (n 0-7, k 8-15),
// (n 8-15, k 0-7), (n 8-15, k 8-15) -> {b0, b1} of n-tile 0, then of n-tile 1.
template <int kPitch, typename Element>
__device__ __forceinline__ uint32_t b_rows_n_lane_address(const Element* tile) {
  const int lane = threadIdx.x % 32;
  return smem_address(tile + (lane % 8 + lane / 16 * 8) * kPitch + (lane / 8 % 2) * 8);
}

// B operand, rows are K (16 k x two n-tiles of 8), transposed on load: matrices (k 0-7, n 0-7),
// (k 8-15, n 0-7), (k 0-7, n 8-15), (k 8-15, n 8-15) -> {b0, b1} of n-tile 0, then of n-tile 1.
template <int kPitch, typename Element>
__device__ __forceinline__ uint32_t b_rows_k_lane_address(const Element* tile) {
  const int lane = threadIdx.x % 32;
  return smem_address(tile + (lane % 8 + (lane / 8 % 2) * 8) * kPitch + lane / 16 * 8);
}

// How an operand tile lies in shared memory: kRowsAreMN, the tile's rows are the operand's M (A) or
// N (B) index, contiguous along k ("B rows are N": K in Q·Kᵀ); kRowsAreK, the tile's rows run along
// k, contiguous along M or N ("B rows are K": V in P·V; for A, a transposed tile such as dSᵀ read
// as dS), loaded with ldmatrix.trans. The lane address comes from a_lane_address,
// a_transposed_lane_address, b_rows_n_lane_address or b_rows_k_lane_address respectively.
enum class SmemLayout { kRowsAreMN, kRowsAreK };
constexpr SmemLayout kRowsAreMN = SmemLayout::kRowsAreMN;
constexpr SmemLayout kRowsAreK = SmemLayout::kRowsAreK;

// The A fragment of 16-row block mi, k-step kstep.
template <typename Element, SmemLayout kLayout, int kPitch>
__device__ __forceinline__ void load_a_fragment(uint32_t (&frag)[4], uint32_t lane_addr, int mi, int kstep) {
  if constexpr (kLayout == SmemLayout::kRowsAreMN) {
    ldmatrix_x4(frag, lane_addr + (mi * 16 * kPitch + kstep * 16) * sizeof(Element));
  } else {
    ldmatrix_x4_trans(frag, lane_addr + (kstep * 16 * kPitch + mi * 16) * sizeof(Element));
  }
}

// The B fragments of n-tiles nj and nj + 1, k-step kstep: {b0, b1} of nj, then of nj + 1.
template <typename Element, SmemLayout kLayout, int kPitch>
__device__ __forceinline__ void load_b_fragments(uint32_t (&frag)[4], uint32_t lane_addr, int nj, int kstep) {
  if constexpr (kLayout == SmemLayout::kRowsAreMN) {
    ldmatrix_x4(frag, lane_addr + (nj * 8 * kPitch + kstep * 16) * sizeof(Element));
  } else {
    ldmatrix_x4_trans(frag, lane_addr + (kstep * 16 * kPitch + nj * 8) * sizeof(Element));
  }
}

// acc += A · B with A (kMTiles*16 x kKSteps*16) and B (kKSteps*16 x kNTiles*8) both in shared
// memory, laid out as kA and kB say.
template <typename Element, int kMTiles, int kNTiles, int kKSteps, SmemLayout kA, int kAPitch, SmemLayout kB,
          int kBPitch>
__device__ __forceinline__ void gemm_smem(float (&acc)[kMTiles][kNTiles][4], uint32_t a_lane_addr,
                                          uint32_t b_lane_addr) {
  static_assert(kNTiles % 2 == 0, "B fragments are loaded two n-tiles at a time");
#pragma unroll
  for (int kstep = 0; kstep < kKSteps; ++kstep) {
    uint32_t a_frag[kMTiles][4];
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) load_a_fragment<Element, kA, kAPitch>(a_frag[mi], a_lane_addr, mi, kstep);
#pragma unroll
    for (int nj = 0; nj < kNTiles; nj += 2) {
      uint32_t b_frag[4];
      load_b_fragments<Element, kB, kBPitch>(b_frag, b_lane_addr, nj, kstep);
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
template <typename Element, int kMTiles, int kNTiles, int kKSteps, int kBPitch>
__device__ __forceinline__ void gemm_rs_ab(float (&acc)[kMTiles][kNTiles][4],
                                           const uint32_t (&a_frag)[kMTiles][kKSteps][4], uint32_t b_lane_addr) {
  static_assert(kNTiles % 2 == 0, "B fragments are loaded two n-tiles at a time");
#pragma unroll
  for (int kstep = 0; kstep < kKSteps; ++kstep) {
#pragma unroll
    for (int nj = 0; nj < kNTiles; nj += 2) {
      uint32_t b_frag[4];
      load_b_fragments<Element, SmemLayout::kRowsAreK, kBPitch>(b_frag, b_lane_addr, nj, kstep);
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
