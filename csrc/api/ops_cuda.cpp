// The CUDA path: head dims padded to a kernel's, tensors in layouts the kernels read in place, the
// outputs and the backward's scratch allocated (sized by its plan, bwd_plan.h), then dispatch.cpp.
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>

#include "../bwd_plan.h"
#include "../dispatch.h"
#include "../error_message.h"
#include "../host/device_info.h"
#include "../host/runtime_settings.h"
#include "../kernel_configs.h"
#include "ops.h"
#include "packed_keys.h"
#include "params_from_tensors.h"
#include "rng.h"

namespace flash_ext {
namespace {

void check_compute_capability(const at::Tensor& q) {
  const DeviceInfo& device = device_info(q.device().index());
  FLASH_EXT_CHECK(device.major >= 8, "flash_ext: the CUDA kernels need compute capability 8.0 or newer (Ampere+); device ",
                  q.device(), " is ", device.major, ".", device.minor);
}

at::Tensor pad_head_dim(const at::Tensor& t, int64_t head_dim_padded) {
  if (t.size(-1) == head_dim_padded) return t;
  return at::constant_pad_nd(t, {0, head_dim_padded - t.size(-1)}, 0);
}

at::Tensor unpad_head_dim(const at::Tensor& t, int64_t head_dim) {
  return t.size(-1) == head_dim ? t : t.narrow(-1, 0, head_dim).contiguous();
}

// What the CUDA forward and backward both make of q, k, v before a launch: head_dim padded to a kernel's
// (kernel_configs.h; zero columns) and every tensor in a layout the kernels take (usable_layout).
struct CudaQkv {
  int64_t head_dim;         // the caller's
  int64_t head_dim_padded;  // the kernels'
  at::Tensor q, k, v;

