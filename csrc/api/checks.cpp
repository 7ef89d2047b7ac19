#include "checks.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "../error_message.h"

namespace flash_ext {
namespace {

// The checks that do not depend on the layout (dense or packed): dtype, device, k/v shapes,
// head_dim and the GQA ratio. The last two dimensions are (heads, head_dim) in both layouts.
void check_qkv_common(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const auto dtype = q.scalar_type();
  const bool is_cuda = q.is_cuda();
  FLASH_EXT_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || (dtype == at::kFloat && !is_cuda),
                  "flash_ext: q has dtype ", dtype, "; expected float16 or bfloat16",
                  is_cuda ? " on CUDA" : " (or float32 on the CPU)");
  FLASH_EXT_CHECK(k.scalar_type() == dtype, "flash_ext: k has dtype ", k.scalar_type(), " but q has ", dtype,
                  "; q, k and v must share one dtype");
  FLASH_EXT_CHECK(v.scalar_type() == dtype, "flash_ext: v has dtype ", v.scalar_type(), " but q has ", dtype,
                  "; q, k and v must share one dtype");
  FLASH_EXT_CHECK(k.device() == q.device(), "flash_ext: k is on ", k.device(), " but q is on ", q.device(),
                  "; q, k and v must be on one device");
  FLASH_EXT_CHECK(v.device() == q.device(), "flash_ext: v is on ", v.device(), " but q is on ", q.device(),
                  "; q, k and v must be on one device");

  FLASH_EXT_CHECK(k.sizes() == v.sizes(), "flash_ext: k and v must have the same shape, got k ", k.sizes(), " and v ",
                  v.sizes());
  FLASH_EXT_CHECK(k.size(-1) == q.size(-1), "flash_ext: k has head_dim ", k.size(-1), " but q has head_dim ",
                  q.size(-1), "; q, k and v must share head_dim");
  const int64_t head_dim = q.size(-1);
  FLASH_EXT_CHECK(head_dim >= 1 && head_dim <= 256, "flash_ext: head_dim (last dimension of q) must be in 1..256, got ",
                  head_dim);
  const int64_t heads_q = q.size(-2), heads_kv = k.size(-2);
  // No heads at all is an empty problem (an empty result); k and v without heads for q's heads is not.
  FLASH_EXT_CHECK(heads_kv >= 1 || heads_q == 0, "flash_ext: k and v have 0 heads (k.size(", k.dim() - 2,
                  ")) but q has ", heads_q, "; heads_kv must be >= 1");
  FLASH_EXT_CHECK(heads_kv == 0 || heads_q % heads_kv == 0, "flash_ext: heads_q (q.size(", q.dim() - 2, ") = ",
                  heads_q, ") must be a multiple of heads_kv (k.size(", k.dim() - 2, ") = ", heads_kv, ")");
}

// cu_seqlens_q / cu_seqlens_k: what can be checked without reading the values (no device-to-host
// copy): int32, 1-D, batch + 1 entries, on q's device.
void check_cu_seqlens(const at::Tensor& cu_seqlens, const char* name, int64_t batch, const at::Tensor& q) {
  FLASH_EXT_CHECK(cu_seqlens.scalar_type() == at::kInt, "flash_ext: ", name, " must be int32, got ",
                  cu_seqlens.scalar_type());
  FLASH_EXT_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1, "flash_ext: ", name,
                  " must be 1-D with batch + 1 entries, got shape ", cu_seqlens.sizes());
  FLASH_EXT_CHECK(cu_seqlens.size(0) == batch + 1, "flash_ext: ", name, " has ", cu_seqlens.size(0),
                  " entries but cu_seqlens_q has ", batch + 1, "; both must have batch + 1 entries");
  FLASH_EXT_CHECK(cu_seqlens.device() == q.device(), "flash_ext: ", name, " is on ", cu_seqlens.device(),
                  " but q is on ", q.device());
}

