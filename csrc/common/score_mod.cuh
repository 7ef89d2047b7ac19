// The score of one (query row, key) pair with softcap and ALiBi, as the kernels' softmax sees it:
//   s = softmax_scale * q.k,  s = softcap * tanh(s / softcap) (softcap > 0),
//   s -= slope * |row + len_k - len_q - key| (ALiBi).
// The backward keeps scores in raw q.k units (the softmax multiplies by softmax_scale * log2(e) in one
// FFMA), so the modified score is returned as s / softmax_scale: its
// P = exp2(score * scale_log2 - lse * log2(e)) then needs no special case. The forward keeps a softcapped
// score as tanh(s / softcap) instead (fwd_tanh; params.h, fwd_score_scale).
// Plain attention never calls this (kernels take it only under a template flag).
#pragma once

#include <cmath>

#include "../params.h"

namespace flash_ext {

// tanh on the MUFU unit (sm75+): max relative error about 2^-11. In s = softcap * tanh(.) that is
// an absolute error below softcap * 2^-11 in a logit, the size of bf16 rounding of a logit of
// that magnitude; the forward and the backward use the same function, so P is recomputed exactly.
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

struct ScoreMod {
  float scale_over_cap;  // softmax_scale / softcap
  float cap_raw;         // softcap / softmax_scale; 0: no softcap
  float slope_raw;       // ALiBi slope of this (batch, head) / softmax_scale; 0: no ALiBi
  float slope_fwd;       // the same slope in the forward's score units (fwd_tanh)
  int diagonal_offset;   // len_k - len_q

  __device__ __forceinline__ ScoreMod(const FwdParams& params, int batch, int head, int len_q, int len_k) {
    cap_raw = params.softcap > 0.f ? params.softcap / params.softmax_scale : 0.f;
    scale_over_cap = params.softcap > 0.f ? params.softmax_scale / params.softcap : 0.f;
    slope_raw = params.alibi_slopes == nullptr ? 0.f : params.alibi_slope(batch, head) / params.softmax_scale;
    slope_fwd = params.alibi_slopes == nullptr
                    ? 0.f
                    : params.alibi_slope(batch, head) / (params.softcap > 0.f ? params.softcap : params.softmax_scale);
    diagonal_offset = len_k - len_q;
  }

  // The modified score of raw dot product `raw` at (row, key), in raw units. `tanh_value` receives
  // tanh(s / softcap) (0 without softcap): the backward's chain-rule factor is 1 - tanh^2.
  // Positions go through float (exact below 2^24): one FADD and one FFMA per element for ALiBi.
  __device__ __forceinline__ float raw_score(float raw, float row_on_diagonal, float key, float& tanh_value) const {
    float s = raw;
    tanh_value = 0.f;
    if (has_softcap()) s = softcapped(raw, tanh_value);
    return with_alibi(s, row_on_diagonal, key);
  }
  // The two steps of raw_score.
  __device__ __forceinline__ bool has_softcap() const { return cap_raw != 0.f; }
  __device__ __forceinline__ bool has_alibi() const { return slope_raw != 0.f; }
  __device__ __forceinline__ float softcapped(float raw, float& tanh_value) const {
    tanh_value = fast_tanh(raw * scale_over_cap);
    return cap_raw * tanh_value;
  }
  __device__ __forceinline__ float with_alibi(float s, float row_on_diagonal, float key) const {
    return fmaf(-slope_raw, fabsf(row_on_diagonal - key), s);
  }
  // The forward's score units (params.h, fwd_score_scale), one pass each (fwd_kernel.cuh): with softcap
  // it keeps tanh(s / softcap), not softcap * tanh(.) / softmax_scale, and its softmax multiplies by
  // softcap * log2(e) in the FFMA it does anyway (one FMUL per score less; ALiBi's slope is in those
  // units). Not faster by itself (softcap fwd +1.6% time beside the spilling kernel, H200, hd128, 8k,
  // 2026-11-30), but with it the softcap / ALiBi / dropout forward spills nothing (CUDA 13.0, sm_90a).
  __device__ __forceinline__ float fwd_tanh(float raw) const { return fast_tanh(raw * scale_over_cap); }
  __device__ __forceinline__ float fwd_with_alibi(float s, float row_on_diagonal, float key) const {
    return fmaf(-slope_fwd, fabsf(row_on_diagonal - key), s);
  }
  // Whether softcap or ALiBi is on (the kernels' kExtras variant also runs dropout-only calls).
  __device__ __forceinline__ bool active() const { return cap_raw != 0.f || slope_raw != 0.f; }
  // row + len_k - len_q as a float: the key on the row's diagonal.
  __device__ __forceinline__ float row_on_diagonal(int row) const { return static_cast<float>(row + diagonal_offset); }
};

}  // namespace flash_ext
