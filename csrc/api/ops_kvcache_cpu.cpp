// flash_ext::kvcache_fwd on the CPU (flash_ext.attention_with_kvcache): the new k / v appended to the caches in
// place (rotary embedding applied to them first), then attention of q (rotated too) over each sequence's keys
// [cache_leftpad[b], cache_seqlens[b] + seqlen_new), through the variable-length CPU forward
// (attention_fwd_cpu, csrc/cpu/). The append, the gather of each sequence's keys (through the block table when
// the caches are paged) and the rotary embedding are plain torch ops: this is the executable specification of
// the semantics, not a fast path (it copies every sequence's keys once per call).
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/stack.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../error_message.h"
#include "checks.h"
#include "kvcache_common.h"
#include "ops.h"
#include "params_from_tensors.h"

namespace flash_ext {
namespace {

std::vector<int64_t> values_or(const std::optional<at::Tensor>& t, int64_t batch, int64_t fallback) {
  std::vector<int64_t> values(batch, fallback);
  if (t.has_value()) {
    const at::Tensor c = t->contiguous();
    const int32_t* p = c.data_ptr<int32_t>();
    for (int64_t b = 0; b < batch; ++b) values[b] = p[b];
  }
  return values;
}

at::Tensor int_tensor(const std::vector<int64_t>& values, at::ScalarType type, const at::Tensor& like) {
  at::Tensor t = at::empty({static_cast<int64_t>(values.size())}, like.options().dtype(type));
  if (type == at::kInt) {
    int32_t* p = t.data_ptr<int32_t>();
    for (size_t i = 0; i < values.size(); ++i) p[i] = static_cast<int32_t>(values[i]);
  } else {
    int64_t* p = t.data_ptr<int64_t>();
    for (size_t i = 0; i < values.size(); ++i) p[i] = values[i];
  }
  return t;
}

// Where sequence b's positions [start, end) live: one (seqlen, heads_kv, head_dim) view per contiguous run
// (a cache row when dense, one run per page when paged).
struct CacheLayout {
  const at::Tensor* block_table = nullptr;  // contiguous int32 (batch, max_blocks), or null when dense
  std::vector<int64_t> rows;                // the cache row of each sequence (dense)
  int64_t page_size = 0;

