#include "params_from_tensors.h"

#include <cmath>
#include <cstdint>

#include "../common/philox.h"
#include "../error_message.h"
#include "checks.h"

namespace flash_ext {
namespace {

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

// alibi_slopes with a contiguous head dimension (what params.h's alibi_slope indexing assumes).
std::optional<at::Tensor> usable_alibi_slopes(const std::optional<at::Tensor>& alibi_slopes) {
  if (!alibi_slopes.has_value()) return std::nullopt;
  return alibi_slopes->stride(-1) == 1 ? *alibi_slopes : alibi_slopes->contiguous();
}

}  // namespace

AttentionOptions make_options(const at::Tensor& q, int64_t batch, double softmax_scale, bool causal,
                              int64_t window_left, int64_t window_right, double softcap,
                              const std::optional<at::Tensor>& alibi_slopes, double dropout_p) {
  AttentionOptions options{softmax_scale, causal, window_left, window_right, softcap, alibi_slopes, dropout_p};
  check_options(options, q, batch);
  if (causal) options.window_right = 0;
  options.alibi_slopes = usable_alibi_slopes(alibi_slopes);
  return options;
}

// Kernels read rows with the last dimension contiguous; CUDA kernels also move 16 bytes at a time, so there
// every stride and the base pointer must be 16-byte aligned.
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

FwdParams make_fwd_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                          const at::Tensor& lse, const AttentionOptions& options, const VarlenArgs& varlen,
                          const RngState& rng) {
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
  if (varlen.is_varlen()) {
    // Packed q (total_q, heads_q, head_dim), k and v (total_k, heads_kv, head_dim), lse (heads_q, total_q).
    p.batch = static_cast<int>(varlen.cu_seqlens_q->size(0) - 1);
    p.seqlen_q = static_cast<int>(varlen.max_seqlen_q);
    p.seqlen_k = static_cast<int>(varlen.max_seqlen_k);
    p.cu_seqlens_q = varlen.cu_seqlens_q->data_ptr<int32_t>();
    // (Absent for keys read from a cache, whose lengths the caller sets: params.h, keys_in_cache.)
    p.cu_seqlens_k = varlen.cu_seqlens_k.has_value() ? varlen.cu_seqlens_k->data_ptr<int32_t>() : nullptr;
    p.lse_batch_stride = 0;
    p.lse_head_stride = q.size(0);
    p.total_q = q.size(0);
    p.total_k = k.size(0);
  } else {
    p.batch = static_cast<int>(q.size(0));
    p.seqlen_q = static_cast<int>(q.size(1));
    p.seqlen_k = static_cast<int>(k.size(1));
    p.lse_batch_stride = p.heads_q * static_cast<int64_t>(p.seqlen_q);
    p.lse_head_stride = p.seqlen_q;
  }

  p.softmax_scale = static_cast<float>(options.softmax_scale);
  p.scale_log2 = static_cast<float>(options.softmax_scale * M_LOG2E);
  p.window_left = static_cast<int>(options.window_left);
  p.window_right = static_cast<int>(options.window_right);
  p.softcap = static_cast<float>(options.softcap);
  const double score_scale = options.softcap > 0 ? options.softcap : options.softmax_scale;
  p.fwd_score_scale = static_cast<float>(score_scale);
  p.fwd_score_scale_log2 = static_cast<float>(score_scale * M_LOG2E);
  if (options.alibi_slopes.has_value()) {
    p.alibi_slopes = options.alibi_slopes->data_ptr<float>();
    p.alibi_slopes_batch_stride = options.alibi_slopes->dim() == 2 ? options.alibi_slopes->stride(0) : 0;
  }
  p.dropout_p = static_cast<float>(options.dropout_p);
  p.dropout_scale = static_cast<float>(1.0 / (1.0 - options.dropout_p));
  p.dropout_threshold = dropout_drop_threshold(options.dropout_p);
  p.philox_seed = rng.seed;
  p.philox_offset = rng.offset;
  return p;
}

BwdParams make_bwd_params(const FwdParams& fwd, const at::Tensor& dout, const at::Tensor& dq, const at::Tensor& dk,
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

}  // namespace flash_ext
