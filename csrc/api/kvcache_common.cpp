// What the CPU and CUDA bodies of flash_ext::kvcache_fwd share: the checks that need no read of the index
// tensors' values (mirrored by _kvcache_fwd_fake in flash_ext/_ops.py); and the CPU body's rotary embedding by torch
// ops, whose roundings the CUDA append kernel (decode/append_kernel.cuh) repeats.
#include "kvcache_common.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/stack.h>

#include <utility>

#include "../error_message.h"
#include "checks.h"

namespace flash_ext {

// Everything that needs no read of the index tensors' values (mirrored by _kvcache_fwd_fake in flash_ext/_ops.py).
void check_kvcache_inputs(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                          const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                          const std::optional<at::Tensor>& rotary_cos, const std::optional<at::Tensor>& rotary_sin,
                          const std::optional<at::Tensor>& cache_seqlens,
                          const std::optional<at::Tensor>& cache_batch_idx,
                          const std::optional<at::Tensor>& cache_leftpad, const std::optional<at::Tensor>& block_table,
                          int64_t num_splits) {
  FLASH_EXT_CHECK(q.dim() == 4, "flash_ext: q must have 4 dimensions (batch, seqlen_q, heads_q, head_dim), got ",
                  q.dim(), " (shape ", q.sizes(), ")");
  FLASH_EXT_CHECK(k_cache.dim() == 4,
                  "flash_ext: k_cache must have 4 dimensions (batch_cache, seqlen_cache, heads_kv, head_dim) or "
                  "(num_blocks, page_size, heads_kv, head_dim), got ",
                  k_cache.dim(), " (shape ", k_cache.sizes(), ")");
  FLASH_EXT_CHECK(v_cache.sizes() == k_cache.sizes(), "flash_ext: k_cache and v_cache must have the same shape, got ",
                  k_cache.sizes(), " and ", v_cache.sizes());
  const auto dtype = q.scalar_type();
  FLASH_EXT_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || (dtype == at::kFloat && !q.is_cuda()),
                  "flash_ext: q has dtype ", dtype, "; expected float16 or bfloat16",
                  q.is_cuda() ? " on CUDA" : " (or float32 on the CPU)");
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"k_cache", &k_cache}, {"v_cache", &v_cache}}) {
    FLASH_EXT_CHECK(t->scalar_type() == dtype, "flash_ext: ", name, " has dtype ", t->scalar_type(), " but q has ",
                    dtype, "; q and the caches must share one dtype");
    FLASH_EXT_CHECK(t->device() == q.device(), "flash_ext: ", name, " is on ", t->device(), " but q is on ",
                    q.device());
  }
  const int64_t batch = q.size(0), head_dim = q.size(3), heads_q = q.size(2), heads_kv = k_cache.size(2);
  FLASH_EXT_CHECK(k_cache.size(3) == head_dim, "flash_ext: k_cache has head_dim ", k_cache.size(3),
                  " but q has head_dim ", head_dim, "; q and the caches must share head_dim");
  FLASH_EXT_CHECK(head_dim >= 1 && head_dim <= 256, "flash_ext: head_dim (last dimension of q) must be in 1..256, got ",
                  head_dim);
  FLASH_EXT_CHECK(heads_kv >= 1, "flash_ext: k_cache has 0 heads (k_cache.size(2)); heads_kv must be >= 1");
  FLASH_EXT_CHECK(heads_q % heads_kv == 0, "flash_ext: heads_q (q.size(2) = ", heads_q,
                  ") must be a multiple of heads_kv (k_cache.size(2) = ", heads_kv, ")");

  const bool paged = block_table.has_value();
  int64_t capacity = k_cache.size(1);  // the most keys one sequence can hold
  if (paged) {
    check_block_table(*block_table, batch, q, k_cache, "k_cache");
    FLASH_EXT_CHECK(!cache_batch_idx.has_value(),
                    "flash_ext: cache_batch_idx cannot be used with block_table (the block table already picks each "
                    "sequence's pages)");
    capacity = block_table->size(1) * k_cache.size(1);
  } else {
    FLASH_EXT_CHECK(cache_batch_idx.has_value() || k_cache.size(0) == batch, "flash_ext: k_cache has batch ",
                    k_cache.size(0), " but q has batch ", batch,
                    "; without block_table they must match (or pass cache_batch_idx to pick cache rows)");
  }

  FLASH_EXT_CHECK(k.has_value() == v.has_value(), "flash_ext: k and v (the new keys and values) must be given "
                                                  "together, got ",
                  k.has_value() ? "k without v" : "v without k");
  if (k.has_value()) {
    for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"k", &*k}, {"v", &*v}}) {
      FLASH_EXT_CHECK(t->dim() == 4 && t->size(0) == batch && t->size(2) == heads_kv && t->size(3) == head_dim,
                      "flash_ext: ", name, " must have shape (batch, seqlen_new, heads_kv, head_dim) = (", batch,
                      ", seqlen_new, ", heads_kv, ", ", head_dim, "), got ", t->sizes());
      FLASH_EXT_CHECK(t->scalar_type() == dtype, "flash_ext: ", name, " has dtype ", t->scalar_type(), " but q has ",
                      dtype);
      FLASH_EXT_CHECK(t->device() == q.device(), "flash_ext: ", name, " is on ", t->device(), " but q is on ",
                      q.device());
    }
    FLASH_EXT_CHECK(k->size(1) == v->size(1), "flash_ext: k and v must have the same shape, got ", k->sizes(), " and ",
                    v->sizes());
    FLASH_EXT_CHECK(k->size(1) <= capacity, "flash_ext: the cache is too short: k has seqlen_new = ", k->size(1),
                    " but a sequence of the cache holds at most ", capacity, " keys");
  }

  check_int32_per_sequence(cache_seqlens, "cache_seqlens", batch, q);
  check_int32_per_sequence(cache_batch_idx, "cache_batch_idx", batch, q);
  check_int32_per_sequence(cache_leftpad, "cache_leftpad", batch, q);

  FLASH_EXT_CHECK(rotary_cos.has_value() == rotary_sin.has_value(),
                  "flash_ext: rotary_cos and rotary_sin must be given together");
  if (rotary_cos.has_value()) {
    FLASH_EXT_CHECK(k.has_value(), "flash_ext: rotary_cos / rotary_sin need k and v: the rotary embedding is applied "
                                   "to the new keys appended to the cache (and to q)");
    for (const auto& [name, t] :
         {std::pair<const char*, const at::Tensor*>{"rotary_cos", &*rotary_cos}, {"rotary_sin", &*rotary_sin}}) {
      FLASH_EXT_CHECK(t->dim() == 2 && t->size(1) >= 1 && 2 * t->size(1) <= head_dim, "flash_ext: ", name,
                      " must have shape (seqlen_ro, rotary_dim / 2) with 2 <= rotary_dim <= head_dim = ", head_dim,
                      ", got ", t->sizes());
      FLASH_EXT_CHECK(t->scalar_type() == dtype, "flash_ext: ", name, " has dtype ", t->scalar_type(), " but q has ",
                      dtype);
      FLASH_EXT_CHECK(t->device() == q.device(), "flash_ext: ", name, " is on ", t->device(), " but q is on ",
                      q.device());
    }
    FLASH_EXT_CHECK(rotary_sin->sizes() == rotary_cos->sizes(),
                    "flash_ext: rotary_cos and rotary_sin must have the same shape, got ", rotary_cos->sizes(), " and ",
                    rotary_sin->sizes());
    FLASH_EXT_CHECK(rotary_cos->size(0) >= capacity, "flash_ext: rotary_cos has ", rotary_cos->size(0),
                    " rows (seqlen_ro) but a sequence of the cache holds up to ", capacity,
                    " keys; seqlen_ro must be at least that");
  }
  FLASH_EXT_CHECK(num_splits >= 0, "flash_ext: num_splits must be 0 (automatic) or >= 1, got ", num_splits);
}

