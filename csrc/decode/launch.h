// Entry point of the decode kernels (decode_kernel.cuh), callable from host C++. Each (dtype, head dim) of
// kernel_configs.h's decode list is compiled in its own translation unit under csrc/instantiations/.
#pragma once

#include <cuda_runtime_api.h>

#include "../kernel_configs.h"
#include "decode_params.h"

namespace flash_ext::decode {

// Rows of one kv head's packed query rows a CTA takes (the kernel's kRows), by the rows there are.
constexpr int rows_per_cta(int rows) { return rows <= 4 ? 4 : 8; }

// Writes params.out and params.lse (through out_partial / lse_partial when num_splits > 1).
template <Elem16 kElem, int kHeadDim>
void run_attention_decode(const DecodeParams& params, cudaStream_t stream);

}  // namespace flash_ext::decode
