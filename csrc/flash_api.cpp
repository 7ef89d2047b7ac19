// The only translation unit that includes torch: op schema, input checks, params filling
// and dispatch to the CPU implementation and the CUDA kernels.
#include <Python.h>
#include <torch/library.h>
#include <torch/types.h>

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>

#include "common/dq_accum_layout.h"
#include "common/philox.h"
#include "cpu/attention_cpu.h"
#include "error_message.h"
#include "params.h"

#ifdef FLASH_EXT_WITH_CUDA
// c10/cuda only: ATen/cuda/CUDAContext.h would pull in cuSPARSE/cuBLAS headers that a plain
// CUDA toolkit install may lack.
// ATen/cuda/CUDAGeneratorImpl.h (the CUDA Philox generator) does not pull those in.
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "sm80/dispatch.h"
#include "sm90/dispatch.h"
#endif

namespace flash_ext {
namespace {

// ---------------------------------------------------------------------------------------
// Checks. Every message names the argument and says what was expected.

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
  FLASH_EXT_CHECK(heads_kv >= 1 && heads_q % heads_kv == 0, "flash_ext: heads_q (q.size(", q.dim() - 2, ") = ", heads_q,
                  ") must be a multiple of heads_kv (k.size(", k.dim() - 2, ") = ", heads_kv, ")");
}

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
void check_qkv_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
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
// sequence is longer than max_seqlen (what a kernel sizes its grid by). On the CPU these reads are
// free. A CUDA path must not do them on the hot path: reading device memory from the host waits
// for the stream (a device-to-host sync); there the values are the caller's contract.
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
    FLASH_EXT_CHECK(length <= max_seqlen, "flash_ext: sequence ", b, " has length ", length, " (from ", name, ") but ",
                    max_name, " is ", max_seqlen, "; ", max_name, " must be at least the longest sequence");
  }
  FLASH_EXT_CHECK(values[batch] == total, "flash_ext: ", name, "[-1] must equal ", total_name, " = ", total, ", got ",
                  values[batch]);
}

void check_softmax_scale(double softmax_scale) {
  FLASH_EXT_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0,
                  "flash_ext: softmax_scale must be a finite positive number, got ", softmax_scale);
}

// The arguments that choose what is computed, beyond q, k and v: shared by the dense and the
// variable-length ops, forward and backward.
struct AttentionOptions {
  double softmax_scale;
  bool causal;
  int64_t window_left;   // -1: unbounded
  int64_t window_right;  // -1: unbounded
  double softcap;        // 0: off
  const std::optional<at::Tensor>& alibi_slopes;
  double dropout_p;  // 0: off
};

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

// causal=True is the window's right side clamped to 0: no key past the diagonal.
int64_t effective_window_right(const AttentionOptions& o) { return o.causal ? 0 : o.window_right; }

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kHalf:
      return DType::kFloat16;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      FLASH_EXT_CHECK(false, "flash_ext: unsupported dtype ", t);
  }
}

// Dense (batch, seqlen, heads, head_dim), or packed (total, heads, head_dim) with no batch stride.
TensorStrides strides_of(const at::Tensor& t) {
  if (t.dim() == 3) return TensorStrides{0, t.stride(0), t.stride(1)};
  return TensorStrides{t.stride(0), t.stride(1), t.stride(2)};
}

