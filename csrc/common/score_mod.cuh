// The score of one (query row, key) pair as the kernels' softmax sees it, in log2 units:
//   s = softmax_scale * q.k,  s = softcap * tanh(s / softcap) (softcap > 0),
//   s -= slope * |row + len_k - len_q - key| (ALiBi),  returned as s * log2(e).
// Plain attention folds all of this into one multiply by scale_log2; kernels take the general
// form only when softcap or ALiBi is on (a template flag), so the plain path keeps its one FFMA.
#pragma once

#include <cmath>

#include "../params.h"

namespace flash_ext {

struct ScoreMod {
  float scale_log2;      // softmax_scale * log2(e) (no softcap)
  float scale_over_cap;  // softmax_scale / softcap
  float cap_log2;        // softcap * log2(e); 0: no softcap
  float slope_log2;      // ALiBi slope of this (batch, head) * log2(e); 0: no ALiBi
  int diagonal_offset;   // len_k - len_q

  __device__ __forceinline__ ScoreMod(const FwdParams& params, int batch, int head, int len_q, int len_k) {
    constexpr float kLog2e = 1.4426950408889634f;
    scale_log2 = params.scale_log2;
    cap_log2 = params.softcap > 0.f ? params.softcap * kLog2e : 0.f;
    scale_over_cap = params.softcap > 0.f ? params.softmax_scale / params.softcap : 0.f;
    slope_log2 = params.alibi_slopes == nullptr ? 0.f : params.alibi_slope(batch, head) * kLog2e;
    diagonal_offset = len_k - len_q;
  }

  // log2-domain score of the raw dot product `raw` at (row, key). `tanh_value` receives
  // tanh(s / softcap) (0 without softcap): the backward's chain-rule factor is 1 - tanh^2.
  __device__ __forceinline__ float log2_score(float raw, int row, int key, float& tanh_value) const {
    float s;
    if (cap_log2 != 0.f) {
      tanh_value = tanhf(raw * scale_over_cap);
      s = cap_log2 * tanh_value;
    } else {
      tanh_value = 0.f;
      s = raw * scale_log2;
    }
    return s - slope_log2 * fabsf(static_cast<float>(row + diagonal_offset - key));
  }
};

}  // namespace flash_ext