  CudaQkv(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in)
      : head_dim((check_compute_capability(q_in), q_in.size(-1))),
        head_dim_padded(kernel_configs::padded_head_dim(static_cast<int>(head_dim))),
        q(prepared(q_in)),
        k(prepared(k_in)),
        v(prepared(v_in)) {}
  at::Tensor prepared(const at::Tensor& t) const { return usable_layout(pad_head_dim(t, head_dim_padded)); }
};

// lse: (batch, heads_q, seqlen_q) dense, (heads_q, total_q) varlen.
at::Tensor empty_lse(const at::Tensor& q, const VarlenArgs& varlen) {
  const auto options = q.options().dtype(at::kFloat);
  return varlen.is_varlen() ? at::empty({q.size(1), q.size(0)}, options)
                            : at::empty({q.size(0), q.size(2), q.size(1)}, options);
}

// A forward's zeroed state: [seed, offset] of its dropout mask (the kernel writes them only with dropout; the
// op's rng_state output) and the persistent sm90 forward's tile counter, zeroed by one memset: at::zeros costs
// a fill kernel's host-side setup, ~15 us of a ~45 us call at small shapes (H200 host, torch.profiler, 2026-11).
struct ZeroedFwdState {
  at::Tensor rng_state;
  int* tile_counter;
};

ZeroedFwdState zeroed_fwd_state(const at::Tensor& q, cudaStream_t stream) {
  at::Tensor state = at::empty({3}, q.options().dtype(at::kLong));
  C10_CUDA_CHECK(cudaMemsetAsync(state.data_ptr(), 0, 3 * sizeof(int64_t), stream));
  return {state.narrow(0, 0, 2), reinterpret_cast<int*>(state.data_ptr<int64_t>() + 2)};
}

at::Tensor empty_floats(int64_t count, const at::Tensor& like) {
  return at::empty({count}, like.options().dtype(at::kFloat));
}

}  // namespace

FwdResult attention_fwd_cuda(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                             const AttentionOptions& options, const VarlenArgs& varlen) {
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  const CudaQkv qkv(q_in, k_in, v_in);
  const at::Tensor &q = qkv.q, &k = qkv.k, &v = qkv.v;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();

  at::Tensor out_padded = at::empty(q.sizes(), q.options());
  at::Tensor lse = empty_lse(q, varlen);
  const ZeroedFwdState state = zeroed_fwd_state(q, stream);
  at::Tensor rng_state = state.rng_state;
  auto result = [&]() -> FwdResult { return {unpad_head_dim(out_padded, qkv.head_dim), lse, rng_state}; };
  if (out_padded.numel() == 0) return result();
  if (k.numel() == 0) {  // no keys at all: every row is empty
    out_padded.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return result();
  }

  FwdParams p = make_fwd_params(q, k, v, out_padded, lse, options, varlen, RngState{});
  if (p.seqlen_q == 0) return result();  // varlen with every sequence empty of queries
  if (options.dropout_p > 0) set_cuda_dropout_state(p, rng_state);
  p.tile_counter = state.tile_counter;
  run_attention_fwd(p, stream);
  return result();
}

std::optional<FwdResult> attention_fwd_keys_in_cache_cuda(const at::Tensor& q_in, const at::Tensor& k_cache,
                                                          const at::Tensor& v_cache, const AttentionOptions& options,
                                                          const VarlenArgs& varlen_q, const CachedKeys& keys) {
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  check_compute_capability(q_in);
  // The caches are read where they are (a padded or re-laid-out copy would cost what the gather does).
  if (!kernel_configs::sm90_has_fwd(static_cast<int>(q_in.size(-1))) || options.dropout_p > 0 ||
      q_in.size(0) == 0 || varlen_q.max_seqlen_q == 0 || k_cache.stride(-1) != 1 || v_cache.stride(-1) != 1) {
    return std::nullopt;
  }
  const at::Tensor q = usable_layout(q_in);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = empty_lse(q, varlen_q);
  FwdParams p = make_fwd_params(q, k_cache, v_cache, out, lse, options, varlen_q, RngState{});
  const auto ints = [](const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr<int32_t>() : nullptr; };
  p.key_lengths = keys.lengths.data_ptr<int32_t>();
  p.key_starts = ints(keys.starts);
  p.key_rows = ints(keys.rows);
  p.key_pages = ints(keys.pages);
  p.key_pages_stride = keys.pages.has_value() ? keys.pages->stride(0) : 0;
  p.cache_batch = k_cache.size(0);
  p.cache_seqlen = k_cache.size(1);
  p.total_k = 0;
  // The persistent kernel's tile counter, zeroed before it runs (a memset nothing is launched after, if no
  // kernel takes the call).
  const ZeroedFwdState state = zeroed_fwd_state(q, stream);
  p.tile_counter = state.tile_counter;
  if (!run_attention_fwd_keys_in_cache(p, stream)) return std::nullopt;
  return FwdResult{out, lse, state.rng_state};
}

FwdResult varlen_paged_fwd_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const AttentionOptions& options, const VarlenArgs& varlen, const PagedArgs& paged) {
  const c10::cuda::CUDAGuard device_guard(q.device());
  // Pages the sm90 forward reads in place (whole key blocks a page); otherwise the keys are gathered.
  if (paged.block_table.has_value()) {
    const CachedKeys keys{varlen_key_counts(k, varlen, paged), std::nullopt, std::nullopt,
                          paged.block_table->contiguous()};
    const VarlenArgs varlen_q{varlen.cu_seqlens_q, std::nullopt, varlen.max_seqlen_q, varlen.max_seqlen_k};
    if (auto fwd = attention_fwd_keys_in_cache_cuda(q, k, v, options, varlen_q, keys)) return *fwd;
  }
  // The used keys' counts stay on the device: the packed batch is sized by a bound (varlen_keys_bound).
  const PackedKeys packed = pack_varlen_keys(k, v, varlen, paged, /*exact=*/false);
  return attention_fwd_cuda(q, packed.k, packed.v, options,
                            {varlen.cu_seqlens_q, packed.cu_seqlens_k, varlen.max_seqlen_q, varlen.max_seqlen_k});
}

