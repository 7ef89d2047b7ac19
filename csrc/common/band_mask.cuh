// Which keys a query row sees, in the kernels: the band of params.h's visible_keys (causal and
// sliding windows), in int32 coordinates of one sequence.
#pragma once

#include <cstdint>

#include "../params.h"

namespace flash_ext {

// Row i of a sequence sees keys [begin(i), end(i)) with begin(i) = i + diagonal_offset - left and
// end(i) = i + diagonal_offset + right + 1, clamped to [0, len_k). Unbounded sides are represented
// by a huge window, so the plain and the windowed cases share one code path.
struct BandMask {
  int len_k;
  int diagonal_offset;  // len_k - len_q (bottom-right alignment)
  int64_t left;         // keys before the diagonal; "unbounded" = 2^40
  int64_t right;        // keys after the diagonal
  int left32, right32;  // the same, capped at 2^30 (beyond any int32 distance that occurs)

  __device__ __forceinline__ BandMask(const FwdParams& params, int len_q, int len_k_)
      : len_k(len_k_),
        diagonal_offset(len_k_ - len_q),
        left(params.window_left == FwdParams::kUnbounded ? (int64_t{1} << 40) : params.window_left),
        right(params.window_right == FwdParams::kUnbounded ? (int64_t{1} << 40) : params.window_right),
        left32(static_cast<int>(left < (1 << 30) ? left : (1 << 30))),
        right32(static_cast<int>(right < (1 << 30) ? right : (1 << 30))) {}

  __device__ __forceinline__ int begin(int row) const {
    const int64_t b = static_cast<int64_t>(row) + diagonal_offset - left;
    return static_cast<int>(b < 0 ? 0 : (b > len_k ? len_k : b));
  }
  __device__ __forceinline__ int end(int row) const {
    const int64_t e = static_cast<int64_t>(row) + diagonal_offset + right + 1;
    return static_cast<int>(e < 0 ? 0 : (e > len_k ? len_k : e));
  }
  // Whether `row` sees `key` (key < len_k is checked too): int32 arithmetic on the distance to
  // the diagonal, for per-element masks.
  __device__ __forceinline__ bool sees(int row, int key) const {
    const int distance = key - row - diagonal_offset;  // > 0: right of the diagonal
    return key < len_k && distance <= right32 && distance >= -left32;
  }
  // Whether no row of [first_row, last_row] sees a key of [first_key, last_key] (keys past len_k
  // count as seen: callers test whole tiles, conservatively). The distances to the diagonal over the
  // rectangle run from first_key - last_row to last_key - first_row; int32 as in sees().
  __device__ __forceinline__ bool misses(int first_row, int last_row, int first_key, int last_key) const {
    return first_key - last_row - diagonal_offset > right32 || last_key - first_row - diagonal_offset < -left32;
  }
  // The rows that see `key` (none when key >= len_k): row i sees it iff
  // i + diagonal_offset - left <= key <= i + diagonal_offset + right. Not clamped to [0, len_q).
  __device__ __forceinline__ IndexRange queries_seeing_key(int key) const {
    if (key >= len_k) return {1, 0};
    return {static_cast<int64_t>(key) - diagonal_offset - right, static_cast<int64_t>(key) - diagonal_offset + left + 1};
  }
  // The rows of [0, len_q) that see at least one key of [key_begin, key_end) (not empty).
  __device__ __forceinline__ int first_row_seeing(int key_begin) const {
    const int64_t r = static_cast<int64_t>(key_begin) - right - diagonal_offset;
    return static_cast<int>(r < 0 ? 0 : r);  // callers clamp to len_q
  }
  __device__ __forceinline__ int64_t end_row_seeing(int key_end) const {
    return static_cast<int64_t>(key_end) - 1 + left - diagonal_offset + 1;  // callers clamp to len_q
  }
};

}  // namespace flash_ext
