// flash_ext::kvcache_fwd on CUDA: the semantics of ops_kvcache_cpu.cpp with no host sync (the index tensors'
// values stay on the device, so a CUDA graph can replay a call with advancing cache_seqlens): the in-place append
// and rotary by one kernel (decode/append_kernel.cuh), then the attention step. Decode and speculative
// decoding (few query rows per kv head) take the split-KV decode kernels (csrc/decode/), which read the keys
// through the block table or the cache rows in place. Prefill against a cached prefix, head dims without a
// decode kernel, and caches it cannot read (strides or base not 16-byte aligned) take a gather of each
// sequence's keys [cache_leftpad[b], cache_seqlens[b] + seqlen_new) into a packed batch (packed_keys.h) and the varlen forward
// instead. The index values are the caller's contract here (an out-of-range one is a device-side error), as
// cu_seqlens are.
#include <ATen/TensorIndexing.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <tuple>
#include <utility>

#include "../dispatch.h"
#include "../decode/launch.h"
#include "../host/device_info.h"
#include "kvcache_common.h"
#include "ops.h"
#include "packed_keys.h"
#include "params_from_tensors.h"

namespace flash_ext {
namespace {

// Whether the decode kernels can read the caches in place: 16-byte aligned bases and strides, the same strides
// for k_cache and v_cache, the head dim one they are built for.
bool decode_applies(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  const auto aligned = [](const at::Tensor& t) {
    if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0 || t.stride(3) != 1) return false;
    for (int d = 0; d < 3; ++d)
      if (t.stride(d) % 8 != 0) return false;
    return true;
  };
  return decode_supports(static_cast<int>(k_cache.size(3))) && k_cache.strides() == v_cache.strides() &&
         aligned(k_cache) && aligned(v_cache);
}

// Whether the decode kernels take a call: few packed rows per kv head (decode, speculative decoding: at most two
// CTA row chunks), so that reading each K / V byte once per chunk beats a gather into the training kernels;
// those take prefill against a cached prefix, where the arithmetic dominates.
bool decode_takes(int64_t seqlen_q, int64_t group) { return seqlen_q * group <= 128; }

// An optional index tensor as the kernels read it: int32, contiguous.
std::optional<at::Tensor> int32_contiguous(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(t->to(at::kInt).contiguous()) : std::nullopt;
}

// Key splits, in whole CTA rounds of keys and at least four rounds (256 keys) a split, so that a CTA's fixed costs
// (its first copies, the merge, its share of the combine) stay a small part of its time. CTAs an SM gets: one at head
// dims 128 and 256 (a second CTA's split shares the SM's bandwidth and adds those fixed costs); every resident slot
// at head dim 64 (more would be a second partial wave) and with pages of fewer than 64 keys, where every slice comes
// from a page elsewhere in memory and a second CTA's copies in flight hide more of that. The measurements behind
// both: docs/performance.md (decode). `requested` > 0 forces the number.
std::pair<int, int64_t> decode_splits(int64_t requested, int64_t ctas_without_split, int64_t capacity,
                                      int head_dim, int rows, int page_size, int num_sms) {
  const auto keys_per = [](int64_t keys, int64_t parts) {
    const int64_t round = decode::kCtaKeys;
    return std::max<int64_t>(round, ((keys + parts - 1) / parts + round - 1) / round * round);
  };
  if (requested > 0) {
    const int64_t splits = std::min<int64_t>(requested, decode::kMaxSplits);
    return {static_cast<int>(splits), keys_per(capacity, splits)};
  }
  const bool small_pages = page_size > 0 && page_size < 64;
  const int64_t per_sm =
      head_dim >= 128 && !small_pages ? 1 : decode::resident_ctas_per_sm(head_dim, decode::row_tiles(rows));
  const int64_t slots = int64_t{num_sms} * per_sm;
  const int64_t wanted = std::max<int64_t>(1, slots / std::max<int64_t>(ctas_without_split, 1));
  const int64_t keys = std::max<int64_t>(4 * decode::kCtaKeys, keys_per(capacity, std::min<int64_t>(wanted, 256)));
  return {static_cast<int>((capacity + keys - 1) / keys), keys};
}

// The attention step on the decode kernels: reads the caches in place (through the block table or the
// cache rows), the index tensors as given (int32, made contiguous).
KvcacheResult run_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const std::optional<at::Tensor>& cache_seqlens,
                         const std::optional<at::Tensor>& cache_batch_idx,
                         const std::optional<at::Tensor>& cache_leftpad,
                         const std::optional<at::Tensor>& block_table, int64_t seqlen_new, int64_t capacity,
                         const AttentionOptions& options, int64_t num_splits) {
  const int64_t batch = q.size(0), seqlen_q = q.size(1), heads_q = q.size(2), head_dim = q.size(3);
  // The kernel reads q in 16-byte pieces.
  const at::Tensor q_dense = reinterpret_cast<uintptr_t>(q.data_ptr()) % 16 == 0 ? q.contiguous() : q.clone();
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({batch, heads_q, seqlen_q}, q.options().dtype(at::kFloat));
  const std::optional<at::Tensor> seqlens_i = int32_contiguous(cache_seqlens), leftpad_i = int32_contiguous(cache_leftpad),
                                  rows_i = int32_contiguous(cache_batch_idx), table_i = int32_contiguous(block_table);
  DecodeParams p;
  p.q = q_dense.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.cache_batch_stride = k_cache.stride(0);
  p.cache_row_stride = k_cache.stride(1);
  p.cache_head_stride = k_cache.stride(2);
  if (table_i.has_value()) {
    p.block_table = table_i->data_ptr<int32_t>();
    p.block_table_stride = table_i->stride(0);
    p.page_size = static_cast<int>(k_cache.size(1));
  }
  if (rows_i.has_value()) p.cache_batch_idx = rows_i->data_ptr<int32_t>();
  if (seqlens_i.has_value()) p.seqlens = seqlens_i->data_ptr<int32_t>();
  if (leftpad_i.has_value()) p.leftpad = leftpad_i->data_ptr<int32_t>();
  p.seqlen_new = static_cast<int>(seqlen_new);
  p.capacity = capacity;
  p.batch = static_cast<int>(batch);
  p.seqlen_q = static_cast<int>(seqlen_q);
  p.heads_q = static_cast<int>(heads_q);
  p.heads_kv = static_cast<int>(k_cache.size(2));
  p.head_dim = static_cast<int>(head_dim);
  p.softmax_scale = static_cast<float>(options.softmax_scale);
  p.softcap = static_cast<float>(options.softcap);
  if (options.alibi_slopes.has_value()) {
    p.alibi_slopes = options.alibi_slopes->data_ptr<float>();
    p.alibi_batch_stride = options.alibi_slopes->dim() == 2 ? options.alibi_slopes->stride(0) : 0;
  }
  p.window_left = static_cast<int>(options.window_left);
  p.window_right = static_cast<int>(options.window_right);
  const int rows = p.heads_q / p.heads_kv * p.seqlen_q;
  p.row_chunks = (rows + decode::rows_per_cta(rows) - 1) / decode::rows_per_cta(rows);
  std::tie(p.num_splits, p.keys_per_split) =
      decode_splits(num_splits, int64_t{batch} * p.heads_kv * p.row_chunks, capacity, p.head_dim, rows, p.page_size,
                    device_info(q.device().index()).num_sms);
  at::Tensor out_partial, lse_partial;
  if (p.num_splits > 1) {
    out_partial = at::empty({p.num_splits, batch * seqlen_q * heads_q, head_dim}, q.options().dtype(at::kFloat));
    lse_partial = at::empty({p.num_splits, batch * seqlen_q * heads_q}, q.options().dtype(at::kFloat));
    p.out_partial = out_partial.data_ptr<float>();
    p.lse_partial = lse_partial.data_ptr<float>();
  }
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
#ifdef FLASH_EXT_DECODE_TRACE
  // A developer's build (csrc/decode/decode_trace.cuh): the timeline buffer's address, read at every call.
  if (const char* trace = std::getenv("FLASH_EXT_DECODE_TRACE_PTR")) {
    p.trace = reinterpret_cast<unsigned long long*>(std::strtoull(trace, nullptr, 10));
  }
#endif
  run_attention_decode(p, q.scalar_type() == at::kBFloat16, c10::cuda::getCurrentCUDAStream().stream());
  return {out, lse};
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

  // Index tensors as int64, formed only where a step needs them (each is a kernel launch).
  const auto seqlens_of = [&] {
    return cache_seqlens.has_value() ? cache_seqlens->to(at::kLong) : at::full({batch}, capacity, longs);
  };
  // Where each sequence's keys are (its pages, or its cache row); the block table as int64.
  const auto storage_of = [&] {
    if (paged) return KeyStorage{block_table->to(at::kLong), at::Tensor(), page_size};
    return KeyStorage{at::Tensor(), cache_batch_idx.has_value() ? cache_batch_idx->to(at::kLong) : at::arange(batch, longs),
                      0};
  };

  // The append (and rotary) in one kernel: the new keys at cache_seqlens[b] + i; with rotary, the queries at
  // cache_seqlens[b] + i when causal or windowed, else all at cache_seqlens[b] (absolute cache positions, as on the
  // CPU).
  at::Tensor q_used = q;
  if ((rotary_cos.has_value() || seqlen_new > 0) && batch > 0) {
    const std::optional<at::Tensor> seqlens_i = int32_contiguous(cache_seqlens),
                                    rows_i = int32_contiguous(cache_batch_idx), table_i = int32_contiguous(block_table);
    KvAppendParams p;
    const auto copy_strides = [](const at::Tensor& t, int64_t* strides) {
      for (int d = 0; d < 4; ++d) strides[d] = t.stride(d);
    };
    if (seqlen_new > 0) {
      p.k_new = k->data_ptr();
      p.v_new = v->data_ptr();
      copy_strides(*k, p.k_new_strides);
      copy_strides(*v, p.v_new_strides);
    }
    p.k_cache = k_cache.data_ptr();
    p.v_cache = v_cache.data_ptr();
    copy_strides(k_cache, p.k_cache_strides);
    copy_strides(v_cache, p.v_cache_strides);
    p.cache_rows = k_cache.size(0);
    if (table_i.has_value()) {
      p.block_table = table_i->data_ptr<int32_t>();
      p.block_table_stride = table_i->stride(0);
      p.page_size = static_cast<int>(page_size);
    }
    if (rows_i.has_value()) p.cache_batch_idx = rows_i->data_ptr<int32_t>();
    if (seqlens_i.has_value()) p.seqlens = seqlens_i->data_ptr<int32_t>();
    p.capacity = capacity;
    p.batch = static_cast<int>(batch);
    p.seqlen_new = static_cast<int>(seqlen_new);
    p.heads_kv = static_cast<int>(k_cache.size(2));
    p.head_dim = static_cast<int>(head_dim);
    at::Tensor cos, sin;
    if (rotary_cos.has_value()) {
      cos = rotary_cos->contiguous();
      sin = rotary_sin->contiguous();
      p.cos = cos.data_ptr();
      p.sin = sin.data_ptr();
      p.seqlen_ro = cos.size(0);
      p.rotary_half = static_cast<int>(cos.size(1));
      p.interleaved = rotary_interleaved;
      if (seqlen_q > 0) {
        q_used = at::empty(q.sizes(), q.options());
        p.q = q.data_ptr();
        copy_strides(q, p.q_strides);
        p.q_out = q_used.data_ptr();
        p.seqlen_q = static_cast<int>(seqlen_q);
        p.heads_q = static_cast<int>(heads_q);
        p.q_positions_advance = causal || window_left >= 0 || window_right >= 0;
      }
    }
    run_kv_append(p, q.scalar_type() == at::kBFloat16, c10::cuda::getCurrentCUDAStream().stream());
  }

  if (batch > 0 && seqlen_q > 0 && decode_applies(k_cache, v_cache) &&
      decode_takes(seqlen_q, heads_q / k_cache.size(2))) {
    return run_decode(q_used, k_cache, v_cache, cache_seqlens, cache_batch_idx, cache_leftpad, block_table,
                      seqlen_new, capacity, options, num_splits);
  }

  const at::Tensor seqlens = seqlens_of();
  const at::Tensor leftpad = cache_leftpad.has_value() ? cache_leftpad->to(at::kLong) : at::zeros({batch}, longs);
  // Each sequence's keys are [cache_leftpad[b], cache_seqlens[b] + seqlen_new) of its cache row or pages (the
  // lengths are on the device; out-of-contract ones are clamped to the cache).
  const at::Tensor lengths = at::clamp(seqlens + seqlen_new - leftpad, 0, capacity);
  const at::Tensor cu_seqlens_q = (at::arange(batch + 1, longs) * seqlen_q).to(at::kInt);
  const at::Tensor q_packed = q_used.reshape({batch * seqlen_q, heads_q, head_dim});
  const auto result = [&](const at::Tensor& out, const at::Tensor& lse) -> KvcacheResult {
    return {out.view({batch, seqlen_q, heads_q, head_dim}),
            lse.view({heads_q, batch, seqlen_q}).permute({1, 0, 2}).contiguous()};
  };
  // num_splits: how a decode kernel would split the keys; the forward's result does not depend on it.
  // The sm90 forward reads a dense cache in place, and pages without cache_leftpad whose size is a multiple of its
  // key block (one TMA box per block, its page from the block table); otherwise the keys are gathered into
  // packed rows (pages of 16 read in place, eight boxes a block, ran at 0.36x of the dense forward:
  // docs/design.md).
  if (!paged || !cache_leftpad.has_value()) {
    const CachedKeys keys{lengths.to(at::kInt), int32_contiguous(cache_leftpad), int32_contiguous(cache_batch_idx),
                          int32_contiguous(block_table)};
    const VarlenArgs varlen_q{cu_seqlens_q, std::nullopt, seqlen_q, capacity};
    if (auto fwd = attention_fwd_keys_in_cache_cuda(q_packed, k_cache, v_cache, options, varlen_q, keys)) {
      return result(std::get<0>(*fwd), std::get<1>(*fwd));
    }
  }
  const PackedKeys packed = pack_keys(k_cache, v_cache, storage_of(), leftpad, lengths, batch * capacity);
  const VarlenArgs varlen{cu_seqlens_q, packed.cu_seqlens_k, seqlen_q, capacity};
  auto [out, lse, rng_state] = attention_fwd_cuda(q_packed, packed.k, packed.v, options, varlen);
  (void)rng_state;
  return result(out, lse);
}

}  // namespace flash_ext
