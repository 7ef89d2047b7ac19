// Torch-free description of one attention call, filled in csrc/flash_api.cpp and read by
// every kernel (CPU and CUDA). Kernel translation units include this header and never
// torch: that keeps each .cu file's compile time to the kernel itself.
//
// Layout conventions (flash-attn's):
//   q, out, dq        (batch, seqlen_q, heads_q,  head_dim)
//   k, v, dk, dv      (batch, seqlen_k, heads_kv, head_dim)
//   lse, softmax_d    (batch, heads_q, seqlen_q), fp32, contiguous
// Strides are in elements and int64 (a (batch * seqlen * heads * head_dim) product can pass
// 2^31). The last dimension is always contiguous (stride 1).
#pragma once

#include <cstdint>

// Helpers below are called from kernels too.
#if defined(__CUDACC__)
#define FLASH_EXT_HOST_DEVICE __host__ __device__
#else
#define FLASH_EXT_HOST_DEVICE
#endif

namespace flash_ext {

enum class DType { kFloat32, kFloat16, kBFloat16 };

// Strides of a 4-D (batch, seqlen, heads, head_dim) tensor whose last dimension is contiguous.
struct TensorStrides {
  int64_t batch = 0;
  int64_t row = 0;   // one step along seqlen
  int64_t head = 0;
};

struct FwdParams {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // (batch, heads_q, seqlen_q), contiguous

  TensorStrides q_strides, k_strides, v_strides, out_strides;

  int batch = 0;
  int heads_q = 0;
  int heads_kv = 0;  // heads_q % heads_kv == 0; query head h reads kv head h / (heads_q / heads_kv)
  int seqlen_q = 0;
  int seqlen_k = 0;
  int head_dim = 0;  // the tensors' head dim (CUDA kernels see it padded to a supported size)

  DType dtype = DType::kFloat16;

  float softmax_scale = 0.f;       // multiplies q.k before the softmax
  float scale_log2 = 0.f;          // softmax_scale * log2(e): kernels use exp2(s * scale_log2 - m)
  bool causal = false;             // bottom-right aligned: query i sees keys j <= i + seqlen_k - seqlen_q

  FLASH_EXT_HOST_DEVICE int heads_per_kv() const { return heads_q / heads_kv; }
  // Causal: the last key that query row `row` may see (can be negative: the row sees nothing).
  FLASH_EXT_HOST_DEVICE int64_t causal_last_key(int64_t row) const { return row + seqlen_k - seqlen_q; }
};

struct BwdParams : FwdParams {
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  TensorStrides dout_strides, dq_strides, dk_strides, dv_strides;

  float* softmax_d = nullptr;  // D = rowsum(dout * out), (batch, heads_q, seqlen_q), fp32 scratch (CUDA)
  // CUDA, deterministic = false: dQ summed with fp32 atomics into this zeroed buffer,
  // (batch, seqlen_q, heads_q, head_dim) contiguous, then scaled and rounded into dq.
  // nullptr: dQ by a separate atomic-free pass.
  float* dq_accum = nullptr;
  bool deterministic = false;
};

}  // namespace flash_ext
