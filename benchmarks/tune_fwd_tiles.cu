// Times candidate tile geometries of the sm80 forward kernel side by side, without torch:
//   nvcc -std=c++17 -O3 --use_fast_math --expt-relaxed-constexpr \
//        -gencode=arch=compute_90a,code=sm_90a -I csrc benchmarks/tune_fwd_tiles.cu -o /tmp/tune && /tmp/tune
// Shapes follow benchmarks/bench_attention.py: 16k tokens, hidden 2048, bf16. The winning
// geometry per head dim goes into FwdTileFor (csrc/sm80/fwd_tile_config.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "sm80/fwd_kernel.cuh"

using namespace flash_ext;
using Element = __nv_bfloat16;

#define CHECK_CUDA(call)                                                                  \
  do {                                                                                    \
    cudaError_t status_ = (call);                                                         \
    if (status_ != cudaSuccess) {                                                         \
      std::fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(status_)); \
      std::exit(1);                                                                       \
    }                                                                                     \
  } while (0)

__global__ void fill_random(Element* data, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t x = uint32_t(i) * 2654435761u ^ seed;
    x ^= x >> 15; x *= 2246822519u; x ^= x >> 13;
    data[i] = __float2bfloat16((x & 0xffff) / 32768.f - 1.f);
  }
}

struct Problem {
  int head_dim, seqlen;
  bool causal;
};

template <typename Tile>
float time_tile(const Problem& prob, Element* q, Element* k, Element* v, Element* out, float* lse) {
  const int heads = 2048 / prob.head_dim, seqlen = prob.seqlen, batch = 16384 / seqlen;
  FwdParams p;
  p.q = q; p.k = k; p.v = v; p.out = out; p.lse = lse;
  const int64_t row = int64_t(heads) * prob.head_dim;
  p.q_strides = p.k_strides = p.v_strides = p.out_strides = TensorStrides{row * seqlen, row, prob.head_dim};
  p.batch = batch; p.heads_q = p.heads_kv = heads; p.seqlen_q = p.seqlen_k = seqlen; p.head_dim = prob.head_dim;
  p.dtype = DType::kBFloat16;
  p.softmax_scale = 1.f / sqrtf(float(prob.head_dim));
  p.scale_log2 = p.softmax_scale * 1.4426950408889634f;
  p.window_right = prob.causal ? 0 : FwdParams::kUnbounded;  // causal = window (unbounded, 0)

  const auto kernel = sm80::attention_fwd_kernel<Tile, Element, false>;  // plain attention (no softcap / ALiBi / dropout)
  const size_t smem = Tile::kSmemElements * sizeof(Element);
  CHECK_CUDA(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid((seqlen + Tile::kBlockM - 1) / Tile::kBlockM, heads, batch);
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  std::vector<float> ms;
  for (int it = 0; it < 25; ++it) {
    CHECK_CUDA(cudaEventRecord(start));
    kernel<<<grid, Tile::kThreads, smem>>>(p);
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    if (it >= 5) ms.push_back(t);  // first launches warm up
  }
  CHECK_CUDA(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  const double flops = 4.0 * batch * heads * double(seqlen) * seqlen * prob.head_dim / (prob.causal ? 2 : 1);
  return float(flops / (median * 1e-3) / 1e12);
}

template <int kHeadDim, int kBlockM, int kBlockN, int kWarps>
void report(const std::vector<Problem>& problems, Element* q, Element* k, Element* v, Element* out, float* lse) {
  using Tile = sm80::FwdTile<kHeadDim, kBlockM, kBlockN, kWarps>;
  std::printf("hd%-3d M%-3d N%-3d W%d |", kHeadDim, kBlockM, kBlockN, kWarps);
  for (const Problem& prob : problems) {
    if (prob.head_dim != kHeadDim) continue;
    std::printf(" %s%-5d %6.1f |", prob.causal ? "c" : "n", prob.seqlen, time_tile<Tile>(prob, q, k, v, out, lse));
  }
  std::printf("\n");
}

int main() {
  const int64_t elems = int64_t(16384) * 2048;
  Element *q, *k, *v, *out;
  float* lse;
  CHECK_CUDA(cudaMalloc(&q, elems * sizeof(Element)));
  CHECK_CUDA(cudaMalloc(&k, elems * sizeof(Element)));
  CHECK_CUDA(cudaMalloc(&v, elems * sizeof(Element)));
  CHECK_CUDA(cudaMalloc(&out, elems * sizeof(Element)));
  CHECK_CUDA(cudaMalloc(&lse, 16384 * 64 * sizeof(float)));
  fill_random<<<1024, 256>>>(q, elems, 1);
  fill_random<<<1024, 256>>>(k, elems, 2);
  fill_random<<<1024, 256>>>(v, elems, 3);

  std::vector<Problem> problems;
  for (int hd : {64, 128, 256})
    for (bool causal : {false, true})
      for (int seqlen : {2048, 8192}) problems.push_back({hd, seqlen, causal});

  std::printf("TFLOP/s, bf16, 16k tokens, hidden 2048 (n = non-causal, c = causal; number = seqlen)\n");
  report<64, 128, 64, 4>(problems, q, k, v, out, lse);
  report<64, 128, 128, 4>(problems, q, k, v, out, lse);
  report<128, 128, 64, 4>(problems, q, k, v, out, lse);
  report<256, 128, 64, 8>(problems, q, k, v, out, lse);
  report<256, 64, 64, 4>(problems, q, k, v, out, lse);
  report<256, 128, 32, 8>(problems, q, k, v, out, lse);
  return 0;
}