BwdResult attention_bwd_cuda(const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
                             const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse,
                             const AttentionOptions& options, bool deterministic,
                             const std::optional<at::Tensor>& rng_state, const VarlenArgs& varlen) {
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  const CudaQkv qkv(q_in, k_in, v_in);
  const at::Tensor &q = qkv.q, &k = qkv.k, &v = qkv.v;
  const at::Tensor out = qkv.prepared(out_in), dout = qkv.prepared(dout_in);
  const at::Tensor lse_c = lse.contiguous();

  // Every row is written by the kernels (keys that no query sees get dk = dv = 0 there).
  at::Tensor dq = at::empty(q.sizes(), q.options());
  at::Tensor dk = at::empty(k.sizes(), k.options());
  at::Tensor dv = at::empty(v.sizes(), v.options());
  auto result = [&]() -> BwdResult {
    return {unpad_head_dim(dq, qkv.head_dim), unpad_head_dim(dk, qkv.head_dim), unpad_head_dim(dv, qkv.head_dim)};
  };
  if (q.numel() == 0 || k.numel() == 0) {  // no query or no key: the gradients are exactly zero
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return result();
  }

  BwdParams p = make_bwd_params(make_fwd_params(q, k, v, out, lse_c, options, varlen, RngState{}), dout, dq, dk, dv,
                                deterministic);
  const BwdPlan plan = plan_attention_bwd(p);
  // The scratch the plan sizes (bwd_plan.h): O(seqlen), except the split walks' sums, which are at most one
  // walk per SM (independent of seqlen; 17 MiB at head_dim 128 on an H200).
  const at::Tensor softmax_d = empty_floats(plan.softmax_d_floats, q);
  p.softmax_d = softmax_d.data_ptr<float>();
  at::Tensor dq_accum, row_stats, dkv_accum;
  if (plan.dq_by_atomics) {
    dq_accum = empty_floats(plan.dq_scratch_elements(), q);
    // Poisoning (runtime_settings.h) makes a row that the preprocess kernel's zeroing missed show in dq
    // rather than pass on a fresh allocation's zeros.
    if (runtime_settings().poison_scratch.load(std::memory_order_relaxed)) {
      dq_accum.fill_(std::numeric_limits<float>::quiet_NaN());
    }
    row_stats = empty_floats(plan.row_stats_floats, q);
    p.dq_accum = dq_accum.data_ptr<float>();
    p.dq_accum_rows = plan.dq_accum_rows;
    p.dkdv_finished = reinterpret_cast<int*>(p.dq_accum + plan.dq_accum_floats);
    p.dkdv_tile_counter = p.dkdv_finished + int64_t{p.batch} * p.heads_kv * kFinishedCounterStride;
    if (plan.dq_turn_ints > 0) p.dq_turns = p.dkdv_tile_counter + kFinishedCounterStride;
    p.row_stats = row_stats.data_ptr<float>();
  }
  if (plan.dkv_accum_floats > 0) {
    dkv_accum = empty_floats(plan.dkv_accum_floats, q);
    p.dkv_accum = dkv_accum.data_ptr<float>();
  }
  if (p.seqlen_q == 0 || p.seqlen_k == 0) return result();
  at::Tensor rng_state_on_device;
  if (options.dropout_p > 0) set_cuda_dropout_state_from(p, rng_state, q, rng_state_on_device);
  run_attention_bwd(p, plan, c10::cuda::getCurrentCUDAStream().stream());
  return result();
}

std::string kernel_path_cuda(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                             const AttentionOptions& options, bool deterministic) {
  const c10::cuda::CUDAGuard device_guard(q_in.device());
  const CudaQkv qkv(q_in, k_in, v_in);
  const at::Tensor &q = qkv.q, &k = qkv.k, &v = qkv.v;
  // Tensors laid out as the op allocates its outputs, so that the kernels' checks see what a call would.
  const at::Tensor out = at::empty(q.sizes(), q.options()), lse = empty_lse(q, VarlenArgs{});
  const at::Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(k.sizes(), k.options());
  const BwdParams p = make_bwd_params(make_fwd_params(q, k, v, out, lse, options, VarlenArgs{}, RngState{}), out, dq,
                                      dk, dk, deterministic);
  const DeviceInfo& device = device_info(q_in.device().index());
  std::string padding;
  if (qkv.head_dim_padded != qkv.head_dim) {
    padding = ", head_dim padded " + std::to_string(qkv.head_dim) + "->" + std::to_string(qkv.head_dim_padded);
  }
  return "cuda " + describe_kernels(p) + " (head_dim " + std::to_string(qkv.head_dim_padded) + padding + ", " +
         std::string(c10::toString(q_in.scalar_type())) + ", causal=" + (options.causal ? "True" : "False") +
         ", deterministic=" + (deterministic ? "True" : "False") + ") on sm_" + std::to_string(device.major) +
         std::to_string(device.minor);
}

}  // namespace flash_ext
