// The only translation unit that includes torch: op schema, input checks, params filling
// and dispatch to the CPU implementation and the CUDA kernels.
#include <Python.h>
#include <torch/library.h>
#include <torch/types.h>

#include <cmath>
#include <limits>

#include "cpu/attention_cpu.h"
#include "params.h"

#ifdef FLASH_EXT_WITH_CUDA
// c10/cuda only: ATen/cuda/CUDAContext.h would pull in cuSPARSE/cuBLAS headers that a plain
// CUDA toolkit install may lack.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "sm80/dispatch.h"
#endif

namespace flash_ext {
namespace {

// ---------------------------------------------------------------------------------------
// Checks. Every message names the argument and says what was expected.

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(q.dim() == 4, "flash_ext: q must have 4 dimensions (batch, seqlen_q, heads_q, head_dim), got ",
              q.dim(), " (shape ", q.sizes(), ")");
  TORCH_CHECK(k.dim() == 4, "flash_ext: k must have 4 dimensions (batch, seqlen_k, heads_kv, head_dim), got ",
              k.dim(), " (shape ", k.sizes(), ")");
  TORCH_CHECK(v.dim() == 4, "flash_ext: v must have 4 dimensions (batch, seqlen_k, heads_kv, head_dim), got ",
              v.dim(), " (shape ", v.sizes(), ")");

  const auto dtype = q.scalar_type();
  const bool is_cuda = q.is_cuda();
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || (dtype == at::kFloat && !is_cuda),
              "flash_ext: q has dtype ", dtype, "; expected float16 or bfloat16",
              is_cuda ? " on CUDA" : " (or float32 on the CPU)");
  TORCH_CHECK(k.scalar_type() == dtype, "flash_ext: k has dtype ", k.scalar_type(),
              " but q has ", dtype, "; q, k and v must share one dtype");
  TORCH_CHECK(v.scalar_type() == dtype, "flash_ext: v has dtype ", v.scalar_type(),
              " but q has ", dtype, "; q, k and v must share one dtype");
  TORCH_CHECK(k.device() == q.device(), "flash_ext: k is on ", k.device(), " but q is on ", q.device(),
              "; q, k and v must be on one device");
  TORCH_CHECK(v.device() == q.device(), "flash_ext: v is on ", v.device(), " but q is on ", q.device(),
              "; q, k and v must be on one device");

  TORCH_CHECK(k.sizes() == v.sizes(), "flash_ext: k and v must have the same shape, got k ", k.sizes(),
              " and v ", v.sizes());
  TORCH_CHECK(k.size(0) == q.size(0), "flash_ext: k has batch ", k.size(0), " but q has batch ", q.size(0));
  TORCH_CHECK(k.size(3) == q.size(3), "flash_ext: k has head_dim ", k.size(3), " but q has head_dim ",
              q.size(3), "; q, k and v must share head_dim");
  const int64_t head_dim = q.size(3);
  TORCH_CHECK(head_dim >= 1 && head_dim <= 256, "flash_ext: head_dim (last dimension of q) must be in 1..256, got ",
              head_dim);
  const int64_t heads_q = q.size(2), heads_kv = k.size(2);
  TORCH_CHECK(heads_kv >= 1 && heads_q % heads_kv == 0, "flash_ext: heads_q (q.size(2) = ", heads_q,
              ") must be a multiple of heads_kv (k.size(2) = ", heads_kv, ")");
  if (is_cuda) {
    TORCH_CHECK(q.size(0) * std::max<int64_t>(1, heads_q) <= std::numeric_limits<int32_t>::max() &&
                    q.size(1) <= std::numeric_limits<int32_t>::max() && k.size(1) <= std::numeric_limits<int32_t>::max(),
                "flash_ext: batch * heads and seqlens must each fit in int32");
  }
}

void check_softmax_scale(double softmax_scale) {
  TORCH_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0,
              "flash_ext: softmax_scale must be a finite positive number, got ", softmax_scale);
}

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "flash_ext: unsupported dtype ", t);
  }
}

TensorStrides strides_of(const at::Tensor& t) {
  return TensorStrides{t.stride(0), t.stride(1), t.stride(2)};
}

