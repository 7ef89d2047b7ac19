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
// rather than NaN from (-inf) - (-inf).
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

template <int kMTiles>
struct OnlineSoftmax {
  static constexpr int kRows = 2 * kMTiles;  // rows this thread holds: (m-tile, upper/lower half)
  float row_max[kRows];                      // running max of the raw scores
  float row_sum[kRows];                      // this thread's part of the running sum of exp (quad-reduced at the end)

  __device__ __forceinline__ OnlineSoftmax() {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  // Folds one block of scores into the running state: turns acc_s into unnormalised
  // probabilities exp2(s*scale_log2 - new_max*scale_log2) and rescales acc_o (and the sums)
  // by exp2((old_max - new_max)*scale_log2). kIsFirst skips the rescale (acc_o is zero).
  template <bool kIsFirst, int kNTilesS, int kNTilesO>
  __device__ __forceinline__ void update(float (&acc_s)[kMTiles][kNTilesS][4], float (&acc_o)[kMTiles][kNTilesO][4],
                                         float scale_log2) {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 2 * mi + half;
        float block_max = row_max[r];
#pragma unroll
        for (int nj = 0; nj < kNTilesS; ++nj) {
          block_max = fmaxf(block_max, fmaxf(acc_s[mi][nj][2 * half], acc_s[mi][nj][2 * half + 1]));
        }
        const float new_max = quad_max(block_max);
        const float base = new_max == -INFINITY ? 0.f : new_max * scale_log2;
        if (!kIsFirst) {
          const float rescale = exp2f(row_max[r] * scale_log2 - base);
          row_sum[r] *= rescale;
#pragma unroll
          for (int nd = 0; nd < kNTilesO; ++nd) {
            acc_o[mi][nd][2 * half] *= rescale;
            acc_o[mi][nd][2 * half + 1] *= rescale;
          }
        }
        row_max[r] = new_max;
        float sum = 0.f;
#pragma unroll
        for (int nj = 0; nj < kNTilesS; ++nj) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float prob = exp2f(fmaf(acc_s[mi][nj][2 * half + e], scale_log2, -base));
            acc_s[mi][nj][2 * half + e] = prob;
            sum += prob;
          }
        }
        row_sum[r] += sum;
      }
    }
  }

  // Normalises acc_o by the row sums and returns each row's natural-log logsumexp of the
  // scaled scores in lse[r]. Rows that saw no key (sum 0) get output 0 and lse -inf.
  template <int kNTilesO>
  __device__ __forceinline__ void finalize(float (&acc_o)[kMTiles][kNTilesO][4], float softmax_scale,
                                           float (&lse)[kRows]) {
#pragma unroll
    for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int r = 2 * mi + half;
        const float sum = quad_sum(row_sum[r]);
        const bool empty = !(sum > 0.f);
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
};

}  // namespace flash_ext