// The values of a host-resident cu_seqlens: starts at 0, never decreases, ends at `total`, and no
// sequence is longer than max_seqlen (what a kernel sizes its grid by); total < 0 or max_seqlen < 0 leaves
// that check out (varlen_paged_fwd: a page pool has no total_k, seqused_k gives the lengths). On the CPU
// these reads are free. A CUDA path must not do them on the hot path: reading device memory from the host
// waits for the stream (a device-to-host sync); there the values are the caller's contract.
void check_cu_seqlens_values(const at::Tensor& cu_seqlens, const char* name, int64_t total, const char* total_name,
                             int64_t max_seqlen, const char* max_name) {
  const at::Tensor cu = cu_seqlens.contiguous();
  const int32_t* values = cu.data_ptr<int32_t>();
  const int64_t batch = cu.numel() - 1;
  FLASH_EXT_CHECK(values[0] == 0, "flash_ext: ", name, "[0] must be 0, got ", values[0]);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t length = static_cast<int64_t>(values[b + 1]) - values[b];
    FLASH_EXT_CHECK(length >= 0, "flash_ext: ", name, " must be non-decreasing, but ", name, "[", b + 1,
                    "] = ", values[b + 1], " < ", name, "[", b, "] = ", values[b]);
    FLASH_EXT_CHECK(max_seqlen < 0 || length <= max_seqlen, "flash_ext: sequence ", b, " has length ", length,
                    " (from ", name, ") but ", max_name, " is ", max_seqlen, "; ", max_name,
                    " must be at least the longest sequence");
  }
  FLASH_EXT_CHECK(total < 0 || values[batch] == total, "flash_ext: ", name, "[-1] must equal ", total_name, " = ",
                  total, ", got ", values[batch]);
}

void check_softmax_scale(double softmax_scale) {
  FLASH_EXT_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0,
                  "flash_ext: softmax_scale must be a finite positive number, got ", softmax_scale);
}

}  // namespace

// Dense batch: q (batch, seqlen_q, heads_q, head_dim), k and v (batch, seqlen_k, heads_kv, head_dim).
void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  FLASH_EXT_CHECK(q.dim() == 4, "flash_ext: q must have 4 dimensions (batch, seqlen_q, heads_q, head_dim), got ",
                  q.dim(), " (shape ", q.sizes(), ")");
  FLASH_EXT_CHECK(k.dim() == 4, "flash_ext: k must have 4 dimensions (batch, seqlen_k, heads_kv, head_dim), got ",
                  k.dim(), " (shape ", k.sizes(), ")");
  FLASH_EXT_CHECK(v.dim() == 4, "flash_ext: v must have 4 dimensions (batch, seqlen_k, heads_kv, head_dim), got ",
                  v.dim(), " (shape ", v.sizes(), ")");
  check_qkv_common(q, k, v);
  FLASH_EXT_CHECK(k.size(0) == q.size(0), "flash_ext: k has batch ", k.size(0), " but q has batch ", q.size(0));
  const int64_t heads_q = q.size(2);
  if (q.is_cuda()) {
    FLASH_EXT_CHECK(q.size(0) * std::max<int64_t>(1, heads_q) <= std::numeric_limits<int32_t>::max() &&
                        q.size(1) <= std::numeric_limits<int32_t>::max() &&
                        k.size(1) <= std::numeric_limits<int32_t>::max(),
                    "flash_ext: batch * heads and seqlens must each fit in int32");
  }
}

// Variable-length batch: q (total_q, heads_q, head_dim), k and v (total_k, heads_kv, head_dim).
static void check_qkv_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  FLASH_EXT_CHECK(q.dim() == 3,
                  "flash_ext: q must have 3 dimensions (total_q, heads_q, head_dim) for attention_varlen, got ",
                  q.dim(), " (shape ", q.sizes(), ")");
  FLASH_EXT_CHECK(k.dim() == 3,
                  "flash_ext: k must have 3 dimensions (total_k, heads_kv, head_dim) for attention_varlen, got ",
                  k.dim(), " (shape ", k.sizes(), ")");
  FLASH_EXT_CHECK(v.dim() == 3,
                  "flash_ext: v must have 3 dimensions (total_k, heads_kv, head_dim) for attention_varlen, got ",
                  v.dim(), " (shape ", v.sizes(), ")");
  check_qkv_common(q, k, v);
  FLASH_EXT_CHECK(q.size(0) <= std::numeric_limits<int32_t>::max() && k.size(0) <= std::numeric_limits<int32_t>::max(),
                  "flash_ext: total_q and total_k must fit in int32 (cu_seqlens are int32), got ", q.size(0), " and ",
                  k.size(0));
}