// Kernels read rows with the last dimension contiguous; CUDA kernels also move 16 bytes at a
// time, so there every stride and the base pointer must be 16-byte aligned.
at::Tensor usable_layout(const at::Tensor& t) {
  bool ok = t.stride(-1) == 1 || t.size(-1) == 1;
  if (ok && t.is_cuda()) {
    const int64_t elems_per_16b = 16 / t.element_size();
    ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
    for (int d = 0; d < t.dim() - 1 && ok; ++d) ok = t.size(d) == 1 || t.stride(d) % elems_per_16b == 0;
  }
  // A last dim of size 1 may carry any stride; normalise so kernels can assume stride 1.
  if (ok && t.stride(-1) != 1) ok = false;
  // clone, not contiguous(): a contiguous view at a misaligned offset must be copied too.
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

// The Philox seed and offset of a call's dropout mask: drawn once per forward call and handed to
// the backward through the forward's rng_state output.
struct RngState {
  uint64_t seed = 0;
  uint64_t offset = 0;
};

// A fresh (seed, offset) from torch's default generator of `device`, so that torch.manual_seed
// reproduces a run (the CPU path; CUDA: set_cuda_dropout_state).
RngState draw_rng_state(const at::Device& device) {
  FLASH_EXT_CHECK(device.is_cpu(), "flash_ext: dropout on ", device, " is not supported");
  auto* generator =
      at::get_generator_or_default<at::CPUGeneratorImpl>(std::nullopt, at::detail::getDefaultCPUGenerator());
  std::lock_guard<std::mutex> lock(generator->mutex_);
  // The CPU generator (mt19937) has no Philox offset of its own: a fresh seed per call, offset 0.
  return {generator->random64(), 0};
}

// rng_state, the forward's third output: int64 [seed, offset] (the seed's 64 bits reinterpreted),
// zeros when dropout is off.
at::Tensor rng_state_tensor(const RngState& rng, const at::Tensor& q) {
  at::Tensor state = at::empty({2}, q.options().dtype(at::kLong));
  state.data_ptr<int64_t>()[0] = static_cast<int64_t>(rng.seed);
  state.data_ptr<int64_t>()[1] = static_cast<int64_t>(rng.offset);
  return state;
}

// An rng_state tensor back to (seed, offset). (A device tensor is copied to the host: a sync, but
// only where dropout is on; the CUDA kernels will read it on the device instead.)
RngState rng_state_values(const at::Tensor& rng_state) {
  FLASH_EXT_CHECK(rng_state.scalar_type() == at::kLong && rng_state.numel() == 2,
                  "flash_ext: rng_state must be int64 [seed, offset] (2 elements), got ", rng_state.scalar_type(),
                  " of shape ", rng_state.sizes());
  const at::Tensor state = rng_state.cpu().contiguous();
  return {static_cast<uint64_t>(state.data_ptr<int64_t>()[0]), static_cast<uint64_t>(state.data_ptr<int64_t>()[1])};
}

// The backward's rng_state argument; required when dropout is on, ignored otherwise.
RngState read_rng_state(const std::optional<at::Tensor>& rng_state, double dropout_p) {
  if (dropout_p == 0) return {};
  FLASH_EXT_CHECK(rng_state.has_value(),
                  "flash_ext: the backward with dropout_p > 0 needs rng_state, the forward's third output");
  return rng_state_values(*rng_state);
}

// Copies the options into p (checked by check_options). `alibi_slopes` must outlive p.
void set_options(FwdParams& p, const AttentionOptions& o, const std::optional<at::Tensor>& alibi_slopes,
                 const RngState& rng) {
  p.softmax_scale = static_cast<float>(o.softmax_scale);
  p.scale_log2 = static_cast<float>(o.softmax_scale * M_LOG2E);
  p.window_left = static_cast<int>(o.window_left);
  p.window_right = static_cast<int>(effective_window_right(o));
  p.softcap = static_cast<float>(o.softcap);
  p.fwd_score_scale = static_cast<float>(o.softcap > 0 ? o.softcap : o.softmax_scale);
  p.fwd_score_scale_log2 = static_cast<float>((o.softcap > 0 ? o.softcap : o.softmax_scale) * M_LOG2E);
  if (alibi_slopes.has_value()) {
    p.alibi_slopes = alibi_slopes->data_ptr<float>();
    p.alibi_slopes_batch_stride = alibi_slopes->dim() == 2 ? alibi_slopes->stride(0) : 0;
  }
  p.dropout_p = static_cast<float>(o.dropout_p);
  p.dropout_scale = static_cast<float>(1.0 / (1.0 - o.dropout_p));
  p.dropout_threshold = dropout_drop_threshold(o.dropout_p);
  p.philox_seed = rng.seed;
  p.philox_offset = rng.offset;
}

// alibi_slopes with a contiguous head dimension (what params.h's alibi_slope indexing assumes).
std::optional<at::Tensor> usable_alibi_slopes(const std::optional<at::Tensor>& alibi_slopes) {
  if (!alibi_slopes.has_value()) return std::nullopt;
  return alibi_slopes->stride(-1) == 1 ? *alibi_slopes : alibi_slopes->contiguous();
}

// The tensor pointers and strides every FwdParams carries (dense or packed layouts alike).
FwdParams params_with_tensors(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                              const at::Tensor& lse) {
  FwdParams p;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  p.q_strides = strides_of(q);
  p.k_strides = strides_of(k);
  p.v_strides = strides_of(v);
  p.out_strides = strides_of(out);
  p.dtype = to_dtype(q.scalar_type());
  p.head_dim = static_cast<int>(q.size(-1));
  p.heads_q = static_cast<int>(q.size(-2));
  p.heads_kv = static_cast<int>(k.size(-2));
  return p;
}

FwdParams make_fwd_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                          const at::Tensor& lse, double softmax_scale, bool causal) {
  FwdParams p = params_with_tensors(q, k, v, out, lse);
  p.batch = static_cast<int>(q.size(0));
  p.seqlen_q = static_cast<int>(q.size(1));
  p.seqlen_k = static_cast<int>(k.size(1));
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.scale_log2 = static_cast<float>(softmax_scale * M_LOG2E);
  p.window_right = causal ? 0 : FwdParams::kUnbounded;
  p.lse_batch_stride = p.heads_q * static_cast<int64_t>(p.seqlen_q);
  p.lse_head_stride = p.seqlen_q;
  return p;
}