// Kernels read rows with the last dimension contiguous; CUDA kernels also move 16 bytes at a
// time, so there every stride and the base pointer must be 16-byte aligned.
at::Tensor usable_layout(const at::Tensor& t) {
  bool ok = t.stride(-1) == 1 || t.size(-1) == 1;
  if (ok && t.is_cuda()) {
    const int64_t elems_per_16b = 16 / t.element_size();
    ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
    for (int d = 0; d < 3 && ok; ++d) ok = t.size(d) == 1 || t.stride(d) % elems_per_16b == 0;
  }
  // A last dim of size 1 may carry any stride; normalise so kernels can assume stride 1.
  if (ok && t.stride(-1) != 1) ok = false;
  // clone, not contiguous(): a contiguous view at a misaligned offset must be copied too.
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

FwdParams make_fwd_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                          const at::Tensor& lse, double softmax_scale, bool causal) {
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
  p.batch = static_cast<int>(q.size(0));
  p.seqlen_q = static_cast<int>(q.size(1));
  p.heads_q = static_cast<int>(q.size(2));
  p.head_dim = static_cast<int>(q.size(3));
  p.seqlen_k = static_cast<int>(k.size(1));
  p.heads_kv = static_cast<int>(k.size(2));
  p.dtype = to_dtype(q.scalar_type());
  p.softmax_scale = static_cast<float>(softmax_scale);
  p.scale_log2 = static_cast<float>(softmax_scale * M_LOG2E);
  p.causal = causal;
  return p;
}

void check_bwd_inputs(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& out, const at::Tensor& lse, double softmax_scale) {
  check_qkv(q, k, v);
  check_softmax_scale(softmax_scale);
  TORCH_CHECK(dout.sizes() == q.sizes() && dout.scalar_type() == q.scalar_type() && dout.device() == q.device(),
              "flash_ext: dout must match q in shape, dtype and device, got ", dout.sizes(), " ", dout.scalar_type(),
              " on ", dout.device());
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.device() == q.device(),
              "flash_ext: out must match q in shape, dtype and device, got ", out.sizes(), " ", out.scalar_type(),
              " on ", out.device());
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.device() == q.device() &&
                  lse.sizes() == at::IntArrayRef({q.size(0), q.size(2), q.size(1)}),
              "flash_ext: lse must be float32 of shape (batch, heads_q, seqlen_q) on q's device, got ", lse.sizes(),
              " ", lse.scalar_type(), " on ", lse.device());
}

BwdParams make_bwd_params(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const at::Tensor& out, const at::Tensor& lse, const at::Tensor& dq, const at::Tensor& dk,
                          const at::Tensor& dv, double softmax_scale, bool causal, bool deterministic) {
  BwdParams p;
  static_cast<FwdParams&>(p) = make_fwd_params(q, k, v, out, lse, softmax_scale, causal);
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

// ---------------------------------------------------------------------------------------
// CPU

// `deterministic` only travels to the backward (through autograd's saved inputs).
std::tuple<at::Tensor, at::Tensor> fwd_cpu(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                           double softmax_scale, bool causal, bool /*deterministic*/) {
  check_qkv(q_in, k_in, v_in);
  check_softmax_scale(softmax_scale);
  const at::Tensor q = usable_layout(q_in), k = usable_layout(k_in), v = usable_layout(v_in);
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  if (out.numel() == 0) return {out, lse};
  cpu::attention_fwd(make_fwd_params(q, k, v, out, lse, softmax_scale, causal));
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cpu(const at::Tensor& dout_in, const at::Tensor& q_in,
                                                       const at::Tensor& k_in, const at::Tensor& v_in,
                                                       const at::Tensor& out_in, const at::Tensor& lse,
                                                       double softmax_scale, bool causal, bool deterministic) {
  check_bwd_inputs(dout_in, q_in, k_in, v_in, out_in, lse, softmax_scale);
  const at::Tensor q = usable_layout(q_in), k = usable_layout(k_in), v = usable_layout(v_in);
  const at::Tensor dout = usable_layout(dout_in), out = usable_layout(out_in), lse_c = lse.contiguous();
  // Zeros, not empty: with seqlen_q == 0 (or seqlen_k == 0) the gradients are exactly zero.
  at::Tensor dq = at::zeros(q.sizes(), q.options());
  at::Tensor dk = at::zeros(k.sizes(), k.options());
  at::Tensor dv = at::zeros(v.sizes(), v.options());
  if (q.numel() == 0 || k.numel() == 0) return {dq, dk, dv};
  // The CPU backward is always deterministic (two passes, no shared accumulators).
  cpu::attention_bwd(make_bwd_params(dout, q, k, v, out, lse_c, dq, dk, dv, softmax_scale, causal, deterministic));
  return {dq, dk, dv};
}

// ---------------------------------------------------------------------------------------
// CUDA

#ifdef FLASH_EXT_WITH_CUDA

// The kernels support head dims that are multiples of 32 up to 256; others are zero-padded
// (zeros add nothing to q.k, and the padded output columns are sliced off).
int64_t padded_head_dim(int64_t head_dim) { return std::max<int64_t>(32, (head_dim + 31) / 32 * 32); }

at::Tensor pad_head_dim(const at::Tensor& t, int64_t head_dim_padded) {
  if (t.size(3) == head_dim_padded) return t;
  return at::constant_pad_nd(t, {0, head_dim_padded - t.size(3)}, 0);
}

void check_sm80(const at::Tensor& q) {
  int major = 0, minor = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.device().index()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, q.device().index()));
  TORCH_CHECK(major >= 8, "flash_ext: the CUDA kernels need compute capability 8.0 or newer (Ampere+); device ",
              q.device(), " is ", major, ".", minor);
}

