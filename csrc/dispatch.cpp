#include "dispatch.h"

#include <stdexcept>
#include <type_traits>

#include "common/dq_accum_layout.h"
#include "decode/launch.h"
#include "host/device_info.h"
#include "host/runtime_settings.h"
#include "kernel_configs.h"
#include "sm80/launch.h"
#include "sm90/launch.h"

namespace flash_ext {
namespace {

// Calls fn(elem, head_dim) with both as std::integral_constant, for a head dim of the sm80 list (the
// caller pads others to one of these).
template <typename Fn>
decltype(auto) dispatch_dtype_head_dim(const FwdParams& params, Fn&& fn) {
  auto for_dtype = [&](auto elem) -> decltype(auto) {
    switch (params.head_dim) {
#define FLASH_EXT_HEAD_DIM_CASE(d) \
  case d:                          \
    return fn(elem, std::integral_constant<int, d>{});
      FLASH_EXT_SM80_HEAD_DIMS(FLASH_EXT_HEAD_DIM_CASE)
#undef FLASH_EXT_HEAD_DIM_CASE
      default:
        throw std::invalid_argument("flash_ext: no CUDA kernel for head_dim " + std::to_string(params.head_dim));
    }
  };
  if (params.dtype == DType::kBFloat16) return for_dtype(std::integral_constant<Elem16, Elem16::kBFloat16>{});
  if (params.dtype == DType::kFloat16) return for_dtype(std::integral_constant<Elem16, Elem16::kFloat16>{});
  throw std::invalid_argument("flash_ext: the CUDA kernels take float16 or bfloat16");
}

bool sm90_enabled() { return runtime_settings().sm90_enabled.load(std::memory_order_relaxed); }

template <Elem16 kElem, int kHeadDim>
bool sm90_fwd_applies(const FwdParams& params) {
  if constexpr (kernel_configs::sm90_has_fwd(kHeadDim)) {
    return sm90_enabled() && sm90::fwd_applies<kElem, kHeadDim>(params);
  } else {
    return false;
  }
}

// deterministic = true too: the kernel then orders its dQ additions (common/ordered_dq.cuh).
template <Elem16 kElem, int kHeadDim>
bool sm90_dkdv_applies(const BwdParams& params) {
  if constexpr (kernel_configs::sm90_has_bwd(kHeadDim)) {
    return sm90_enabled() && sm90::bwd_dkdv_applies<kElem, kHeadDim>(params);
  } else {
    return false;
  }
}

template <Elem16 kElem, int kHeadDim>
BwdPlan plan_bwd(const BwdParams& params) {
  BwdPlan plan;
  const bool sm90_dkdv = sm90_dkdv_applies<kElem, kHeadDim>(params);
  // Deterministic: atomics only in the sm90 kernel's fixed order; the sm80 kernels recompute dQ instead.
  plan.dq_by_atomics = !params.deterministic || sm90_dkdv;
  plan.softmax_d_floats =
      int64_t{params.heads_q} * (params.is_varlen() ? params.total_q : int64_t{params.batch} * params.seqlen_q);
  if (!plan.dq_by_atomics) return plan;
  // The fp32 dQ accumulator: per head, q's rows, up to 8 rows of padding per sequence and 128 after the last,
  // times head dim (common/dq_accum_layout.h), followed by the sm90 kernel's per-(batch, kv head) counters of
  // finished walks and its tile counter (one per 128-byte line, kFinishedCounterStride); with it, lse *
  // log2(e) and D again in the accumulator's row numbering (row_stats, what the sm90 dK/dV kernel reads).
  const int64_t query_rows = params.is_varlen() ? params.total_q : int64_t{params.batch} * params.seqlen_q;
  plan.dq_accum_rows = DqAccumLayout::rows_for(query_rows, params.batch);
  plan.dq_accum_floats = int64_t{params.heads_q} * plan.dq_accum_rows * kHeadDim;
  plan.counter_ints = (int64_t{params.batch} * params.heads_kv + 1) * kFinishedCounterStride;
  if (params.deterministic) plan.dq_turn_ints = dq_turn_ints(params.heads_q, plan.dq_accum_rows);
  plan.row_stats_floats = 2 * int64_t{params.heads_q} * plan.dq_accum_rows;
  if (sm90_dkdv) {
    plan.dkdv = DkDvKernel::kSm90;
    return plan;
  }
  sm80::plan_tail_split<kElem, kHeadDim>(params, plan);
  return plan;
}

}  // namespace

void run_attention_fwd(const FwdParams& params, cudaStream_t stream) {
  dispatch_dtype_head_dim(params, [&](auto elem, auto head_dim) {
    constexpr Elem16 kElem = decltype(elem)::value;
    constexpr int kHeadDim = decltype(head_dim)::value;
    if constexpr (kernel_configs::sm90_has_fwd(kHeadDim)) {
      if (sm90_enabled() && sm90::run_attention_fwd<kElem, kHeadDim>(params, stream)) return;
    }
    if (params.keys_in_cache()) throw std::logic_error("flash_ext: keys in a cache reach only the sm90 forward");
    sm80::run_attention_fwd<kElem, kHeadDim>(params, stream);
  });
}

bool run_attention_fwd_keys_in_cache(const FwdParams& params, cudaStream_t stream) {
  if (!sm90_enabled()) return false;
  return dispatch_dtype_head_dim(params, [&](auto elem, auto head_dim) {
    constexpr int kHeadDim = decltype(head_dim)::value;
    if constexpr (kernel_configs::sm90_has_fwd(kHeadDim)) {
      return sm90::run_attention_fwd<decltype(elem)::value, kHeadDim>(params, stream);
    }
    return false;
  });
}

BwdPlan plan_attention_bwd(const BwdParams& params) {
  return dispatch_dtype_head_dim(params, [&](auto elem, auto head_dim) {
    return plan_bwd<decltype(elem)::value, decltype(head_dim)::value>(params);
  });
}

void run_attention_bwd(const BwdParams& params, const BwdPlan& plan, cudaStream_t stream) {
  dispatch_dtype_head_dim(params, [&](auto elem, auto head_dim) {
    constexpr Elem16 kElem = decltype(elem)::value;
    constexpr int kHeadDim = decltype(head_dim)::value;
    sm80::run_attention_bwd_preprocess<kElem, kHeadDim>(params, plan, stream);
    int overlap_keys_per_walk = 0;
    bool dkdv_done = false;
    if constexpr (kernel_configs::sm90_has_bwd(kHeadDim)) {
      if (plan.dkdv == DkDvKernel::kSm90 && sm90::run_attention_bwd_dkdv<kElem, kHeadDim>(params, stream)) {
        dkdv_done = true;
        overlap_keys_per_walk = sm90::bwd_keys_per_walk(kHeadDim);
      }
    }
    // The sm80 kernel: the plan's choice, or where the sm90 kernel's tensor maps failed to encode (then
    // without a tail split, which the plan made no room for; deterministic, with the sm80 dQ kernel, whose
    // sums have one order, rather than the sm80 kernel's unordered atomics).
    if (!dkdv_done && params.deterministic && plan.dq_by_atomics) {
      BwdParams recompute_dq = params;
      recompute_dq.dq_accum = nullptr;
      BwdPlan recompute_plan;
      recompute_plan.softmax_d_floats = plan.softmax_d_floats;
      sm80::run_attention_bwd_dkdv<kElem, kHeadDim>(recompute_dq, recompute_plan, stream);
      sm80::run_attention_bwd_dq<kElem, kHeadDim>(recompute_dq, recompute_plan, 0, stream);
      return;
    }
    if (!dkdv_done) sm80::run_attention_bwd_dkdv<kElem, kHeadDim>(params, plan, stream);
    sm80::run_attention_bwd_dq<kElem, kHeadDim>(params, plan, overlap_keys_per_walk, stream);
  });
}

bool decode_supports(int head_dim) { return kernel_configs::decode_has(head_dim); }

void run_attention_decode(const DecodeParams& params, bool bfloat16, cudaStream_t stream) {
  auto for_dtype = [&](auto elem) {
    switch (params.head_dim) {
#define FLASH_EXT_DECODE_CASE(d)                                                  \
  case d:                                                                         \
    return decode::run_attention_decode<decltype(elem)::value, d>(params, stream);
      FLASH_EXT_DECODE_HEAD_DIMS(FLASH_EXT_DECODE_CASE)
#undef FLASH_EXT_DECODE_CASE
      default:
        throw std::invalid_argument("flash_ext: no decode kernel for head_dim " + std::to_string(params.head_dim));
    }
  };
  if (bfloat16) return for_dtype(std::integral_constant<Elem16, Elem16::kBFloat16>{});
  return for_dtype(std::integral_constant<Elem16, Elem16::kFloat16>{});
}

void run_kv_append(const KvAppendParams& params, bool bfloat16, cudaStream_t stream) {
  if (bfloat16) return decode::run_kv_append<Elem16::kBFloat16>(params, stream);
  decode::run_kv_append<Elem16::kFloat16>(params, stream);
}

std::string describe_kernels(const BwdParams& params) {
  return dispatch_dtype_head_dim(params, [&](auto elem, auto head_dim) {
    constexpr Elem16 kElem = decltype(elem)::value;
    constexpr int kHeadDim = decltype(head_dim)::value;
    const std::string forward =
        sm90_fwd_applies<kElem, kHeadDim>(params) ? "sm90 wgmma + TMA forward" : "sm80 mma.sync forward";
    const std::string backward = sm90_dkdv_applies<kElem, kHeadDim>(params)
                                     ? "sm90 wgmma + TMA dK/dV backward"
                                     : "sm80 mma.sync backward";
    return forward + ", " + backward;
  });
}

}  // namespace flash_ext