// The number of sequences, from cu_seqlens_q's size.
int64_t varlen_batch(const at::Tensor& cu_seqlens_q) {
  FLASH_EXT_CHECK(cu_seqlens_q.dim() == 1 && cu_seqlens_q.size(0) >= 1,
                  "flash_ext: cu_seqlens_q must be 1-D with batch + 1 entries, got shape ", cu_seqlens_q.sizes());
  return cu_seqlens_q.size(0) - 1;
}

// cu_seqlens and max_seqlen of a varlen call (no read of the values); returns the batch.
static int64_t check_varlen_layout(const at::Tensor& q, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                   int64_t max_seqlen_q, int64_t max_seqlen_k) {
  const int64_t batch = varlen_batch(cu_seqlens_q);
  check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", batch, q);
  check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", batch, q);
  const int64_t int_max = std::numeric_limits<int32_t>::max();
  FLASH_EXT_CHECK(max_seqlen_q >= 0 && max_seqlen_q <= int_max, "flash_ext: max_seqlen_q must be in 0..2^31-1, got ",
                  max_seqlen_q);
  FLASH_EXT_CHECK(max_seqlen_k >= 0 && max_seqlen_k <= int_max, "flash_ext: max_seqlen_k must be in 0..2^31-1, got ",
                  max_seqlen_k);
  return batch;
}

// Everything about a varlen call that needs no read of cu_seqlens' values.
void check_varlen_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                         const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  check_qkv_varlen(q, k, v);
  check_varlen_layout(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
}

void check_block_table(const at::Tensor& block_table, int64_t batch, const at::Tensor& q, const at::Tensor& pool,
                       const char* pool_name) {
  FLASH_EXT_CHECK(block_table.scalar_type() == at::kInt, "flash_ext: block_table must be int32, got ",
                  block_table.scalar_type());
  FLASH_EXT_CHECK(block_table.dim() == 2 && block_table.size(0) == batch,
                  "flash_ext: block_table must have shape (batch, max_blocks) with batch = ", batch, ", got ",
                  block_table.sizes());
  FLASH_EXT_CHECK(block_table.device() == q.device(), "flash_ext: block_table is on ", block_table.device(),
                  " but q is on ", q.device());
  FLASH_EXT_CHECK(pool.size(1) >= 1, "flash_ext: with block_table, ", pool_name,
                  ".size(1) is the page size and must be >= 1, got ", pool.size(1));
}

void check_int32_per_sequence(const std::optional<at::Tensor>& t, const char* name, int64_t batch,
                              const at::Tensor& q) {
  if (!t.has_value()) return;
  FLASH_EXT_CHECK(t->scalar_type() == at::kInt, "flash_ext: ", name, " must be int32, got ", t->scalar_type());
  FLASH_EXT_CHECK(t->dim() == 1 && t->size(0) == batch, "flash_ext: ", name, " must have shape (batch,) = (", batch,
                  ",), got ", t->sizes());
  FLASH_EXT_CHECK(t->device() == q.device(), "flash_ext: ", name, " is on ", t->device(), " but q is on ", q.device());
}

