// flash_ext::kvcache_fwd on CUDA: the semantics of ops_kvcache_cpu.cpp as a composition that needs no host
// sync (the index tensors' values stay on the device, so a CUDA graph can replay it with advancing
// cache_seqlens): rotary and the in-place append by torch ops with device index tensors, a gather of every
// sequence's keys [cache_leftpad[b], cache_seqlens[b] + seqlen_new) into a packed batch, then the varlen CUDA
// forward. Correct, not fast: the gather reads and writes each sequence's whole cache capacity per call. The
// index values are the caller's contract here (an out-of-range one is a device-side error), as cu_seqlens are.
#include <ATen/TensorIndexing.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/floor_divide.h>
#include <ATen/ops/full.h>
#include <ATen/ops/remainder.h>
#include <ATen/ops/searchsorted.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>

#include <utility>

#include "kvcache_common.h"
#include "ops.h"
#include "params_from_tensors.h"

namespace flash_ext {
namespace {

// Where positions `pos` of sequences `seq` (long tensors of one shape) live in the caches: (block, slot) of a
// paged cache, (row, position) of a dense one.
std::pair<at::Tensor, at::Tensor> locate(const at::Tensor& seq, const at::Tensor& pos, const at::Tensor& rows,
                                         const at::Tensor& table, int64_t page_size) {
  if (table.defined()) {
    return {table.index({seq, at::floor_divide(pos, page_size)}), at::remainder(pos, page_size)};
  }
  return {rows.index({seq}), pos};
}

}  // namespace

KvcacheResult kvcache_fwd_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                               const std::optional<at::Tensor>& rotary_cos,
                               const std::optional<at::Tensor>& rotary_sin, bool rotary_interleaved,
                               const std::optional<at::Tensor>& cache_seqlens,
                               const std::optional<at::Tensor>& cache_batch_idx,
                               const std::optional<at::Tensor>& cache_leftpad,
                               const std::optional<at::Tensor>& block_table, double softmax_scale, bool causal,
                               int64_t window_left, int64_t window_right, double softcap,
                               const std::optional<at::Tensor>& alibi_slopes, int64_t num_splits) {
  check_kvcache_inputs(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                       cache_leftpad, block_table, num_splits);
  const c10::cuda::CUDAGuard device_guard(q.device());
  const int64_t batch = q.size(0), seqlen_q = q.size(1), heads_q = q.size(2), head_dim = q.size(3);
  const int64_t seqlen_new = k.has_value() ? k->size(1) : 0;
  const AttentionOptions options =
      make_options(q, batch, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, 0.0);
  const bool paged = block_table.has_value();
  const int64_t page_size = k_cache.size(1);
  const int64_t capacity = paged ? block_table->size(1) * page_size : k_cache.size(1);
  const auto longs = q.options().dtype(at::kLong);

  const at::Tensor seqlens = cache_seqlens.has_value() ? cache_seqlens->to(at::kLong) : at::full({batch}, capacity, longs);
  const at::Tensor leftpad = cache_leftpad.has_value() ? cache_leftpad->to(at::kLong) : at::zeros({batch}, longs);
  const at::Tensor table = paged ? block_table->to(at::kLong) : at::Tensor();
  const at::Tensor rows = paged                        ? at::Tensor()
                          : cache_batch_idx.has_value() ? cache_batch_idx->to(at::kLong)
                                                        : at::arange(batch, longs);
  const at::Tensor sequence_of_row = at::arange(batch, longs).unsqueeze(1);  // (batch, 1)

  // Rotary positions: the new keys at cache_seqlens[b] + i; the queries at cache_seqlens[b] + i when causal or
  // windowed, else all at cache_seqlens[b] (absolute cache positions, as on the CPU).
  at::Tensor q_used = q, k_new, v_new;
  const at::Tensor new_positions = seqlens.unsqueeze(1) + at::arange(seqlen_new, longs);  // (batch, seqlen_new)
  if (k.has_value()) {
    k_new = *k;
    v_new = *v;
  }
  if (rotary_cos.has_value()) {
    const bool local = causal || window_left >= 0 || window_right >= 0;
    const at::Tensor q_offsets = local ? at::arange(seqlen_q, longs) : at::zeros({seqlen_q}, longs);
    q_used = rotate(q, *rotary_cos, *rotary_sin, seqlens.unsqueeze(1) + q_offsets, rotary_interleaved);
    k_new = rotate(k_new, *rotary_cos, *rotary_sin, new_positions, rotary_interleaved);
  }
  if (seqlen_new > 0 && batch > 0) {
    const auto [first, second] = locate(sequence_of_row.expand_as(new_positions), new_positions, rows, table, page_size);
    k_cache.index_put_({first, second}, k_new);
    v_cache.index_put_({first, second}, v_new);
  }

  // Row p of the packed keys is key p - cu_seqlens_k[b] of the sequence b whose span holds p; rows past the
  // last sequence's end (the packed tensor is sized by the capacity, not by the lengths) read position 0.
  const at::Tensor lengths = seqlens + seqlen_new - leftpad;
  const at::Tensor cu_seqlens_k = at::cat({at::zeros({1}, longs), at::cumsum(lengths, 0)});
  const at::Tensor packed = at::arange(batch * capacity, longs);
  const at::Tensor sequence =
      at::clamp(at::searchsorted(cu_seqlens_k.narrow(0, 1, batch), packed, /*out_int32=*/false, /*right=*/true), 0,
                batch > 0 ? batch - 1 : 0);
  const at::Tensor valid = packed < cu_seqlens_k.narrow(0, batch, 1);
  const at::Tensor position = at::where(valid, leftpad.index({sequence}) + packed - cu_seqlens_k.index({sequence}), 0);
  auto [first, second] = locate(sequence, position, rows, table, page_size);
  first = at::where(valid, first, 0);
  second = at::where(valid, second, 0);
  const at::Tensor k_packed = k_cache.index({first, second}), v_packed = v_cache.index({first, second});

  const VarlenArgs varlen{(at::arange(batch + 1, longs) * seqlen_q).to(at::kInt), cu_seqlens_k.to(at::kInt),
                          seqlen_q, capacity};
  // num_splits: how a decode kernel would split the keys; the varlen kernels' result does not depend on it.
  auto [out, lse, rng_state] =
      attention_fwd_cuda(q_used.reshape({batch * seqlen_q, heads_q, head_dim}), k_packed, v_packed, options, varlen);
  (void)rng_state;
  return {out.view({batch, seqlen_q, heads_q, head_dim}),
          lse.view({heads_q, batch, seqlen_q}).permute({1, 0, 2}).contiguous()};
}

}  // namespace flash_ext
