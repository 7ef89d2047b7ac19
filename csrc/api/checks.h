// Input checks of the ops. Every message names the argument and says what was expected; nothing here
// reads device memory (no device-to-host sync), except check_varlen_values_on_host, for host tensors.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "options.h"

namespace flash_ext {

// Dense batch: q (batch, seqlen_q, heads_q, head_dim), k and v (batch, seqlen_k, heads_kv, head_dim).
void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v);

// Variable-length batch: q (total_q, heads_q, head_dim), k and v (total_k, heads_kv, head_dim), cu_seqlens
// int32 (batch + 1) on q's device, max_seqlen_* in int32 range.
void check_varlen_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                         const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k);

// attention_varlen with block_table and / or seqused_k (PagedArgs): as check_varlen_inputs, except that with
// block_table k and v are page pools (num_blocks, page_size, heads_kv, head_dim) read through block_table;
// seqused_k int32 (batch,) on q's device.
void check_varlen_paged_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                               int64_t max_seqlen_k, const PagedArgs& paged);

// A block table: int32 (batch, max_blocks) on q's device, over `pool` (named pool_name in the messages), a page
// pool (num_blocks, page_size, heads_kv, head_dim) whose page_size must be >= 1. The dimensions of the pool
// are the caller's check.
void check_block_table(const at::Tensor& block_table, int64_t batch, const at::Tensor& q, const at::Tensor& pool,
                       const char* pool_name);

// An optional per-sequence index tensor (cache_seqlens, seqused_k, ...): int32 (batch,) on q's device.
void check_int32_per_sequence(const std::optional<at::Tensor>& t, const char* name, int64_t batch,
                              const at::Tensor& q);

// The number of sequences of a variable-length call, from cu_seqlens_q's size.
int64_t varlen_batch(const at::Tensor& cu_seqlens_q);

// cu_seqlens' values, for host tensors (the CPU path): start at 0, never decrease, end at total_q / total_k,
// no sequence longer than max_seqlen_*. A CUDA path cannot read them without waiting for the stream: there
// they are the caller's contract.
void check_varlen_values_on_host(const at::Tensor& q, const at::Tensor& k, const VarlenArgs& varlen);

// The values of a varlen_paged_fwd call, for host tensors (the CPU path): cu_seqlens_q as above; cu_seqlens_k
// starts at 0 and never decreases, ends at total_k when k is packed (no block_table), and bounds each
// sequence's keys by max_seqlen_k unless seqused_k gives them; seqused_k[b] in 0..the keys sequence b's storage
// holds (its pages, max_blocks * page_size, or its span of k) and <= max_seqlen_k; the pages a sequence uses
// are blocks of k. Entries of block_table past a sequence's used pages are not read (they may hold anything).
void check_varlen_paged_values_on_host(const at::Tensor& q, const at::Tensor& k, const VarlenArgs& varlen,
                                       const PagedArgs& paged);

// `batch`: the number of (dense or packed) sequences, which a (batch, heads_q) alibi_slopes must match.
void check_options(const AttentionOptions& options, const at::Tensor& q, int64_t batch);

// The backward's dout, out (like q) and lse (float32 of `lse_shape`, named `lse_layout` in the message).
void check_bwd_tensors(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out, const at::Tensor& lse,
                       at::IntArrayRef lse_shape, const char* lse_layout);

}  // namespace flash_ext