// Packed q (total_q, heads_q, head_dim), k and v (total_k, heads_kv, head_dim), lse (heads_q, total_q).
FwdParams make_varlen_fwd_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                 const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
                                 int64_t max_seqlen_q, int64_t max_seqlen_k) {
  FwdParams p = params_with_tensors(q, k, v, out, lse);
  p.batch = static_cast<int>(cu_seqlens_q.size(0) - 1);
  p.seqlen_q = static_cast<int>(max_seqlen_q);
  p.seqlen_k = static_cast<int>(max_seqlen_k);
  p.cu_seqlens_q = cu_seqlens_q.data_ptr<int32_t>();
  p.cu_seqlens_k = cu_seqlens_k.data_ptr<int32_t>();
  p.lse_batch_stride = 0;
  p.lse_head_stride = q.size(0);
  p.total_q = q.size(0);
  p.total_k = k.size(0);
  return p;
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

void check_bwd_inputs(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& out, const at::Tensor& lse, double softmax_scale) {
  check_qkv(q, k, v);
  check_softmax_scale(softmax_scale);
  check_bwd_tensors(dout, q, out, lse, {q.size(0), q.size(2), q.size(1)}, "(batch, heads_q, seqlen_q)");
}

BwdParams bwd_params_from(const FwdParams& fwd, const at::Tensor& dout, const at::Tensor& dq, const at::Tensor& dk,
                          const at::Tensor& dv, bool deterministic) {
  BwdParams p;
  static_cast<FwdParams&>(p) = fwd;
  p.dout = dout.data_ptr();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dout_strides = strides_of(dout);
  p.dq_strides = strides_of(dq);
  p.dk_strides = strides_of(dk);
  p.dv_strides = strides_of(dv);
  p.deterministic = deterministic;
  return p;
}

BwdParams make_bwd_params(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dq, const at::Tensor& dk,
                          const at::Tensor& dv, double softmax_scale, bool causal, bool deterministic) {
  return bwd_params_from(make_fwd_params(q, k, v, out, lse, softmax_scale, causal), dout, dq, dk, dv, deterministic);
}

// ---- Variable-length batches: checks ----

// The number of sequences, from cu_seqlens_q's size.
int64_t varlen_batch(const at::Tensor& cu_seqlens_q) {
  FLASH_EXT_CHECK(cu_seqlens_q.dim() == 1 && cu_seqlens_q.size(0) >= 1,
                  "flash_ext: cu_seqlens_q must be 1-D with batch + 1 entries, got shape ", cu_seqlens_q.sizes());
  return cu_seqlens_q.size(0) - 1;
}

// Everything about a varlen call that needs no read of cu_seqlens' values.
void check_varlen_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                         const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  check_qkv_varlen(q, k, v);
  const int64_t batch = varlen_batch(cu_seqlens_q);
  check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q", batch, q);
  check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k", batch, q);
  const int64_t int_max = std::numeric_limits<int32_t>::max();
  FLASH_EXT_CHECK(max_seqlen_q >= 0 && max_seqlen_q <= int_max, "flash_ext: max_seqlen_q must be in 0..2^31-1, got ",
                  max_seqlen_q);
  FLASH_EXT_CHECK(max_seqlen_k >= 0 && max_seqlen_k <= int_max, "flash_ext: max_seqlen_k must be in 0..2^31-1, got ",
                  max_seqlen_k);
}

// The value checks, for cu_seqlens in host memory (see check_cu_seqlens_values).
void check_varlen_values_on_host(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cu_seqlens_q,
                                 const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k) {
  check_cu_seqlens_values(cu_seqlens_q, "cu_seqlens_q", q.size(0), "total_q (q.size(0))", max_seqlen_q, "max_seqlen_q");
  check_cu_seqlens_values(cu_seqlens_k, "cu_seqlens_k", k.size(0), "total_k (k.size(0))", max_seqlen_k, "max_seqlen_k");
}

// ---------------------------------------------------------------------------------------
// CPU