// Packed q (total_q, heads_q, head_dim) over page pools k and v (num_blocks, page_size, heads_kv, head_dim)
// when block_table is given, else the packed k and v of check_varlen_inputs.
void check_varlen_paged_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                               int64_t max_seqlen_k, const PagedArgs& paged) {
  int64_t batch;
  if (!paged.block_table.has_value()) {
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
    batch = varlen_batch(cu_seqlens_q);
  } else {
    FLASH_EXT_CHECK(q.dim() == 3,
                    "flash_ext: q must have 3 dimensions (total_q, heads_q, head_dim) for attention_varlen, got ",
                    q.dim(), " (shape ", q.sizes(), ")");
    FLASH_EXT_CHECK(k.dim() == 4,
                    "flash_ext: with block_table, k must be a page pool of 4 dimensions (num_blocks, page_size, "
                    "heads_kv, head_dim), got ",
                    k.dim(), " (shape ", k.sizes(), ")");
    FLASH_EXT_CHECK(v.dim() == 4,
                    "flash_ext: with block_table, v must be a page pool of 4 dimensions (num_blocks, page_size, "
                    "heads_kv, head_dim), got ",
                    v.dim(), " (shape ", v.sizes(), ")");
    check_qkv_common(q, k, v);
    FLASH_EXT_CHECK(q.size(0) <= std::numeric_limits<int32_t>::max(),
                    "flash_ext: total_q must fit in int32 (cu_seqlens are int32), got ", q.size(0));
    batch = check_varlen_layout(q, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
    const at::Tensor& block_table = *paged.block_table;
    check_block_table(block_table, batch, q, k, "k");
    // The CUDA path gathers the keys into a packed batch of batch * min(max_seqlen_k, max_blocks * page_size)
    // rows (varlen_keys_bound, packed_keys.h), which int32 cu_seqlens must address.
    const int64_t per_sequence = std::min(max_seqlen_k, block_table.size(1) * k.size(1));
    FLASH_EXT_CHECK(!q.is_cuda() || batch * per_sequence <= std::numeric_limits<int32_t>::max(),
                    "flash_ext: batch * min(max_seqlen_k, max_blocks * page_size) (the keys the CUDA path gathers) "
                    "must fit in int32, got ",
                    batch, " * ", per_sequence);
  }
  check_int32_per_sequence(paged.seqused_k, "seqused_k", batch, q);
}

// The value checks, for cu_seqlens in host memory (see check_cu_seqlens_values).
void check_varlen_values_on_host(const at::Tensor& q, const at::Tensor& k, const VarlenArgs& varlen) {
  check_cu_seqlens_values(*varlen.cu_seqlens_q, "cu_seqlens_q", q.size(0), "total_q (q.size(0))", varlen.max_seqlen_q,
                          "max_seqlen_q");
  check_cu_seqlens_values(*varlen.cu_seqlens_k, "cu_seqlens_k", k.size(0), "total_k (k.size(0))", varlen.max_seqlen_k,
                          "max_seqlen_k");
}

void check_varlen_paged_values_on_host(const at::Tensor& q, const at::Tensor& k, const VarlenArgs& varlen,
                                       const PagedArgs& paged) {
  const bool is_paged = paged.block_table.has_value(), has_used = paged.seqused_k.has_value();
  check_cu_seqlens_values(*varlen.cu_seqlens_q, "cu_seqlens_q", q.size(0), "total_q (q.size(0))", varlen.max_seqlen_q,
                          "max_seqlen_q");
  // A page pool has no total_k; with seqused_k the spans of cu_seqlens_k are storage, not the keys used.
  check_cu_seqlens_values(*varlen.cu_seqlens_k, "cu_seqlens_k", is_paged ? -1 : k.size(0), "total_k (k.size(0))",
                          has_used ? -1 : varlen.max_seqlen_k, "max_seqlen_k");
  const at::Tensor cu_k = varlen.cu_seqlens_k->contiguous();
  const at::Tensor used = has_used ? paged.seqused_k->contiguous() : at::Tensor();
  const at::Tensor table = is_paged ? paged.block_table->contiguous() : at::Tensor();
  const int64_t batch = cu_k.numel() - 1, page_size = is_paged ? k.size(1) : 0;
  const int64_t max_blocks = is_paged ? table.size(1) : 0, capacity = max_blocks * page_size;
  const int32_t* cu = cu_k.data_ptr<int32_t>();
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t span = static_cast<int64_t>(cu[b + 1]) - cu[b];
    int64_t length = span;
    if (has_used) {
      length = used.data_ptr<int32_t>()[b];
      const int64_t limit = is_paged ? capacity : span;
      FLASH_EXT_CHECK(length >= 0 && length <= limit, "flash_ext: seqused_k[", b, "] = ", length, " must be in 0..",
                      limit,
                      is_paged ? " (max_blocks * page_size, the keys a row of block_table holds)"
                               : " (the keys of sequence b in k: cu_seqlens_k[b + 1] - cu_seqlens_k[b])");
      FLASH_EXT_CHECK(length <= varlen.max_seqlen_k, "flash_ext: sequence ", b, " uses ", length,
                      " keys (seqused_k) but max_seqlen_k is ", varlen.max_seqlen_k,
                      "; max_seqlen_k must be at least the longest sequence");
    } else if (is_paged) {
      FLASH_EXT_CHECK(length <= capacity, "flash_ext: sequence ", b, " has ", length,
                      " keys (from cu_seqlens_k) but a row of block_table holds ", max_blocks, " pages of ", page_size,
                      " keys");
    }
    total += length;
    if (is_paged) {
      const int32_t* row = table.data_ptr<int32_t>() + b * max_blocks;
      for (int64_t page = 0; page * page_size < length; ++page)
        FLASH_EXT_CHECK(row[page] >= 0 && row[page] < k.size(0), "flash_ext: block_table[", b, "][", page, "] = ",
                        row[page], " is not a block of k (0..", k.size(0) - 1, ")");
    }
  }
  FLASH_EXT_CHECK(total <= std::numeric_limits<int32_t>::max(),
                  "flash_ext: the sequences use ", total, " keys in all (seqused_k); that must fit in int32");
}