// Rotary embedding of x (batch, seqlen, heads, head_dim) at positions[b][i] (a (batch, seqlen) integer tensor on x's device), computed in float32 and
// rounded to x's dtype: the first rotary_dim channels rotated as pairs (2i, 2i+1) when interleaved (GPT-J),
// (i, i + rotary_dim / 2) otherwise (GPT-NeoX); the other channels unchanged.
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                  bool interleaved) {
  const int64_t batch = x.size(0), seqlen = x.size(1), half = cos.size(1), rotary_dim = 2 * half;
  if (x.numel() == 0) return x;
  const at::Tensor index = positions.reshape({-1}).to(at::kLong);
  const at::Tensor c = cos.index_select(0, index).to(at::kFloat).view({batch, seqlen, 1, half});
  const at::Tensor s = sin.index_select(0, index).to(at::kFloat).view({batch, seqlen, 1, half});
  const at::Tensor xf = x.to(at::kFloat);
  at::Tensor rotated;
  if (interleaved) {
    const at::Tensor pairs = xf.narrow(-1, 0, rotary_dim).reshape({batch, seqlen, x.size(2), half, 2});
    const at::Tensor x0 = pairs.select(-1, 0), x1 = pairs.select(-1, 1);
    rotated = at::stack({x0.mul(c).sub(x1.mul(s)), x0.mul(s).add(x1.mul(c))}, -1).flatten(-2);
  } else {
    const at::Tensor x0 = xf.narrow(-1, 0, half), x1 = xf.narrow(-1, half, half);
    rotated = at::cat({x0.mul(c).sub(x1.mul(s)), x0.mul(s).add(x1.mul(c))}, -1);
  }
  if (rotary_dim < x.size(3)) rotated = at::cat({rotated, xf.narrow(-1, rotary_dim, x.size(3) - rotary_dim)}, -1);
  return rotated.to(x.scalar_type());
}

}  // namespace flash_ext
