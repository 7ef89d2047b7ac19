// Online softmax over the mma.sync accumulator layout, kept entirely in registers.
//
// A warp's score tile is kMTiles blocks of 16 rows; in each, a thread holds rows lane/4 and
// lane/4 + 8 (accumulator registers 0,1 and 2,3), and the four threads of a quad (lanes
// 4g..4g+3) share a row. So every thread tracks 2 * kMTiles rows, and row reductions are a
// max/sum over the thread's registers followed by two shuffles inside the quad.
//
// Numerics: scores stay unscaled; the row max is kept in the same units and the softmax
// scale enters once through exp2(s * scale_log2 - max * scale_log2), one FFMA and one EX2
// per element (scale_log2 = softmax_scale * log2(e) is computed on the host). A row whose
// max is still -inf (all its keys masked so far) uses 0 as its base so that exp2 gives 0
// rather than NaN from (-inf) - (-inf). The "max" is a lagging one (see update()).
#pragma once

#include <cmath>

namespace flash_ext {

__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffff, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffff, x, 1);
  return x + __shfl_xor_sync(0xffffffff, x, 2);
}

// Reduces the 2 * kNTiles values of one accumulator row half (registers 2*half, 2*half+1 of
// each n-tile) as a balanced tree: a serial chain would make each step wait on the last.
template <int kNTiles, typename Op>
__device__ __forceinline__ float tree_reduce(const float (&tiles)[kNTiles][4], int half, Op op) {
  float partial[kNTiles];
#pragma unroll
  for (int nj = 0; nj < kNTiles; ++nj) partial[nj] = op(tiles[nj][2 * half], tiles[nj][2 * half + 1]);
#pragma unroll
  for (int stride = 1; stride < kNTiles; stride *= 2) {
#pragma unroll
    for (int nj = 0; nj + stride < kNTiles; nj += 2 * stride) partial[nj] = op(partial[nj], partial[nj + stride]);
  }
  return partial[0];
}

// Row offsets (ALiBi's row terms, common/score_tile.cuh's modify_scores): where a caller passes
// row_offset, the true score of an element of row r is its acc_s value plus row_offset[r]. The offset
// differs between the four threads of a quad (each holds other columns), so it is added to each
// thread's partial max before the quad's reduction, and per row to exp2's base: two instructions per
// row instead of one per score.
template <int kMTiles>
struct OnlineSoftmax {
  static constexpr int kRows = 2 * kMTiles;  // rows this thread holds: (m-tile, upper/lower half)
  float row_max[kRows];                      // exponent base: within threshold of the running max of raw scores
  float row_sum[kRows];                      // this thread's part of the running sum of exp (quad-reduced at the end)

  __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  // Folds one block of scores into the running state: turns acc_s into unnormalised
  // probabilities exp2(s*scale_log2 - row_max*scale_log2).
  //
  // Lazy rescaling: the running max (the exponent base) is only raised when a row's new max
  // exceeds it by more than kRescaleThresholdLog2 (in log2 units); until then probabilities may
  // reach 2^kRescaleThresholdLog2, harmless in fp32 and in 16-bit P (relative precision does
  // not depend on magnitude). The base only has to be the same for a row's O and sum, not the
  // true max, so the result is unchanged; but most blocks then skip the O rescale (a multiply
  // per accumulator register) because no row of the warp needs it.
  static constexpr float kRescaleThresholdLog2 = 8.f;

  template <bool kIsFirst, int kNTilesS, int kNTilesO>
  __device__ __forceinline__ void update(float (&acc_s)[kMTiles][kNTilesS][4], float (&acc_o)[kMTiles][kNTilesO][4],
                                         float scale_log2) {
    const float no_offset[kRows] = {};
    update_impl<kIsFirst, false>(acc_s, acc_o, scale_log2, no_offset);
  }
  template <bool kIsFirst, int kNTilesS, int kNTilesO>
  __device__ __forceinline__ void update(float (&acc_s)[kMTiles][kNTilesS][4], float (&acc_o)[kMTiles][kNTilesO][4],
                                         float scale_log2, const float (&row_offset)[kRows]) {
    update_impl<kIsFirst, true>(acc_s, acc_o, scale_log2, row_offset);
  }

