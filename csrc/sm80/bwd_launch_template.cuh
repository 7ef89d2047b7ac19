// Launch of the sm80 backward kernels for one (dtype, head dim); included by the generated
// translation units in csrc/instantiations/.
#pragma once

#include "bwd_kernels.cuh"
#include "launch_common.cuh"

namespace flash_ext::sm80 {

template <Elem16 kElem, int kHeadDim>
void run_attention_bwd(const BwdParams& params, cudaStream_t stream) {
  using Tile = BwdTile<kHeadDim>;
  using Element = ElementOf<kElem>;
  check_grid_limits(params, "backward");

  // 1. D = rowsum(dO ∘ O): one warp per query row, 8 rows per block.
  const int64_t num_rows = static_cast<int64_t>(params.batch) * params.seqlen_q * params.heads_q;
  attention_bwd_preprocess_kernel<kHeadDim, Element>
      <<<static_cast<unsigned>((num_rows + 7) / 8), 256, 0, stream>>>(params);
  throw_on_cuda_error(cudaGetLastError(), "launching the backward preprocess kernel");

  // 2. dK and dV (in two launches above head_dim 128; see BwdTile).
  auto launch_dkdv = [&](auto kernel) {
    set_smem_limit(kernel, Tile::kDkDvSmemBytes, "the dK/dV kernel");
    const dim3 grid((params.seqlen_k + Tile::kBlockKeys - 1) / Tile::kBlockKeys, params.heads_kv, params.batch);
    kernel<<<grid, Tile::kThreads, Tile::kDkDvSmemBytes, stream>>>(params);
    throw_on_cuda_error(cudaGetLastError(), "launching the dK/dV kernel");
  };
  if constexpr (Tile::kSplitDkDv) {
    launch_dkdv(attention_bwd_dkdv_kernel<Tile, KvGrads::kOnlyDv, Element>);
    launch_dkdv(attention_bwd_dkdv_kernel<Tile, KvGrads::kOnlyDk, Element>);
  } else {
    launch_dkdv(attention_bwd_dkdv_kernel<Tile, KvGrads::kBoth, Element>);
  }

  // 3. dQ.
  const auto dq_kernel = attention_bwd_dq_kernel<Tile, Element>;
  set_smem_limit(dq_kernel, Tile::kDqSmemBytes, "the dQ kernel");
  const dim3 grid((params.seqlen_q + Tile::kBlockQueries - 1) / Tile::kBlockQueries, params.heads_q, params.batch);
  dq_kernel<<<grid, Tile::kThreads, Tile::kDqSmemBytes, stream>>>(params);
  throw_on_cuda_error(cudaGetLastError(), "launching the dQ kernel");
}

}  // namespace flash_ext::sm80