// `batch`: the number of (dense or packed) sequences, which a (batch, heads_q) alibi_slopes must match.
void check_options(const AttentionOptions& o, const at::Tensor& q, int64_t batch) {
  check_softmax_scale(o.softmax_scale);
  const int64_t int_max = std::numeric_limits<int>::max();
  FLASH_EXT_CHECK(o.window_left >= -1 && o.window_left <= int_max,
                  "flash_ext: window_size[0] (keys left of the diagonal) must be -1 (unbounded) or >= 0, got ",
                  o.window_left);
  FLASH_EXT_CHECK(o.window_right >= -1 && o.window_right <= int_max,
                  "flash_ext: window_size[1] (keys right of the diagonal) must be -1 (unbounded) or >= 0, got ",
                  o.window_right);
  FLASH_EXT_CHECK(std::isfinite(o.softcap) && o.softcap >= 0,
                  "flash_ext: softcap must be 0 (off) or a finite positive number, got ", o.softcap);
  FLASH_EXT_CHECK(o.dropout_p >= 0 && o.dropout_p < 1, "flash_ext: dropout_p must be in [0, 1), got ", o.dropout_p);
  if (o.alibi_slopes.has_value()) {
    const at::Tensor& slopes = *o.alibi_slopes;
    const int64_t heads_q = q.size(-2);
    FLASH_EXT_CHECK(slopes.scalar_type() == at::kFloat, "flash_ext: alibi_slopes must be float32, got ",
                    slopes.scalar_type());
    FLASH_EXT_CHECK(slopes.device() == q.device(), "flash_ext: alibi_slopes is on ", slopes.device(), " but q is on ",
                    q.device());
    const bool per_head = slopes.dim() == 1 && slopes.size(0) == heads_q;
    const bool per_batch_and_head = slopes.dim() == 2 && slopes.size(0) == batch && slopes.size(1) == heads_q;
    FLASH_EXT_CHECK(per_head || per_batch_and_head, "flash_ext: alibi_slopes must have shape (heads_q,) = (", heads_q,
                    ",) or (batch, heads_q) = (", batch, ", ", heads_q, "), got ", slopes.sizes());
  }
}

// dout and out like q; lse float32 of `lse_shape` (named `lse_layout` in the message).
void check_bwd_tensors(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& out, const at::Tensor& lse,
                       at::IntArrayRef lse_shape, const char* lse_layout) {
  FLASH_EXT_CHECK(dout.sizes() == q.sizes() && dout.scalar_type() == q.scalar_type() && dout.device() == q.device(),
                  "flash_ext: dout must match q in shape, dtype and device, got ", dout.sizes(), " ",
                  dout.scalar_type(), " on ", dout.device());
  FLASH_EXT_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.device() == q.device(),
                  "flash_ext: out must match q in shape, dtype and device, got ", out.sizes(), " ", out.scalar_type(),
                  " on ", out.device());
  FLASH_EXT_CHECK(lse.scalar_type() == at::kFloat && lse.device() == q.device() && lse.sizes() == lse_shape,
                  "flash_ext: lse must be float32 of shape ", lse_layout, " on q's device, got ", lse.sizes(), " ",
                  lse.scalar_type(), " on ", lse.device());
}

}  // namespace flash_ext