  // update() in steps, for a caller that rescales O later (the sm90 forward: its O is still being
  // accumulated by an asynchronous MMA while the next block's scores are exponentiated): raise_bases,
  // then exponentiate, then (once O is complete, if raise_bases returned true) rescale.
  //
  // Raises the bases of the rows that need it (row sums rescaled here) and returns whether any row of
  // the warp did (uniform over the warp); o_factor[r] is then what row r of O must be multiplied by
  // (1 for the rows not raised).
  template <bool kIsFirst, int kNTilesS>
  __device__ __forceinline__ bool raise_bases(const float (&acc_s)[kMTiles][kNTilesS][4], float scale_log2,
                                              float (&o_factor)[kRows]) {
    const float no_offset[kRows] = {};
    return raise_bases_impl<kIsFirst, false>(acc_s, scale_log2, no_offset, o_factor);
  }
  template <bool kIsFirst, int kNTilesS>
  __device__ __forceinline__ bool raise_bases(const float (&acc_s)[kMTiles][kNTilesS][4], float scale_log2,
                                              const float (&row_offset)[kRows], float (&o_factor)[kRows]) {
    return raise_bases_impl<kIsFirst, true>(acc_s, scale_log2, row_offset, o_factor);
  }

  template <int kNTilesO>
  __device__ __forceinline__ void rescale(float (&acc_o)[kMTiles][kNTilesO][4], const float (&o_factor)[kRows]) {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int nd = 0; nd < kNTilesO; ++nd) {
          acc_o[mi][nd][2 * half] *= o_factor[2 * mi + half];
          acc_o[mi][nd][2 * half + 1] *= o_factor[2 * mi + half];
        }
      }
    }
  }

  // Scores -> unnormalised probabilities exp2(s * scale_log2 - base), added into the row sums.
  template <int kNTilesS>
  __device__ __forceinline__ void exponentiate(float (&acc_s)[kMTiles][kNTilesS][4], float scale_log2) {
    const float no_offset[kRows] = {};
    exponentiate_impl<false>(acc_s, scale_log2, no_offset);
  }
  template <int kNTilesS>
  __device__ __forceinline__ void exponentiate(float (&acc_s)[kMTiles][kNTilesS][4], float scale_log2,
                                               const float (&row_offset)[kRows]) {
    exponentiate_impl<true>(acc_s, scale_log2, row_offset);
  }

  // Normalises acc_o by the row sums and returns each row's natural-log logsumexp of the
  // scaled scores in lse[r]. Rows that saw no key (sum 0) get output 0 and lse -inf. A NaN score
  // makes its row's sum NaN, and that row's output and lse NaN (as in PyTorch): the test is
  // sum == 0, not !(sum > 0), so that NaN is not taken for an empty row.
  template <int kNTilesO>
  __device__ __forceinline__ void finalize(float (&acc_o)[kMTiles][kNTilesO][4], float softmax_scale,
                                           float (&lse)[kRows]) {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 2 * mi + half;
        const float sum = quad_sum(row_sum[r]);
        const bool empty = sum == 0.f;
        const float inv_sum = empty ? 0.f : 1.f / sum;
        lse[r] = empty ? -INFINITY : row_max[r] * softmax_scale + logf(sum);
#pragma unroll
        for (int nd = 0; nd < kNTilesO; ++nd) {
          acc_o[mi][nd][2 * half] *= inv_sum;
          acc_o[mi][nd][2 * half + 1] *= inv_sum;
        }
      }
    }
  }

 private:
  // kOffsets false: row_offset is not read (the plain kernels' code is the same as without it).
  template <bool kIsFirst, bool kOffsets, int kNTilesS, int kNTilesO>
  __device__ __forceinline__ void update_impl(float (&acc_s)[kMTiles][kNTilesS][4],
                                              float (&acc_o)[kMTiles][kNTilesO][4], float scale_log2,
                                              const float (&row_offset)[kRows]) {
    float block_max[kRows];
    bool raise_max[kRows];
    const bool any_raise = block_maxima<kOffsets>(acc_s, scale_log2, row_offset, block_max, raise_max);
    if (kIsFirst || __any_sync(0xffffffff, any_raise)) {
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = 2 * mi + half;
          if (!raise_max[r]) continue;
          if (!kIsFirst) {  // acc_o and row_sum are still zero on the first block
            const float rescale = exp2f((row_max[r] - block_max[r]) * scale_log2);  // 0 if row_max was -inf
            row_sum[r] *= rescale;
#pragma unroll
            for (int nd = 0; nd < kNTilesO; ++nd) {
              acc_o[mi][nd][2 * half] *= rescale;
              acc_o[mi][nd][2 * half + 1] *= rescale;
            }
          }
          row_max[r] = block_max[r];
        }
      }
    }
    exponentiate_impl<kOffsets>(acc_s, scale_log2, row_offset);
  }

  template <bool kIsFirst, bool kOffsets, int kNTilesS>
  __device__ __forceinline__ bool raise_bases_impl(const float (&acc_s)[kMTiles][kNTilesS][4], float scale_log2,
                                                   const float (&row_offset)[kRows], float (&o_factor)[kRows]) {
    float block_max[kRows];
    bool raise_max[kRows];
    const bool any_raise = block_maxima<kOffsets>(acc_s, scale_log2, row_offset, block_max, raise_max);
#pragma unroll
    for (int r = 0; r < kRows; ++r) o_factor[r] = 1.f;
    if (!kIsFirst && !__any_sync(0xffffffff, any_raise)) return false;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (!raise_max[r]) continue;
      if (!kIsFirst) {  // acc_o and row_sum are still zero on the first block
        o_factor[r] = exp2f((row_max[r] - block_max[r]) * scale_log2);  // 0 if row_max was -inf
        row_sum[r] *= o_factor[r];
      }
      row_max[r] = block_max[r];
    }
    return true;
  }

  // Each row's max over this block (block_max) and whether its base must be raised (raise_max);
  // returns whether any of this thread's rows must.
  template <bool kOffsets, int kNTilesS>
  __device__ __forceinline__ bool block_maxima(const float (&acc_s)[kMTiles][kNTilesS][4], float scale_log2,
                                               const float (&row_offset)[kRows], float (&block_max)[kRows],
                                               bool (&raise_max)[kRows]) const {
    bool any_raise = false;
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 2 * mi + half;
        float thread_max = tree_reduce<kNTilesS>(acc_s[mi], half, [](float a, float b) { return fmaxf(a, b); });
        if constexpr (kOffsets) thread_max += row_offset[r];
        block_max[r] = quad_max(thread_max);
        // NaN when both are -inf (row still empty): compares false, the row keeps base 0.
        raise_max[r] = (block_max[r] - row_max[r]) * scale_log2 > kRescaleThresholdLog2;
        any_raise |= raise_max[r];
      }
    }
    return any_raise;
  }

  template <bool kOffsets, int kNTilesS>
  __device__ __forceinline__ void exponentiate_impl(float (&acc_s)[kMTiles][kNTilesS][4], float scale_log2,
                                                    const float (&row_offset)[kRows]) {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 2 * mi + half;
        float base = row_max[r] == -INFINITY ? 0.f : row_max[r] * scale_log2;
        if constexpr (kOffsets) base = fmaf(-row_offset[r], scale_log2, base);
#pragma unroll
        for (int nj = 0; nj < kNTilesS; ++nj) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            acc_s[mi][nj][2 * half + e] = exp2f(fmaf(acc_s[mi][nj][2 * half + e], scale_log2, -base));
          }
        }
        row_sum[r] += tree_reduce<kNTilesS>(acc_s[mi], half, [](float a, float b) { return a + b; });
      }
    }
  }
};

}  // namespace flash_ext
