// The ops' schema and their registration for each device: the one place where op arguments become
// checked options (make_options) before a device's op body (ops.h) runs.
#include <Python.h>
#include <torch/library.h>

#include <string>

#include "../host/runtime_settings.h"
#include "checks.h"
#include "ops.h"
#include "params_from_tensors.h"

namespace flash_ext {
namespace {

using FwdBody = FwdResult (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const AttentionOptions&,
                              const VarlenArgs&);
using PagedFwdBody = FwdResult (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const AttentionOptions&,
                                   const VarlenArgs&, const PagedArgs&);
using BwdBody = BwdResult (*)(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&, const AttentionOptions&, bool,
                              const std::optional<at::Tensor>&, const VarlenArgs&);

// `deterministic` only travels to the backward (through autograd's saved inputs).
template <FwdBody kBody>
FwdResult fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double softmax_scale, bool causal,
              bool /*deterministic*/, int64_t window_left, int64_t window_right, double softcap,
              const std::optional<at::Tensor>& alibi_slopes, double dropout_p) {
  check_qkv(q, k, v);
  return kBody(q, k, v,
               make_options(q, q.size(0), softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                            dropout_p),
               VarlenArgs{});
}

template <BwdBody kBody>
BwdResult bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
              const at::Tensor& out, const at::Tensor& lse, double softmax_scale, bool causal, bool deterministic,
              int64_t window_left, int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes,
              double dropout_p, const std::optional<at::Tensor>& rng_state) {
  check_qkv(q, k, v);
  check_bwd_tensors(dout, q, out, lse, {q.size(0), q.size(2), q.size(1)}, "(batch, heads_q, seqlen_q)");
  return kBody(dout, q, k, v, out, lse,
               make_options(q, q.size(0), softmax_scale, causal, window_left, window_right, softcap, alibi_slopes,
                            dropout_p),
               deterministic, rng_state, VarlenArgs{});
}

VarlenArgs varlen_args(const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                       int64_t max_seqlen_k) {
  return {cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous(), max_seqlen_q, max_seqlen_k};
}

template <FwdBody kBody>
FwdResult varlen_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens_q,
                     const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
                     bool causal, bool /*deterministic*/, int64_t window_left, int64_t window_right, double softcap,
                     const std::optional<at::Tensor>& alibi_slopes, double dropout_p) {
  check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  return kBody(q, k, v,
               make_options(q, varlen_batch(cu_seqlens_q), softmax_scale, causal, window_left, window_right, softcap,
                            alibi_slopes, dropout_p),
               varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k));
}

// Forward only (no autograd registration): flash_ext.attention_varlen rejects inputs that require grad.
template <PagedFwdBody kBody>
FwdResult varlen_paged_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                           int64_t max_seqlen_k, const std::optional<at::Tensor>& block_table,
                           const std::optional<at::Tensor>& seqused_k, double softmax_scale, bool causal,
                           bool /*deterministic*/, int64_t window_left, int64_t window_right, double softcap,
                           const std::optional<at::Tensor>& alibi_slopes, double dropout_p) {
  const PagedArgs paged{block_table, seqused_k};
  check_varlen_paged_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, paged);
  return kBody(q, k, v,
               make_options(q, varlen_batch(cu_seqlens_q), softmax_scale, causal, window_left, window_right, softcap,
                            alibi_slopes, dropout_p),
               varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), paged);
}

template <BwdBody kBody>
BwdResult varlen_bwd(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_seqlens_q,
                     const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double softmax_scale,
                     bool causal, bool deterministic, int64_t window_left, int64_t window_right, double softcap,
                     const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
                     const std::optional<at::Tensor>& rng_state) {
  check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  check_bwd_tensors(dout, q, out, lse, {q.size(1), q.size(0)}, "(heads_q, total_q)");
  return kBody(dout, q, k, v, out, lse,
               make_options(q, varlen_batch(cu_seqlens_q), softmax_scale, causal, window_left, window_right, softcap,
                            alibi_slopes, dropout_p),
               deterministic, rng_state, varlen_args(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k));
}

#ifdef FLASH_EXT_WITH_CUDA
std::string kernel_path(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                        bool deterministic) {
  check_qkv(q, k, v);
  const double scale = 1.0;
  return kernel_path_cuda(q, k, v, make_options(q, q.size(0), scale, causal, -1, -1, 0.0, std::nullopt, 0.0),
                          deterministic);
}
#endif

// Build facts for flash_ext.info(): "cuda;<archs>" or "cpu;".
std::string build_info() {
#ifdef FLASH_EXT_WITH_CUDA
  return std::string("cuda;") + FLASH_EXT_CUDA_ARCHS;
#else
  return "cpu;";
#endif
}

