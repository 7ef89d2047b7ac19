// What the CPU and CUDA bodies of flash_ext::kvcache_fwd share (kvcache_common.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace flash_ext {

// Everything about a kvcache_fwd call that needs no read of the index tensors' values.
void check_kvcache_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                          const std::optional<at::Tensor>& rotary_cos, const std::optional<at::Tensor>& rotary_sin,
                          const std::optional<at::Tensor>& cache_seqlens,
                          const std::optional<at::Tensor>& cache_batch_idx,
                          const std::optional<at::Tensor>& cache_leftpad, const std::optional<at::Tensor>& block_table,
                          int64_t num_splits);

// Rotary embedding of x (batch, seqlen, heads, head_dim) at positions (batch, seqlen), an integer tensor on x's
// device, in float32, rounded to x's dtype.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                  bool interleaved);

}  // namespace flash_ext
