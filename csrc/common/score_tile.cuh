// Element-wise steps on a warp's score / probability tile in the mma accumulator layout (kMTiles blocks
// of 16 rows; a thread holds rows lane/4 and lane/4 + 8 of each, columns 2 * (lane % 4) + {0, 1} of each
// 8-column n-tile): the band mask, softcap / ALiBi, dropout. Shared by the sm80 forward (mma.sync) and
// the sm90 forward (wgmma: its m64 accumulator gives each warp the same 16-row layout).
#pragma once

#include <cmath>
#include <cstdint>

#include "band_mask.cuh"
#include "dropout_bits.cuh"
#include "philox.h"
#include "score_mod.cuh"
#include "../params.h"

namespace flash_ext {

// Sets to -inf the scores of keys outside their row's band (past the end of the sequence, or
// outside the causal / sliding window).
template <int kMTiles, int kNTilesS>
__device__ __forceinline__ void mask_scores(float (&acc_s)[kMTiles][kNTilesS][4], int first_row, int first_key,
                                            const BandMask& band) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = first_row + mi * 16 + lane / 4 + 8 * half;
      const int key_begin = band.begin(row), key_end = band.end(row);
#pragma unroll
      for (int nj = 0; nj < kNTilesS; ++nj) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = first_key + nj * 8 + 2 * (lane % 4) + e;
          if (key < key_begin || key >= key_end) acc_s[mi][nj][2 * half + e] = -INFINITY;
        }
      }
    }
  }
}

// Replaces raw q.k scores by their modified scores (softcap, ALiBi) in the forward's score units
// (params.h, fwd_score_scale: with softcap, tanh values; the softmax scale carries the cap). Softcap and
// ALiBi are separate passes under uniform branches: in one pass, the step a call does not use stays in
// the code predicated off and still costs its issue slots (5 instructions per score for either alone
// instead of 3 for softcap, 2 for ALiBi; the forward with either was +21-22% over plain attention at
// hd128, 8k on the H200 once plain attention no longer waited on its copies).
template <int kMTiles, int kNTilesS>
__device__ __forceinline__ void apply_softcap(float (&acc_s)[kMTiles][kNTilesS][4], const ScoreMod& mod) {
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int nj = 0; nj < kNTilesS; ++nj) {
#pragma unroll
      for (int r = 0; r < 4; ++r) acc_s[mi][nj][r] = mod.fwd_tanh(acc_s[mi][nj][r]);
    }
  }
}

// ALiBi per score: bias -slope * |row_on_diagonal - key| (an FADD and an FFMA per score). lane: threadIdx.x %
// 32, read by the caller (where each kernel reads it matters to its register allocation).
template <int kMTiles, int kNTilesS>
__device__ __forceinline__ void add_alibi(float (&acc_s)[kMTiles][kNTilesS][4], int first_row, int first_key,
                                          const ScoreMod& mod, int lane) {
  const float first_key_of_thread = static_cast<float>(first_key + 2 * (lane % 4));
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float row_on_diagonal = mod.row_on_diagonal(first_row + mi * 16 + lane / 4 + 8 * half);
#pragma unroll
      for (int nj = 0; nj < kNTilesS; ++nj) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& score = acc_s[mi][nj][2 * half + e];
          score = mod.fwd_with_alibi(score, row_on_diagonal, first_key_of_thread + (nj * 8 + e));
        }
      }
    }
  }
}

template <int kMTiles, int kNTilesS>
__device__ __forceinline__ void modify_scores(float (&acc_s)[kMTiles][kNTilesS][4], int first_row, int first_key,
                                              const ScoreMod& mod) {
  const int lane = threadIdx.x % 32;
  if (mod.has_softcap()) apply_softcap(acc_s, mod);
  if (mod.has_alibi()) add_alibi(acc_s, first_row, first_key, mod, lane);
}