bool set_sm90_enabled(bool enabled) { return runtime_settings().sm90_enabled.exchange(enabled); }
bool set_poison_scratch(bool enabled) { return runtime_settings().poison_scratch.exchange(enabled); }

}  // namespace

// The options every attention op shares, in schema form. window_left / window_right are window_size's two
// sides (-1: unbounded); causal=True clamps window_right to 0. softcap 0, alibi_slopes None and dropout_p 0
// turn those features off.
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
  // Variable-length batch whose keys are read through a block table and / or only partly used
  // (flash_ext.attention_varlen with block_table / seqused_k; flash-attn's paged varlen semantics): with
  // block_table (batch, max_blocks) int32, k and v are page pools (num_blocks, page_size, heads_kv, head_dim)
  // and key j of sequence b is slot j % page_size of page block_table[b][j / page_size]; seqused_k (batch,)
  // int32: sequence b uses its first seqused_k[b] keys instead of cu_seqlens_k[b + 1] - cu_seqlens_k[b].
  // Forward only (no backward op, no autograd); with both None it is varlen_fwd's forward.
  m.def(
      "varlen_paged_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, "
      "int max_seqlen_k, Tensor? block_table, Tensor? seqused_k, " FLASH_EXT_OPTIONS_SCHEMA
      ") -> (Tensor out, Tensor lse, Tensor rng_state)");
  // KV cache (flash_ext.attention_with_kvcache): q (batch, seqlen_q, heads_q, head_dim); k_cache / v_cache
  // (batch_cache, seqlen_cache, heads_kv, head_dim), or pages (num_blocks, page_size, heads_kv, head_dim) with
  // block_table (batch, max_blocks) int32. k / v (batch, seqlen_new, heads_kv, head_dim), when given, are written
  // into the caches in place (hence the (a!) / (b!) annotations) at cache_seqlens[b] ..., then attended to.
  // cache_seqlens, cache_batch_idx, cache_leftpad: int32 (batch,). No dropout, no backward.
  m.def(
      "kvcache_fwd(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k=None, Tensor? v=None, "
      "Tensor? rotary_cos=None, Tensor? rotary_sin=None, bool rotary_interleaved=True, Tensor? cache_seqlens=None, "
      "Tensor? cache_batch_idx=None, Tensor? cache_leftpad=None, Tensor? block_table=None, float softmax_scale=1.0, "
      "bool causal=False, int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, "
      "int num_splits=0) -> (Tensor out, Tensor lse)");
  // Testing: the keep mask (true = kept) a forward with this rng_state applies, (batch, heads_q,
  // seqlen_q, seqlen_k) bool, on rng_state's device (the CPU).
  m.def(
      "dropout_keep_mask(Tensor rng_state, int batch, int heads, int seqlen_q, int seqlen_k, float dropout_p) "
      "-> Tensor");
  // Which CUDA kernels a dense call takes, forward and backward, in words (flash_ext.kernel_path).
  m.def("kernel_path(Tensor q, Tensor k, Tensor v, bool causal, bool deterministic) -> str");
  m.def("build_info() -> str", &build_info);
  // The runtime settings (host/runtime_settings.h); each returns the previous value.
  m.def("set_sm90_enabled(bool enabled) -> bool", &set_sm90_enabled);
  m.def("set_poison_scratch(bool enabled) -> bool", &set_poison_scratch);
}

TORCH_LIBRARY_IMPL(flash_ext, CPU, m) {
  m.impl("fwd", &fwd<attention_fwd_cpu>);
  m.impl("bwd", &bwd<attention_bwd_cpu>);
  m.impl("varlen_fwd", &varlen_fwd<attention_fwd_cpu>);
  m.impl("varlen_bwd", &varlen_bwd<attention_bwd_cpu>);
  m.impl("varlen_paged_fwd", &varlen_paged_fwd<varlen_paged_fwd_cpu>);
  m.impl("dropout_keep_mask", &dropout_keep_mask_cpu);
  m.impl("kvcache_fwd", &kvcache_fwd_cpu);
}

#ifdef FLASH_EXT_WITH_CUDA
TORCH_LIBRARY_IMPL(flash_ext, CUDA, m) {
  m.impl("fwd", &fwd<attention_fwd_cuda>);
  m.impl("bwd", &bwd<attention_bwd_cuda>);
  m.impl("varlen_fwd", &varlen_fwd<attention_fwd_cuda>);
  m.impl("varlen_bwd", &varlen_bwd<attention_bwd_cuda>);
  m.impl("varlen_paged_fwd", &varlen_paged_fwd<varlen_paged_fwd_cuda>);
  m.impl("kernel_path", &kernel_path);
  m.impl("kvcache_fwd", &kvcache_fwd_cuda);
}
#endif

}  // namespace flash_ext

// An empty Python module, so that `import flash_ext._C` loads this library (and with it the
// op registrations above) the ordinary way.
extern "C" PyObject* PyInit__C() {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
