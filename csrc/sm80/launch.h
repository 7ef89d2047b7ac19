// Entry points of the sm80 (mma.sync) kernels, callable from host C++ without CUDA headers beyond the
// runtime API. Each (direction, dtype, head dim) of kernel_configs.h is compiled in its own translation
// unit under csrc/instantiations/ (written by scripts/generate_instantiations.py).
#pragma once

#include <cuda_runtime_api.h>

#include "../bwd_plan.h"
#include "../kernel_configs.h"
#include "../params.h"

namespace flash_ext::sm80 {

// Writes params.out and params.lse.
template <Elem16 kElem, int kHeadDim>
void run_attention_fwd(const FwdParams& params, cudaStream_t stream);

// The sm80 dK/dV kernel's part of the backward's plan (bwd_plan.h): whether and how its tail walks are
// split (plan.tail_split) and the scratch that takes (plan.dkv_accum_floats). Asked only with
// deterministic = false (the pieces add their sums with atomics).
template <Elem16 kElem, int kHeadDim>
void plan_tail_split(const BwdParams& params, BwdPlan& plan);

// The backward's steps (bwd_plan.h), in this order:
// 1. D (params.softmax_d) and row_stats; zeroes the dQ accumulator and its counters.
template <Elem16 kElem, int kHeadDim>
void run_attention_bwd_preprocess(const BwdParams& params, const BwdPlan& plan, cudaStream_t stream);
// 2. dK and dV (and the atomic dQ sums) by the sm80 kernel, where the plan does not take the sm90 one.
template <Elem16 kElem, int kHeadDim>
void run_attention_bwd_dkdv(const BwdParams& params, const BwdPlan& plan, cudaStream_t stream);
// 3. dQ. `overlap_keys_per_walk` > 0: the sm90 dK/dV kernel ran with walks of that many keys, and the dQ
// conversion is launched as its programmatic dependent (common/finished_walks.cuh).
template <Elem16 kElem, int kHeadDim>
void run_attention_bwd_dq(const BwdParams& params, const BwdPlan& plan, int overlap_keys_per_walk,
                          cudaStream_t stream);

}  // namespace flash_ext::sm80
