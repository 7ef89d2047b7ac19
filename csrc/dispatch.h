// From a filled-in params struct to the kernels: which family and instantiation runs a call, and the
// backward's plan (bwd_plan.h). Host-only and torch-free; called by api/ops_cuda.cpp. The head dims and
// families come from kernel_configs.h.
#pragma once

#include <cuda_runtime_api.h>

#include <string>

#include "bwd_plan.h"
#include "decode/append_params.h"
#include "decode/decode_params.h"
#include "params.h"

namespace flash_ext {

// Writes params.out and params.lse with the sm90 forward where it applies, else the sm80 one.
// params.keys_in_cache() is not for this one.
void run_attention_fwd(const FwdParams& params, cudaStream_t stream);

// The forward of a variable-length q over keys read in place from a cache (params.keys_in_cache()): the sm90
// kernel where it applies; false (nothing launched) otherwise, and the caller gathers the keys instead.
bool run_attention_fwd_keys_in_cache(const FwdParams& params, cudaStream_t stream);

// Every decision of a backward call (bwd_plan.h). params holds the tensors (q, k, v, out, dout, dq, dk,
// dv, lse) and options; its scratch pointers are not read.
BwdPlan plan_attention_bwd(const BwdParams& params);

// Runs the plan's three steps. params' scratch pointers are those the plan sized.
void run_attention_bwd(const BwdParams& params, const BwdPlan& plan, cudaStream_t stream);

// Whether the decode kernel has an instantiation for this head dim (kernel_configs.h).
bool decode_supports(int head_dim);
// Runs the decode kernels (decode/launch.h) for params.head_dim; `bfloat16` picks the element type.
void run_attention_decode(const DecodeParams& params, bool bfloat16, cudaStream_t stream);

// Writes attention_with_kvcache's new keys and values into the caches (rotary applied to them and to q where
// params.cos is given; decode/append_kernel.cuh); `bfloat16` picks the element type.
void run_kv_append(const KvAppendParams& params, bool bfloat16, cudaStream_t stream);

// Which kernels the forward and the backward of this call take, in words (flash_ext.kernel_path).
std::string describe_kernels(const BwdParams& params);

}  // namespace flash_ext