// `deterministic` only travels to the backward (through autograd's saved inputs).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                                       const at::Tensor& v_in, double softmax_scale, bool causal,
                                                       bool /*deterministic*/, int64_t window_left,
                                                       int64_t window_right, double softcap,
                                                       const std::optional<at::Tensor>& alibi_slopes_in,
                                                       double dropout_p) {
  check_qkv(q_in, k_in, v_in);
  const AttentionOptions options{softmax_scale, causal, window_left, window_right, softcap, alibi_slopes_in, dropout_p};
  check_options(options, q_in, q_in.size(0));
  const at::Tensor q = usable_layout(q_in), k = usable_layout(k_in), v = usable_layout(v_in);
  const std::optional<at::Tensor> alibi_slopes = usable_alibi_slopes(alibi_slopes_in);
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  // Every call with dropout draws from the generator once, whatever the shapes.
  const RngState rng = dropout_p > 0 ? draw_rng_state(q.device()) : RngState{};
  at::Tensor rng_state = rng_state_tensor(rng, q);
  if (out.numel() == 0) return {out, lse, rng_state};
  FwdParams p = make_fwd_params(q, k, v, out, lse, softmax_scale, causal);
  set_options(p, options, alibi_slopes, rng);
  cpu::attention_fwd(p);
  return {out, lse, rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cpu(const at::Tensor& dout_in, const at::Tensor& q_in,
                                                       const at::Tensor& k_in, const at::Tensor& v_in,
                                                       const at::Tensor& out_in, const at::Tensor& lse,
                                                       double softmax_scale, bool causal, bool deterministic,
                                                       int64_t window_left, int64_t window_right, double softcap,
                                                       const std::optional<at::Tensor>& alibi_slopes_in,
                                                       double dropout_p, const std::optional<at::Tensor>& rng_state) {
  check_bwd_inputs(dout_in, q_in, k_in, v_in, out_in, lse, softmax_scale);
  const AttentionOptions options{softmax_scale, causal, window_left, window_right, softcap, alibi_slopes_in, dropout_p};
  check_options(options, q_in, q_in.size(0));
  const RngState rng = read_rng_state(rng_state, dropout_p);
  const at::Tensor q = usable_layout(q_in), k = usable_layout(k_in), v = usable_layout(v_in);
  const at::Tensor dout = usable_layout(dout_in), out = usable_layout(out_in), lse_c = lse.contiguous();
  const std::optional<at::Tensor> alibi_slopes = usable_alibi_slopes(alibi_slopes_in);
  // Zeros, not empty: with seqlen_q == 0 (or seqlen_k == 0) the gradients are exactly zero.
  at::Tensor dq = at::zeros(q.sizes(), q.options());
  at::Tensor dk = at::zeros(k.sizes(), k.options());
  at::Tensor dv = at::zeros(v.sizes(), v.options());
  if (q.numel() == 0 || k.numel() == 0) return {dq, dk, dv};
  // The CPU backward is always deterministic (two passes, no shared accumulators).
  BwdParams p = make_bwd_params(dout, q, k, v, out, lse_c, dq, dk, dv, softmax_scale, causal, deterministic);
  set_options(p, options, alibi_slopes, rng);
  cpu::attention_bwd(p);
  return {dq, dk, dv};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_fwd_cpu(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal,
    bool /*deterministic*/, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes_in, double dropout_p) {
  check_varlen_inputs(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  const AttentionOptions options{softmax_scale, causal, window_left, window_right, softcap, alibi_slopes_in, dropout_p};
  check_options(options, q_in, varlen_batch(cu_seqlens_q));
  check_varlen_values_on_host(q_in, k_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  const at::Tensor q = usable_layout(q_in), k = usable_layout(k_in), v = usable_layout(v_in);
  const at::Tensor cu_q = cu_seqlens_q.contiguous(), cu_k = cu_seqlens_k.contiguous();
  const std::optional<at::Tensor> alibi_slopes = usable_alibi_slopes(alibi_slopes_in);
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat));
  const RngState rng = dropout_p > 0 ? draw_rng_state(q.device()) : RngState{};
  at::Tensor rng_state = rng_state_tensor(rng, q);
  if (out.numel() == 0) return {out, lse, rng_state};
  FwdParams p = make_varlen_fwd_params(q, k, v, out, lse, cu_q, cu_k, max_seqlen_q, max_seqlen_k);
  set_options(p, options, alibi_slopes, rng);
  cpu::attention_fwd(p);
  return {out, lse, rng_state};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_cpu(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out_in, const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal, bool deterministic,
    int64_t window_left, int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes_in,
    double dropout_p, const std::optional<at::Tensor>& rng_state) {
  check_varlen_inputs(q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  check_bwd_tensors(dout_in, q_in, out_in, lse, {q_in.size(1), q_in.size(0)}, "(heads_q, total_q)");
  const AttentionOptions options{softmax_scale, causal, window_left, window_right, softcap, alibi_slopes_in, dropout_p};
  check_options(options, q_in, varlen_batch(cu_seqlens_q));
  check_varlen_values_on_host(q_in, k_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  const RngState rng = read_rng_state(rng_state, dropout_p);
  const at::Tensor q = usable_layout(q_in), k = usable_layout(k_in), v = usable_layout(v_in);
  const at::Tensor dout = usable_layout(dout_in), out = usable_layout(out_in), lse_c = lse.contiguous();
  const at::Tensor cu_q = cu_seqlens_q.contiguous(), cu_k = cu_seqlens_k.contiguous();
  const std::optional<at::Tensor> alibi_slopes = usable_alibi_slopes(alibi_slopes_in);
  at::Tensor dq = at::zeros(q.sizes(), q.options());
  at::Tensor dk = at::zeros(k.sizes(), k.options());
  at::Tensor dv = at::zeros(v.sizes(), v.options());
  if (q.numel() == 0 || k.numel() == 0) return {dq, dk, dv};
  BwdParams p = bwd_params_from(make_varlen_fwd_params(q, k, v, out, lse_c, cu_q, cu_k, max_seqlen_q, max_seqlen_k),
                                dout, dq, dk, dv, deterministic);
  set_options(p, options, alibi_slopes, rng);
  cpu::attention_bwd(p);
  return {dq, dk, dv};
}

// flash_ext.testing.dropout_keep_mask: the (batch, heads, seqlen_q, seqlen_k) keep mask (true =
// kept) that a forward with this rng_state and dropout_p applies, from the same Philox function.
at::Tensor dropout_keep_mask_cpu(const at::Tensor& rng_state, int64_t batch, int64_t heads, int64_t seqlen_q,
                                 int64_t seqlen_k, double dropout_p) {
  FLASH_EXT_CHECK(batch >= 0 && heads >= 0 && seqlen_q >= 0 && seqlen_k >= 0,
                  "flash_ext: dropout_keep_mask sizes must be >= 0, got ", batch, ", ", heads, ", ", seqlen_q, ", ",
                  seqlen_k);
  FLASH_EXT_CHECK(dropout_p >= 0 && dropout_p < 1, "flash_ext: dropout_p must be in [0, 1), got ", dropout_p);
  const RngState rng = rng_state_values(rng_state);
  at::Tensor mask = at::empty({batch, heads, seqlen_q, seqlen_k}, rng_state.options().dtype(at::kBool));
  static_assert(sizeof(bool) == sizeof(uint8_t));
  cpu::dropout_keep_mask(rng.seed, rng.offset, dropout_drop_threshold(dropout_p), batch, heads, seqlen_q, seqlen_k,
                         reinterpret_cast<uint8_t*>(mask.data_ptr<bool>()));
  return mask;
}

// ---------------------------------------------------------------------------------------
// CUDA

#ifdef FLASH_EXT_WITH_CUDA

// The kernels support head dims that are multiples of 32 up to 256; others are zero-padded
// (zeros add nothing to q.k, and the padded output columns are sliced off).
int64_t padded_head_dim(int64_t head_dim) { return std::max<int64_t>(32, (head_dim + 31) / 32 * 32); }

at::Tensor pad_head_dim(const at::Tensor& t, int64_t head_dim_padded) {
  if (t.size(-1) == head_dim_padded) return t;
  return at::constant_pad_nd(t, {0, head_dim_padded - t.size(-1)}, 0);
}

at::Tensor unpad_head_dim(const at::Tensor& t, int64_t head_dim) {
  return t.size(-1) == head_dim ? t : t.narrow(-1, 0, head_dim).contiguous();
}

// Dropout on CUDA: the Philox seed and offset come from torch's CUDA generator of the current
// device (torch.manual_seed reproduces a run). philox_cuda_state reserves `increment` offsets per
// call: batch * heads_q streams (common/philox.h's mapping), rounded up to a multiple of 4 as the
// generator requires. Under CUDA-graph capture the values live on the device (they change per
// replay): the kernels read them there and the forward kernel writes them to rng_state.
void set_cuda_dropout_state(FwdParams& p, at::Tensor& rng_state) {
  auto* generator = at::get_generator_or_default<at::CUDAGeneratorImpl>(std::nullopt,
                                                                       at::cuda::detail::getDefaultCUDAGenerator());
  const uint64_t increment = (static_cast<uint64_t>(p.batch) * p.heads_q + 3) / 4 * 4;
  at::PhiloxCudaState state;
  {
    std::lock_guard<std::mutex> lock(generator->mutex_);
    state = generator->philox_cuda_state(increment);
  }
  if (state.captured_) {
    p.philox_seed_ptr = state.seed_.ptr;
    p.philox_offset_ptr = state.offset_.ptr;
    p.philox_offset_intragraph = state.offset_intragraph_;
  } else {
    p.philox_seed = state.seed_.val;
    p.philox_offset = state.offset_.val;
  }
  p.rng_state_out = rng_state.data_ptr<int64_t>();
}

// The backward reads the forward's rng_state on the device (no device-to-host copy).
void set_cuda_dropout_state_from(BwdParams& p, const std::optional<at::Tensor>& rng_state, const at::Tensor& q,
                                 at::Tensor& rng_state_on_device) {
  FLASH_EXT_CHECK(rng_state.has_value(),
                  "flash_ext: the backward with dropout_p > 0 needs rng_state, the forward's third output");
  FLASH_EXT_CHECK(rng_state->scalar_type() == at::kLong && rng_state->numel() == 2,
                  "flash_ext: rng_state must be int64 [seed, offset] (2 elements), got ", rng_state->scalar_type(),
                  " of shape ", rng_state->sizes());
  rng_state_on_device = rng_state->to(q.device()).contiguous();
  p.philox_seed_ptr = rng_state_on_device.data_ptr<int64_t>();
  p.philox_offset_ptr = p.philox_seed_ptr + 1;
  p.philox_offset_intragraph = 0;
}

void check_sm80(const at::Tensor& q) {
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.device().index()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, q.device().index()));
  FLASH_EXT_CHECK(major >= 8, "flash_ext: the CUDA kernels need compute capability 8.0 or newer (Ampere+); device ",
                  q.device(), " is ", major, ".", minor);
}

// What the CUDA forward and backward both make of q, k, v before a launch: head_dim padded to a
// multiple of 32 (zero columns) and every tensor in a layout the kernels take (see usable_layout).
struct CudaQkv {
  int64_t head_dim;         // the caller's
  int64_t head_dim_padded;  // the kernels'
  at::Tensor q, k, v;
  std::optional<at::Tensor> alibi_slopes;
};

// Callers hold a CUDAGuard for q's device.
CudaQkv prepare_cuda_qkv(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                         const AttentionOptions& options) {
  check_sm80(q_in);
  const int64_t head_dim = q_in.size(-1);
  const int64_t head_dim_padded = padded_head_dim(head_dim);
  return {head_dim,
          head_dim_padded,
          usable_layout(pad_head_dim(q_in, head_dim_padded)),
          usable_layout(pad_head_dim(k_in, head_dim_padded)),
          usable_layout(pad_head_dim(v_in, head_dim_padded)),
          usable_alibi_slopes(options.alibi_slopes)};
}

// cu_seqlens of a varlen call (nullptr tensors for a dense call).
struct VarlenArgs {
  const at::Tensor* cu_seqlens_q = nullptr;
  const at::Tensor* cu_seqlens_k = nullptr;
  int64_t max_seqlen_q = 0;
  int64_t max_seqlen_k = 0;
  bool is_varlen() const { return cu_seqlens_q != nullptr; }
};

// The forward on CUDA, dense (q (batch, seqlen_q, heads_q, d)) or varlen (q (total_q, heads_q, d)).
std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_cuda_impl(const at::Tensor& q_in, const at::Tensor& k_in,
                                                             const at::Tensor& v_in, const AttentionOptions& options,
                                                             const VarlenArgs& varlen) {
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  const CudaQkv qkv = prepare_cuda_qkv(q_in, k_in, v_in, options);
  const int64_t head_dim = qkv.head_dim, head_dim_padded = qkv.head_dim_padded;
  const at::Tensor &q = qkv.q, &k = qkv.k, &v = qkv.v;
  const std::optional<at::Tensor>& alibi_slopes = qkv.alibi_slopes;

  at::Tensor out_padded = at::empty(q.sizes(), q.options());
  // lse: (batch, heads_q, seqlen_q) dense, (heads_q, total_q) varlen.
  at::Tensor lse = varlen.is_varlen() ? at::empty({q.size(1), q.size(0)}, q.options().dtype(at::kFloat))
                                      : at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  // [seed, offset] of the dropout mask, written by the forward kernel (zeros without dropout). Zeroed by a
  // memset: at::zeros costs a fill kernel's host-side setup, ~15 us of a ~45 us call at small shapes
  // (H200 host, torch.profiler).
  at::Tensor rng_state = at::empty({2}, q.options().dtype(at::kLong));
  C10_CUDA_CHECK(
      cudaMemsetAsync(rng_state.data_ptr(), 0, 2 * sizeof(int64_t), c10::cuda::getCurrentCUDAStream().stream()));
  auto result = [&]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor> {
    return {unpad_head_dim(out_padded, head_dim), lse, rng_state};
  };
  if (out_padded.numel() == 0) return result();
  if (k.numel() == 0) {  // no keys at all: every row is empty
    out_padded.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return result();
  }

  FwdParams p = varlen.is_varlen()
                    ? make_varlen_fwd_params(q, k, v, out_padded, lse, *varlen.cu_seqlens_q, *varlen.cu_seqlens_k,
                                             varlen.max_seqlen_q, varlen.max_seqlen_k)
                    : make_fwd_params(q, k, v, out_padded, lse, options.softmax_scale, options.causal);
  set_options(p, options, alibi_slopes, RngState{});
  p.head_dim = static_cast<int>(head_dim_padded);
  if (p.seqlen_q == 0) return result();  // varlen with every sequence empty of queries
  if (options.dropout_p > 0) set_cuda_dropout_state(p, rng_state);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  if (!sm90::try_run_attention_fwd(p, stream)) sm80::run_attention_fwd_dispatch(p, stream);
  return result();
}

// FLASH_EXT_DEBUG_POISON_SCRATCH=1: the backward's fp32 dQ accumulator is filled with NaN before use (a test
// aid: read on every call, so a test may set it at any time).
bool debug_poison_scratch() {
  const char* value = std::getenv("FLASH_EXT_DEBUG_POISON_SCRATCH");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

// The backward on CUDA, dense or varlen (shapes as in fwd_cuda_impl).
std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda_impl(const at::Tensor& dout_in, const at::Tensor& q_in,
                                                             const at::Tensor& k_in, const at::Tensor& v_in,
                                                             const at::Tensor& out_in, const at::Tensor& lse,
                                                             const AttentionOptions& options, bool deterministic,
                                                             const std::optional<at::Tensor>& rng_state,
                                                             const VarlenArgs& varlen) {
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  const CudaQkv qkv = prepare_cuda_qkv(q_in, k_in, v_in, options);
  const int64_t head_dim = qkv.head_dim, head_dim_padded = qkv.head_dim_padded;
  const at::Tensor &q = qkv.q, &k = qkv.k, &v = qkv.v;
  const std::optional<at::Tensor>& alibi_slopes = qkv.alibi_slopes;
  const at::Tensor out = usable_layout(pad_head_dim(out_in, head_dim_padded));
  const at::Tensor dout = usable_layout(pad_head_dim(dout_in, head_dim_padded));
  const at::Tensor lse_c = lse.contiguous();

  // Every row is written by the kernels (keys that no query sees get dk = dv = 0 there).
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  auto result = [&]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor> {
    return {unpad_head_dim(dq, head_dim), unpad_head_dim(dk, head_dim), unpad_head_dim(dv, head_dim)};
  };
  if (q.numel() == 0 || k.numel() == 0) {  // no query or no key: the gradients are exactly zero
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return result();
  }
  // Scratch, O(seqlen): D = rowsum(dout * out) per query row (fp32, lse's layout), and unless
  // deterministic the fp32 dQ accumulator that the dK/dV kernel adds into with atomics (per head: q's
  // rows, up to 8 rows of padding per sequence and 128 after the last, times head dim; tiled as
  // common/dq_accum_layout.h says); the backward launcher zeroes it (a memset).
  at::Tensor softmax_d = at::empty(lse_c.sizes(), q.options().dtype(at::kFloat));
  // With it, lse * log2(e) and D again in the accumulator's row numbering (params.h, row_stats: what the
  // sm90 dK/dV kernel reads).
  at::Tensor dq_accum, row_stats;
  int64_t dq_accum_rows = 0;
  if (!deterministic) {
    const int64_t query_rows = varlen.is_varlen() ? q.size(0) : q.size(0) * q.size(1);
    const int64_t sequences = varlen.is_varlen() ? varlen.cu_seqlens_q->size(0) - 1 : q.size(0);
    dq_accum_rows = DqAccumLayout::rows_for(query_rows, sequences);
    // Followed by the sm90 dK/dV kernel's per-(batch, kv head) counters of finished walks and its tile
    // counter (params.h, dkdv_finished and dkdv_tile_counter; one per 128-byte line, kFinishedCounterStride),
    // so that one memset zeroes them all.
    const int64_t accum_floats = q.size(-2) * dq_accum_rows * q.size(-1);
    const int64_t counter_ints = (sequences * k.size(-2) + 1) * kFinishedCounterStride;
    dq_accum = at::empty({accum_floats + counter_ints}, q.options().dtype(at::kFloat));
    // FLASH_EXT_DEBUG_POISON_SCRATCH=1 (the tests set it: tests/conftest.py) fills it with NaN first, so that
    // a row the backward's zeroing missed (the preprocess kernel's) shows in dq rather than passing on a
    // fresh allocation's zeros.
    if (debug_poison_scratch()) dq_accum.fill_(std::numeric_limits<float>::quiet_NaN());
    row_stats = at::empty({2, q.size(-2), dq_accum_rows}, q.options().dtype(at::kFloat));
  }

  const FwdParams fwd = varlen.is_varlen()
                            ? make_varlen_fwd_params(q, k, v, out, lse_c, *varlen.cu_seqlens_q, *varlen.cu_seqlens_k,
                                                     varlen.max_seqlen_q, varlen.max_seqlen_k)
                            : make_fwd_params(q, k, v, out, lse_c, options.softmax_scale, options.causal);
  BwdParams p = bwd_params_from(fwd, dout, dq, dk, dv, deterministic);
  set_options(p, options, alibi_slopes, RngState{});
  p.head_dim = static_cast<int>(head_dim_padded);
  p.softmax_d = softmax_d.data_ptr<float>();
  if (!deterministic) {
    p.dq_accum = dq_accum.data_ptr<float>();
    p.dq_accum_rows = dq_accum_rows;
    p.dkdv_finished = reinterpret_cast<int*>(p.dq_accum + q.size(-2) * dq_accum_rows * q.size(-1));
    p.dkdv_tile_counter = p.dkdv_finished + int64_t{p.batch} * p.heads_kv * kFinishedCounterStride;
    p.row_stats = row_stats.data_ptr<float>();
  }
  // Scratch for the dK/dV kernel's split tail walks (params.h, TailSplit), where a split may happen (plain
  // attention over every key, atomics allowed): fp32 dK and dV of up to one walk per SM (a walk covers 64
  // or 128 keys; fewer walks than SMs where the problem has fewer), independent of seqlen: at most
  // SMs x 2 x 128 x head_dim floats (17 MiB at head_dim 128 on an H200). The launcher zeroes what it uses.
  at::Tensor dkv_accum;
  const bool plain_full_band = !varlen.is_varlen() && p.window_left == FwdParams::kUnbounded &&
                               p.window_right == FwdParams::kUnbounded && p.softcap == 0.f &&
                               p.alibi_slopes == nullptr && !(options.dropout_p > 0);
  if (!deterministic && plain_full_band) {
    int num_sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, q.get_device()));
    const int64_t max_walks = (int64_t{p.seqlen_k} + 63) / 64 * p.heads_kv * p.batch;
    p.dkv_accum_floats = std::min<int64_t>(num_sms, max_walks) * 2 * 128 * head_dim_padded;
    dkv_accum = at::empty({p.dkv_accum_floats}, q.options().dtype(at::kFloat));
    p.dkv_accum = dkv_accum.data_ptr<float>();
  }
  if (p.seqlen_q == 0 || p.seqlen_k == 0) return result();
  at::Tensor rng_state_on_device;
  if (options.dropout_p > 0) set_cuda_dropout_state_from(p, rng_state, q, rng_state_on_device);
  sm80::run_attention_bwd_dispatch(p, c10::cuda::getCurrentCUDAStream().stream());
  return result();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                        double softmax_scale, bool causal, bool /*deterministic*/,
                                                        int64_t window_left, int64_t window_right, double softcap,
                                                        const std::optional<at::Tensor>& alibi_slopes,
                                                        double dropout_p) {
  check_qkv(q, k, v);
  const AttentionOptions options{softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p};
  check_options(options, q, q.size(0));
  return fwd_cuda_impl(q, k, v, options, VarlenArgs{});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(const at::Tensor& dout, const at::Tensor& q,
                                                        const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                                                        const at::Tensor& lse, double softmax_scale, bool causal,
                                                        bool deterministic, int64_t window_left, int64_t window_right,
                                                        double softcap, const std::optional<at::Tensor>& alibi_slopes,
                                                        double dropout_p,
                                                        const std::optional<at::Tensor>& rng_state) {
  check_bwd_inputs(dout, q, k, v, out, lse, softmax_scale);
  const AttentionOptions options{softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p};
  check_options(options, q, q.size(0));
  return bwd_cuda_impl(dout, q, k, v, out, lse, options, deterministic, rng_state, VarlenArgs{});
}

// cu_seqlens' values are not read on the host here (that would wait for the stream): their
// monotonicity, first and last values and max_seqlen_* bounds are the caller's contract on CUDA
// (checked on the CPU path). The kernels read them on the device.
std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale, bool causal,
    bool /*deterministic*/, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p) {
  check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  const AttentionOptions options{softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p};
  check_options(options, q, varlen_batch(cu_seqlens_q));
  const at::Tensor cu_q = cu_seqlens_q.contiguous(), cu_k = cu_seqlens_k.contiguous();
  return fwd_cuda_impl(q, k, v, options, VarlenArgs{&cu_q, &cu_k, max_seqlen_q, max_seqlen_k});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
    int64_t max_seqlen_k, double softmax_scale, bool causal, bool deterministic, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
    const std::optional<at::Tensor>& rng_state) {
  check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  check_bwd_tensors(dout, q, out, lse, {q.size(1), q.size(0)}, "(heads_q, total_q)");
  const AttentionOptions options{softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p};
  check_options(options, q, varlen_batch(cu_seqlens_q));
  const at::Tensor cu_q = cu_seqlens_q.contiguous(), cu_k = cu_seqlens_k.contiguous();
  return bwd_cuda_impl(dout, q, k, v, out, lse, options, deterministic, rng_state,
                       VarlenArgs{&cu_q, &cu_k, max_seqlen_q, max_seqlen_k});
}

#endif  // FLASH_EXT_WITH_CUDA

}  // namespace

// The options every op shares, in schema form. window_left / window_right are window_size's two
// sides (-1: unbounded); causal=True clamps window_right to 0. softcap 0, alibi_slopes None and
// dropout_p 0 turn those features off.
#define FLASH_EXT_OPTIONS_SCHEMA                                                     \
  "float softmax_scale, bool causal, bool deterministic=False, int window_left=-1, " \
  "int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, float dropout_p=0.0"

TORCH_LIBRARY(flash_ext, m) {
  // Dense batch: q (batch, seqlen_q, heads_q, head_dim), k and v (batch, seqlen_k, heads_kv, head_dim).
  // `deterministic` is the backward's choice; the forward op carries it so that autograd can
  // hand it to the backward op. rng_state is int64 [seed, offset] of the dropout mask (zeros
  // without dropout): the backward regenerates the mask from it.
  m.def("fwd(Tensor q, Tensor k, Tensor v, " FLASH_EXT_OPTIONS_SCHEMA
        ") -> (Tensor out, Tensor lse, Tensor rng_state)");
  m.def("bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, " FLASH_EXT_OPTIONS_SCHEMA
        ", Tensor? rng_state=None) -> (Tensor dq, Tensor dk, Tensor dv)");
  // Variable-length batch: sequences packed along the first dimension, q (total_q, heads_q,
  // head_dim), k and v (total_k, heads_kv, head_dim), lse (heads_q, total_q); cu_seqlens_* are
  // the int32 prefix sums of the lengths (batch + 1 entries), max_seqlen_* the longest lengths.
  m.def(
      "varlen_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
      "int max_seqlen_k, " FLASH_EXT_OPTIONS_SCHEMA ") -> (Tensor out, Tensor lse, Tensor rng_state)");
  m.def(
      "varlen_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, " FLASH_EXT_OPTIONS_SCHEMA
      ", Tensor? rng_state=None) -> (Tensor dq, Tensor dk, Tensor dv)");
  // Testing: the keep mask (true = kept) a forward with this rng_state applies, (batch, heads_q,
  // seqlen_q, seqlen_k) bool, on rng_state's device (the CPU).
  m.def(
      "dropout_keep_mask(Tensor rng_state, int batch, int heads, int seqlen_q, int seqlen_k, float dropout_p) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(flash_ext, CPU, m) {
  m.impl("fwd", &fwd_cpu);
  m.impl("bwd", &bwd_cpu);
  m.impl("varlen_fwd", &varlen_fwd_cpu);
  m.impl("varlen_bwd", &varlen_bwd_cpu);
  m.impl("dropout_keep_mask", &dropout_keep_mask_cpu);
}

#ifdef FLASH_EXT_WITH_CUDA
TORCH_LIBRARY_IMPL(flash_ext, CUDA, m) {
  m.impl("fwd", &fwd_cuda);
  m.impl("bwd", &bwd_cuda);
  m.impl("varlen_fwd", &varlen_fwd_cuda);
  m.impl("varlen_bwd", &varlen_bwd_cuda);
}
#endif

}  // namespace flash_ext

// Build facts for flash_ext.info(): "cuda;<archs>" or "cpu;".
namespace {
std::string build_info() {
#ifdef FLASH_EXT_WITH_CUDA
  return std::string("cuda;") + FLASH_EXT_CUDA_ARCHS;
#else
  return "cpu;";
#endif
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(flash_ext, m) {
  m.def("build_info() -> str", [] { return build_info(); });
}

// An empty Python module, so that `import flash_ext._C` loads this library (and with it the
// op registrations above) the ordinary way.
extern "C" PyObject* PyInit__C() {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