// The same, with ALiBi split into a column term and a row term where the warp's block of keys lies
// wholly on one side of each of its rows' diagonal key d (key <= d for every row and key, or key >= d):
// there -slope |d - key| = sigma (key - d) with sigma = slope (left) or -slope (right), and with key =
// k0 + j (k0 the thread's first key, j = 8 nj + e a constant of the unrolled loop) that is
// sigma j (one FFMA per score, j an immediate) plus sigma (k0 - d), a value per row of the thread,
// returned in row_offset for the online softmax (online_softmax.cuh) to add once per row. Blocks that
// cross a diagonal (with causal masking: the diagonal blocks) take add_alibi, row_offset 0. Rounding:
// sigma j and sigma (k0 - d) are rounded separately instead of their sum; the difference, below
// 2^-24 |sigma (k0 - d)|, matters only where that term is a few logits from the row max, i.e. tiny.
template <int kMTiles, int kNTilesS>
__device__ __forceinline__ void modify_scores(float (&acc_s)[kMTiles][kNTilesS][4], int first_row, int first_key,
                                              const ScoreMod& mod, float (&row_offset)[2 * kMTiles]) {
#pragma unroll
  for (int r = 0; r < 2 * kMTiles; ++r) row_offset[r] = 0.f;
  if (mod.has_softcap()) apply_softcap(acc_s, mod);
  if (!mod.has_alibi()) return;
  const int last_row = first_row + 16 * kMTiles - 1, last_key = first_key + 8 * kNTilesS - 1;
  float sigma;
  if (last_key <= first_row + mod.diagonal_offset) {
    sigma = mod.slope_fwd;  // every key at or left of every row's diagonal
  } else if (first_key >= last_row + mod.diagonal_offset) {
    sigma = -mod.slope_fwd;  // every key at or right of it
  } else {
    add_alibi(acc_s, first_row, first_key, mod, static_cast<int>(threadIdx.x % 32));
    return;
  }
  const int lane = threadIdx.x % 32;
  const int first_key_of_thread = first_key + 2 * (lane % 4);
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row_on_diagonal = first_row + mi * 16 + lane / 4 + 8 * half + mod.diagonal_offset;
      row_offset[2 * mi + half] = sigma * static_cast<float>(first_key_of_thread - row_on_diagonal);
#pragma unroll
      for (int nj = 0; nj < kNTilesS; ++nj) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& score = acc_s[mi][nj][2 * half + e];
          score = fmaf(sigma, static_cast<float>(nj * 8 + e), score);
        }
      }
    }
  }
}

// Dropout on unnormalised probabilities, after the online softmax took them into the row sums (lse is
// that of the undropped softmax), applied to P in 16 bits (the A fragments of P·V, from
// accumulator_to_a_fragments): zeroing a 16-bit half is zeroing the fp32 value before rounding, and the
// Philox calls then run while the fp32 score tile is dead (on the fp32 tile ptxas spilled 8 B in the
// hd128 kernel, CUDA 13.0, sm_90a). The keep bits come from common/dropout_bits.cuh.
template <int kMTiles, int kKSteps>
__device__ __forceinline__ void drop_probabilities(uint32_t (&p_frag)[kMTiles][kKSteps][4], int first_row,
                                                   int first_key, const FwdParams& params) {
  const int lane = threadIdx.x % 32;
  // Formed here, per key block, rather than kept in registers across the main loop.
  const PhiloxSeedOffset rng = philox_seed_offset(params);
  const uint64_t batch_head = static_cast<uint64_t>(blockIdx.z) * params.heads_q + blockIdx.y;
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = first_row + mi * 16 + lane / 4 + 8 * half;
      // Bit 2 * nj + e: column nj * 8 + 2 * (lane % 4) + e is kept.
      const uint32_t keep_bits =
          row_keep_bits<2 * kKSteps>(rng, batch_head, row, first_key, params.dropout_threshold);
#pragma unroll
      for (int nj = 0; nj < 2 * kKSteps; ++nj) {
        // n-tile nj is register 2 * (nj % 2) + half of k-step nj / 2; element e is its half e.
        const uint32_t bits = keep_bits >> (2 * nj) & 3u;
        const uint32_t keep_mask = (bits & 1u ? 0x0000ffffu : 0u) | (bits & 2u ? 0xffff0000u : 0u);
        p_frag[mi][nj / 2][2 * (nj % 2) + half] &= keep_mask;
      }
    }
  }
}

}  // namespace flash_ext
