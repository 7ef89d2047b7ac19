// Launch of the decode kernels for one (dtype, head dim); included by the generated translation units in
// csrc/instantiations/.
#pragma once

#include "../common/launch.cuh"
#include "decode_kernel.cuh"
#include "launch.h"

namespace flash_ext::decode {

template <Elem16 kElem, int kHeadDim>
void run_attention_decode(const DecodeParams& params, cudaStream_t stream) {
  using Element = ElementOf<kElem>;
  const int rows = params.heads_q / params.heads_kv * params.seqlen_q;
  const dim3 grid(params.num_splits, params.heads_kv * params.row_chunks, params.batch);
  if (rows_per_cta(rows) == 4) {
    attention_decode_kernel<Element, kHeadDim, 4><<<grid, kThreads, 0, stream>>>(params);
  } else {
    attention_decode_kernel<Element, kHeadDim, 8><<<grid, kThreads, 0, stream>>>(params);
  }
  throw_on_cuda_error(cudaGetLastError(), "launching the decode kernel");
  if (params.num_splits > 1) {
    const int64_t rows_all = int64_t{params.batch} * params.seqlen_q * params.heads_q;
    attention_decode_combine_kernel<Element, kHeadDim>
        <<<static_cast<unsigned>((rows_all + 7) / 8), 256, 0, stream>>>(params);
    throw_on_cuda_error(cudaGetLastError(), "launching the decode combine kernel");
  }
}

}  // namespace flash_ext::decode