std::tuple<at::Tensor, at::Tensor> fwd_cuda(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                            double softmax_scale, bool causal, bool /*deterministic*/) {
  check_qkv(q_in, k_in, v_in);
  check_softmax_scale(softmax_scale);
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  check_sm80(q_in);

  const int64_t head_dim = q_in.size(3);
  const int64_t head_dim_padded = padded_head_dim(head_dim);
  const at::Tensor q = usable_layout(pad_head_dim(q_in, head_dim_padded));
  const at::Tensor k = usable_layout(pad_head_dim(k_in, head_dim_padded));
  const at::Tensor v = usable_layout(pad_head_dim(v_in, head_dim_padded));

  at::Tensor out_padded = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  auto result = [&]() -> std::tuple<at::Tensor, at::Tensor> {
    if (head_dim == head_dim_padded) return {out_padded, lse};
    return {out_padded.narrow(3, 0, head_dim).contiguous(), lse};
  };
  if (out_padded.numel() == 0) return result();
  if (k.size(1) == 0) {  // no keys at all: every row is empty
    out_padded.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return result();
  }

  FwdParams p = make_fwd_params(q, k, v, out_padded, lse, softmax_scale, causal);
  sm80::run_attention_fwd_dispatch(p, c10::cuda::getCurrentCUDAStream().stream());
  return result();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> bwd_cuda(const at::Tensor& dout_in, const at::Tensor& q_in,
                                                        const at::Tensor& k_in, const at::Tensor& v_in,
                                                        const at::Tensor& out_in, const at::Tensor& lse,
                                                        double softmax_scale, bool causal, bool deterministic) {
  check_bwd_inputs(dout_in, q_in, k_in, v_in, out_in, lse, softmax_scale);
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  check_sm80(q_in);

  const int64_t head_dim = q_in.size(3);
  const int64_t head_dim_padded = padded_head_dim(head_dim);
  const at::Tensor q = usable_layout(pad_head_dim(q_in, head_dim_padded));
  const at::Tensor k = usable_layout(pad_head_dim(k_in, head_dim_padded));
  const at::Tensor v = usable_layout(pad_head_dim(v_in, head_dim_padded));
  const at::Tensor out = usable_layout(pad_head_dim(out_in, head_dim_padded));
  const at::Tensor dout = usable_layout(pad_head_dim(dout_in, head_dim_padded));
  const at::Tensor lse_c = lse.contiguous();

  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  auto result = [&]() -> std::tuple<at::Tensor, at::Tensor, at::Tensor> {
    if (head_dim == head_dim_padded) return {dq, dk, dv};
    return {dq.narrow(3, 0, head_dim).contiguous(), dk.narrow(3, 0, head_dim).contiguous(),
            dv.narrow(3, 0, head_dim).contiguous()};
  };
  if (q.numel() == 0 || k.numel() == 0) {  // no query or no key: the gradients are exactly zero
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return result();
  }
  // Scratch, O(seqlen): D = rowsum(dout * out) per query row (fp32), and unless deterministic
  // the fp32 dQ accumulator that the dK/dV kernel adds into with atomics (zeroed here).
  at::Tensor softmax_d = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  at::Tensor dq_accum;
  if (!deterministic) dq_accum = at::zeros(q.sizes(), q.options().dtype(at::kFloat));

  BwdParams p = make_bwd_params(dout, q, k, v, out, lse_c, dq, dk, dv, softmax_scale, causal, deterministic);
  p.softmax_d = softmax_d.data_ptr<float>();
  if (!deterministic) p.dq_accum = dq_accum.data_ptr<float>();
  sm80::run_attention_bwd_dispatch(p, c10::cuda::getCurrentCUDAStream().stream());
  return result();
}

#endif  // FLASH_EXT_WITH_CUDA

}  // namespace

TORCH_LIBRARY(flash_ext, m) {
  // `deterministic` is the backward's choice; the forward op carries it so that autograd can
  // hand it to the backward op.
  m.def(
      "fwd(Tensor q, Tensor k, Tensor v, float softmax_scale, bool causal, bool deterministic=False) "
      "-> (Tensor out, Tensor lse)");
  m.def(
      "bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, float softmax_scale, bool causal, "
      "bool deterministic) -> (Tensor dq, Tensor dk, Tensor dv)");
}

TORCH_LIBRARY_IMPL(flash_ext, CPU, m) {
  m.impl("fwd", &fwd_cpu);
  m.impl("bwd", &bwd_cpu);
}

#ifdef FLASH_EXT_WITH_CUDA
TORCH_LIBRARY_IMPL(flash_ext, CUDA, m) {
  m.impl("fwd", &fwd_cuda);
  m.impl("bwd", &bwd_cuda);
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