  template <typename F>
  void for_each_run(const at::Tensor& cache, int64_t b, int64_t start, int64_t end, F&& f) const {
    if (block_table == nullptr) {
      if (end > start) f(cache.select(0, rows[b]).narrow(0, start, end - start), start);
      return;
    }
    const int32_t* table = block_table->data_ptr<int32_t>() + b * block_table->size(1);
    for (int64_t pos = start; pos < end;) {
      const int64_t offset = pos % page_size, n = std::min(end - pos, page_size - offset);
      f(cache.select(0, table[pos / page_size]).narrow(0, offset, n), pos);
      pos += n;
    }
  }
};

}  // namespace

KvcacheResult kvcache_fwd_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                              const std::optional<at::Tensor>& rotary_cos, const std::optional<at::Tensor>& rotary_sin,
                              bool rotary_interleaved, const std::optional<at::Tensor>& cache_seqlens,
                              const std::optional<at::Tensor>& cache_batch_idx,
                              const std::optional<at::Tensor>& cache_leftpad,
                              const std::optional<at::Tensor>& block_table, double softmax_scale, bool causal,
                              int64_t window_left, int64_t window_right, double softcap,
                              const std::optional<at::Tensor>& alibi_slopes, int64_t num_splits) {
  check_kvcache_inputs(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                       cache_leftpad, block_table, num_splits);
  const int64_t batch = q.size(0), seqlen_q = q.size(1), heads_q = q.size(2), head_dim = q.size(3);
  const int64_t heads_kv = k_cache.size(2), seqlen_new = k.has_value() ? k->size(1) : 0;
  const AttentionOptions options =
      make_options(q, batch, softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, 0.0);
  const bool paged = block_table.has_value();
  const int64_t capacity = paged ? block_table->size(1) * k_cache.size(1) : k_cache.size(1);

  // The index tensors' values (host memory: reading them is free here).
  const std::vector<int64_t> seqlens = values_or(cache_seqlens, batch, capacity);  // None: every key
  const std::vector<int64_t> leftpad = values_or(cache_leftpad, batch, 0);
  CacheLayout layout;
  at::Tensor table;
  if (paged) {
    table = block_table->contiguous();
    layout.block_table = &table;
    layout.page_size = k_cache.size(1);
  } else {
    layout.rows = values_or(cache_batch_idx, batch, 0);
    if (!cache_batch_idx.has_value())
      for (int64_t b = 0; b < batch; ++b) layout.rows[b] = b;
  }
  for (int64_t b = 0; b < batch; ++b) {
    FLASH_EXT_CHECK(seqlens[b] >= 0, "flash_ext: cache_seqlens[", b, "] = ", seqlens[b], " must be >= 0");
    FLASH_EXT_CHECK(seqlens[b] + seqlen_new <= capacity, "flash_ext: the cache is too short: cache_seqlens[", b,
                    "] = ", seqlens[b], " plus seqlen_new = ", seqlen_new, " exceeds the ", capacity,
                    " keys a sequence of the cache holds");
    FLASH_EXT_CHECK(leftpad[b] >= 0 && leftpad[b] <= seqlens[b], "flash_ext: cache_leftpad[", b, "] = ", leftpad[b],
                    " must be in 0..cache_seqlens[", b, "] = ", seqlens[b]);
    if (paged) {
      const int32_t* row = table.data_ptr<int32_t>() + b * table.size(1);
      const int64_t end = seqlens[b] + seqlen_new;
      for (int64_t page = leftpad[b] / layout.page_size; page * layout.page_size < end; ++page)
        FLASH_EXT_CHECK(row[page] >= 0 && row[page] < k_cache.size(0), "flash_ext: block_table[", b, "][", page,
                        "] = ", row[page], " is not a block of k_cache (0..", k_cache.size(0) - 1, ")");
    } else if (cache_batch_idx.has_value()) {
      FLASH_EXT_CHECK(layout.rows[b] >= 0 && layout.rows[b] < k_cache.size(0), "flash_ext: cache_batch_idx[", b,
                      "] = ", layout.rows[b], " is not a row of k_cache (0..", k_cache.size(0) - 1, ")");
      for (int64_t other = 0; other < b && seqlen_new > 0; ++other)
        FLASH_EXT_CHECK(layout.rows[other] != layout.rows[b], "flash_ext: cache_batch_idx[", other,
                        "] and cache_batch_idx[", b, "] are both ", layout.rows[b],
                        "; with k and v appended, each sequence needs its own cache row");
    }
  }

  // Rotary positions: the new keys at cache_seqlens[b] + i; the queries at cache_seqlens[b] + i when causal or
  // windowed, else all at cache_seqlens[b] (absolute cache positions: cache_leftpad does not shift them).
  at::Tensor q_used = q;
  at::Tensor k_new = k.has_value() ? *k : at::Tensor(), v_new = v.has_value() ? *v : at::Tensor();
  if (rotary_cos.has_value()) {
    const bool local = causal || window_left >= 0 || window_right >= 0;
    const int64_t seqlen_ro = rotary_cos->size(0);
    std::vector<int64_t> q_positions(batch * seqlen_q), k_positions(batch * seqlen_new);
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t i = 0; i < seqlen_q; ++i) q_positions[b * seqlen_q + i] = seqlens[b] + (local ? i : 0);
      for (int64_t i = 0; i < seqlen_new; ++i) k_positions[b * seqlen_new + i] = seqlens[b] + i;
      if (seqlen_q > 0) {
        const int64_t last = q_positions[b * seqlen_q + seqlen_q - 1];
        FLASH_EXT_CHECK(last < seqlen_ro, "flash_ext: query ", seqlen_q - 1, " of sequence ", b,
                        " takes the rotary embedding at position ", last, " but rotary_cos has ", seqlen_ro, " rows");
      }
    }
    q_used = rotate(q, *rotary_cos, *rotary_sin, int_tensor(q_positions, at::kLong, q), rotary_interleaved);
    k_new = rotate(k_new, *rotary_cos, *rotary_sin, int_tensor(k_positions, at::kLong, q), rotary_interleaved);
  }

  // Append, then gather each sequence's keys [leftpad, cache_seqlens + seqlen_new) into a packed batch.
  std::vector<at::Tensor> k_runs, v_runs;
  std::vector<int64_t> cu_seqlens_k(batch + 1, 0);
  int64_t max_seqlen_k = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t start = seqlens[b], end = seqlens[b] + seqlen_new;
    if (seqlen_new > 0) {
      layout.for_each_run(k_cache, b, start, end, [&](const at::Tensor& run, int64_t pos) {
        run.copy_(k_new.select(0, b).narrow(0, pos - start, run.size(0)));
      });
      layout.for_each_run(v_cache, b, start, end, [&](const at::Tensor& run, int64_t pos) {
        run.copy_(v_new.select(0, b).narrow(0, pos - start, run.size(0)));
      });
    }
    layout.for_each_run(k_cache, b, leftpad[b], end, [&](const at::Tensor& run, int64_t) { k_runs.push_back(run); });
    layout.for_each_run(v_cache, b, leftpad[b], end, [&](const at::Tensor& run, int64_t) { v_runs.push_back(run); });
    cu_seqlens_k[b + 1] = cu_seqlens_k[b] + (end - leftpad[b]);
    max_seqlen_k = std::max(max_seqlen_k, end - leftpad[b]);
  }
  const auto gather = [&](const std::vector<at::Tensor>& runs) {
    return runs.empty() ? at::empty({0, heads_kv, head_dim}, k_cache.options()) : at::cat(runs, 0);
  };
  const at::Tensor k_packed = gather(k_runs), v_packed = gather(v_runs);

  std::vector<int64_t> cu_seqlens_q(batch + 1);
  for (int64_t b = 0; b <= batch; ++b) cu_seqlens_q[b] = b * seqlen_q;
  const VarlenArgs varlen{int_tensor(cu_seqlens_q, at::kInt, q), int_tensor(cu_seqlens_k, at::kInt, q), seqlen_q,
                          max_seqlen_k};
  const at::Tensor q_packed = q_used.reshape({batch * seqlen_q, heads_q, head_dim});
  // num_splits: how a GPU kernel would split the keys; the CPU forward's result does not depend on it.
  auto [out, lse, rng_state] = attention_fwd_cpu(q_packed, k_packed, v_packed, options, varlen);
  (void)rng_state;
  return {out.view({batch, seqlen_q, heads_q, head_dim}),
          lse.view({heads_q, batch, seqlen_q}).permute({1, 0, 2}).contiguous()};
}

}  // namespace flash_ext
