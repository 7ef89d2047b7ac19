// The op bodies of each device, after the entry checks (registration.cpp): q, k, v checked, options
// built by make_options, cu_seqlens contiguous.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <tuple>

#include "options.h"

namespace flash_ext {

using FwdResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // out, lse, rng_state
using BwdResult = std::tuple<at::Tensor, at::Tensor, at::Tensor>;  // dq, dk, dv
using KvcacheResult = std::tuple<at::Tensor, at::Tensor>;           // out, lse

FwdResult attention_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const AttentionOptions& options, const VarlenArgs& varlen);
BwdResult attention_bwd_cpu(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& out, const at::Tensor& lse, const AttentionOptions& options,
                            bool deterministic, const std::optional<at::Tensor>& rng_state, const VarlenArgs& varlen);
// flash_ext::varlen_paged_fwd (attention_varlen with block_table / seqused_k, forward only): the keys each
// sequence uses gathered into a packed batch (packed_keys.h), then the varlen forward. The CPU body checks the
// index values (check_varlen_paged_values_on_host) and packs exactly the used keys.
FwdResult varlen_paged_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const AttentionOptions& options, const VarlenArgs& varlen, const PagedArgs& paged);
// flash_ext.testing.dropout_keep_mask: the (batch, heads, seqlen_q, seqlen_k) keep mask (true = kept) that a
// forward with this rng_state and dropout_p applies, from the same Philox function.
at::Tensor dropout_keep_mask_cpu(const at::Tensor& rng_state, int64_t batch, int64_t heads, int64_t seqlen_q,
                                 int64_t seqlen_k, double dropout_p);

// flash_ext::kvcache_fwd (flash_ext.attention_with_kvcache), ops_kvcache_cpu.cpp: checks its own arguments,
// appends k / v to k_cache / v_cache in place, returns out (like q) and lse (batch, heads_q, seqlen_q).
KvcacheResult kvcache_fwd_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                              const std::optional<at::Tensor>& rotary_cos, const std::optional<at::Tensor>& rotary_sin,
                              bool rotary_interleaved, const std::optional<at::Tensor>& cache_seqlens,
                              const std::optional<at::Tensor>& cache_batch_idx,
                              const std::optional<at::Tensor>& cache_leftpad,
                              const std::optional<at::Tensor>& block_table, double softmax_scale, bool causal,
                              int64_t window_left, int64_t window_right, double softcap,
                              const std::optional<at::Tensor>& alibi_slopes, int64_t num_splits);

#ifdef FLASH_EXT_WITH_CUDA
// flash_ext::kvcache_fwd on CUDA (ops_kvcache_cuda.cpp): the same semantics, index values unchecked (no host sync).
KvcacheResult kvcache_fwd_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                               const std::optional<at::Tensor>& rotary_cos,
                               const std::optional<at::Tensor>& rotary_sin, bool rotary_interleaved,
                               const std::optional<at::Tensor>& cache_seqlens,
                               const std::optional<at::Tensor>& cache_batch_idx,
                               const std::optional<at::Tensor>& cache_leftpad,
                               const std::optional<at::Tensor>& block_table, double softmax_scale, bool causal,
                               int64_t window_left, int64_t window_right, double softcap,
                               const std::optional<at::Tensor>& alibi_slopes, int64_t num_splits);
FwdResult attention_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const AttentionOptions& options, const VarlenArgs& varlen);
// Keys that a variable-length forward reads in place from a cache (params.h, keys_in_cache): int32 (batch,)
// tensors on the cache's device; absent: positions from 0, cache row b.
struct CachedKeys {
  at::Tensor lengths;
  std::optional<at::Tensor> starts, rows;
  std::optional<at::Tensor> pages;  // a block table (int32, contiguous rows): the caches are page pools
};
// The forward of a variable-length q (cu_seqlens_q, max_seqlen_q; max_seqlen_k bounds the lengths) over keys
// read in place from (rows, positions, heads_kv, head_dim) caches k_cache / v_cache, or (pages, page_size, ...)
// pools with `pages` (no `starts` then): nullopt, no kernel launched, where no kernel reads them so (not sm90, a
// head dim without an sm90 kernel, dropout, pages that do not hold whole key blocks, layouts TMA cannot
// describe); the caller then gathers the keys (packed_keys.h).
std::optional<FwdResult> attention_fwd_keys_in_cache_cuda(const at::Tensor& q, const at::Tensor& k_cache,
                                                          const at::Tensor& v_cache, const AttentionOptions& options,
                                                          const VarlenArgs& varlen_q, const CachedKeys& keys);
// varlen_paged_fwd on CUDA: index values unchecked (no host sync); the packed batch is sized by a bound.
FwdResult varlen_paged_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const AttentionOptions& options, const VarlenArgs& varlen, const PagedArgs& paged);
BwdResult attention_bwd_cuda(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& out, const at::Tensor& lse, const AttentionOptions& options,
                             bool deterministic, const std::optional<at::Tensor>& rng_state, const VarlenArgs& varlen);
// Which kernels a dense call with these inputs takes, forward and backward (flash_ext.kernel_path).
std::string kernel_path_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const AttentionOptions& options, bool deterministic);
#endif

}  // namespace flash_ext
