// The arguments of an op beyond its tensors, as every op body receives them: checked and normalised
// once, in make_options (params_from_tensors.h), at the op's entry (registration.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace flash_ext {

// What is computed, beyond q, k and v: shared by the dense and the variable-length ops, forward and
// backward. Option values as the op schema defines them (registration.cpp).
struct AttentionOptions {
  double softmax_scale = 0;
  bool causal = false;
  int64_t window_left = -1;   // -1: unbounded
  int64_t window_right = -1;  // -1: unbounded; 0 when causal (causal clamps the right side to the diagonal)
  double softcap = 0;         // 0: off
  std::optional<at::Tensor> alibi_slopes;  // float32, last dimension contiguous
  double dropout_p = 0;                    // 0: off
};

// cu_seqlens (contiguous) and max_seqlen of a variable-length call; empty for a dense call.
struct VarlenArgs {
  std::optional<at::Tensor> cu_seqlens_q;
  std::optional<at::Tensor> cu_seqlens_k;
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_k = 0;
  bool is_varlen() const { return cu_seqlens_q.has_value(); }
};

// Where a variable-length call's keys are when they are not simply packed (flash_ext::varlen_paged_fwd,
// attention_varlen's block_table / seqused_k): with block_table (int32 (batch, max_blocks)), k and v are page
// pools (num_blocks, page_size, heads_kv, head_dim) and key j of sequence b is slot j % page_size of page
// block_table[b][j / page_size]; with seqused_k (int32 (batch,)), sequence b uses its first seqused_k[b] keys
// instead of cu_seqlens_k[b + 1] - cu_seqlens_k[b].
struct PagedArgs {
  std::optional<at::Tensor> block_table;
  std::optional<at::Tensor> seqused_k;
};

}  // namespace flash_ext
