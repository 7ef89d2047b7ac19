// From tensors and options to the torch-free params structs (params.h) the kernels read.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>

#include "../params.h"
#include "options.h"
#include "rng.h"

namespace flash_ext {

// The options of a call, checked (checks.h) and normalised: window_right clamped to 0 when causal,
// alibi_slopes with a contiguous last dimension. `batch`: the number of sequences.
AttentionOptions make_options(const at::Tensor& q, int64_t batch, double softmax_scale, bool causal,
                              int64_t window_left, int64_t window_right, double softcap,
                              const std::optional<at::Tensor>& alibi_slopes, double dropout_p);

// t itself where the kernels can read it in place (last dimension contiguous; on CUDA, 16-byte aligned base
// and strides), else a contiguous copy.
at::Tensor usable_layout(const at::Tensor& t);

// The forward's params: q, k, v (dense (batch, seqlen, heads, head_dim) or packed (total, heads, head_dim)),
// out and lse, the options and the dropout seed. head_dim is q's (the CUDA path sets the padded one).
FwdParams make_fwd_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                          const at::Tensor& lse, const AttentionOptions& options, const VarlenArgs& varlen,
                          const RngState& rng);

// The backward's: the forward's plus dout and the gradients.
BwdParams make_bwd_params(const FwdParams& fwd, const at::Tensor& dout, const at::Tensor& dq, const at::Tensor& dk,
                          const at::Tensor& dv, bool deterministic);

}  // namespace flash_ext
