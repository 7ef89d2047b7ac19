// The in-place append of attention_with_kvcache on CUDA (append_params.h), one kernel for what would otherwise be
// a dozen torch ops (index arithmetic, two index_put_, the rotary's gathers and element-wise steps): a thread per
// element of a new key row (it writes K and V) or of a q row (with rotary). The rotary arithmetic is the CPU path's
// (api/kvcache_common.cpp: x0 * cos - x1 * sin and x0 * sin + x1 * cos in float32, each product rounded, then one
// rounding to the element type), so the CUDA and CPU caches hold the same bits. Positions past the cache (an
// out-of-contract cache_seqlens, block-table entry or cache_batch_idx) are not written.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "../common/launch.cuh"
#include "../common/ptx.cuh"
#include "append_params.h"

namespace flash_ext::decode {

// Element c of row `row` (its elements `stride` apart) rotated at table row `pos`; unchanged past the rotary dim.
template <typename Element>
__device__ __forceinline__ Element rotated(const KvAppendParams& p, const Element* row, int64_t stride, int c,
                                           int64_t pos) {
  const int half = p.rotary_half;
  if (p.cos == nullptr || c >= 2 * half) return row[c * stride];
  // The pair (x0, x1) holding c, and which of the two outputs c is.
  const int pair = p.interleaved ? c / 2 : c % half;
  const bool second = p.interleaved ? c % 2 == 1 : c >= half;
  const int c0 = p.interleaved ? 2 * pair : pair, c1 = p.interleaved ? 2 * pair + 1 : pair + half;
  const float x0 = to_float(row[c0 * stride]), x1 = to_float(row[c1 * stride]);
  const float cos = to_float(static_cast<const Element*>(p.cos)[pos * half + pair]);
  const float sin = to_float(static_cast<const Element*>(p.sin)[pos * half + pair]);
  // Separate roundings (no FMA contraction), as the CPU path's torch ops.
  return from_float<Element>(second ? __fadd_rn(__fmul_rn(x0, sin), __fmul_rn(x1, cos))
                                          : __fsub_rn(__fmul_rn(x0, cos), __fmul_rn(x1, sin)));
}

// Element (b, i, head, 0) of a 4-d tensor.
__device__ __forceinline__ int64_t row_offset(const int64_t* strides, int64_t b, int64_t i, int64_t head) {
  return b * strides[0] + i * strides[1] + head * strides[2];
}

// Element e of a (batch, seqlen, heads, head_dim) row-major index space, and sequence b's cache position for its
// i-th row: cache_seqlens[b] + i.
struct AppendElement {
  int b, i, head, c;
  __device__ __forceinline__ AppendElement(int64_t e, int seqlen, int heads, int head_dim) {
    c = static_cast<int>(e % head_dim);
    int64_t rest = e / head_dim;
    head = static_cast<int>(rest % heads);
    rest /= heads;
    i = static_cast<int>(rest % seqlen);
    b = static_cast<int>(rest / seqlen);
  }
  __device__ __forceinline__ int64_t position(const KvAppendParams& p, int offset) const {
    return (p.seqlens != nullptr ? int64_t{p.seqlens[b]} : p.capacity) + offset;
  }
};

constexpr int kAppendThreads = 256;

template <typename Element>
__global__ void __launch_bounds__(kAppendThreads) kv_append_kernel(const KvAppendParams p) {
  const int64_t key_elements = int64_t{p.batch} * p.seqlen_new * p.heads_kv * p.head_dim;
  const int64_t q_elements = p.q != nullptr ? int64_t{p.batch} * p.seqlen_q * p.heads_q * p.head_dim : 0;
  for (int64_t e = blockIdx.x * int64_t{kAppendThreads} + threadIdx.x; e < key_elements + q_elements;
       e += int64_t{gridDim.x} * kAppendThreads) {
    if (e < key_elements) {
      const AppendElement x(e, p.seqlen_new, p.heads_kv, p.head_dim);
      const int b = x.b, i = x.i, head = x.head, c = x.c;
      const int64_t pos = x.position(p, i);
      if (pos < 0 || pos >= p.capacity) continue;
      int64_t slab, slot;  // the cache's index in dimensions 0 and 1
      if (p.block_table != nullptr) {
        slab = p.block_table[b * p.block_table_stride + pos / p.page_size];
        slot = pos % p.page_size;
      } else {
        slab = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
        slot = pos;
      }
      if (slab < 0 || slab >= p.cache_rows) continue;
      const Element* k_row = static_cast<const Element*>(p.k_new) + row_offset(p.k_new_strides, b, i, head);
      const Element* v_row = static_cast<const Element*>(p.v_new) + row_offset(p.v_new_strides, b, i, head);
      static_cast<Element*>(p.k_cache)[row_offset(p.k_cache_strides, slab, slot, head) + c * p.k_cache_strides[3]] =
          rotated(p, k_row, p.k_new_strides[3], c, pos);
      static_cast<Element*>(p.v_cache)[row_offset(p.v_cache_strides, slab, slot, head) + c * p.v_cache_strides[3]] =
          v_row[c * p.v_new_strides[3]];
    } else {
      const int64_t f = e - key_elements;
      const AppendElement x(f, p.seqlen_q, p.heads_q, p.head_dim);
      const int b = x.b, i = x.i, head = x.head, c = x.c;
      int64_t pos = x.position(p, p.q_positions_advance ? i : 0);
      pos = pos < 0 ? 0 : pos >= p.seqlen_ro ? p.seqlen_ro - 1 : pos;  // out of contract: any row of the table
      const Element* q_row = static_cast<const Element*>(p.q) + row_offset(p.q_strides, b, i, head);
      static_cast<Element*>(p.q_out)[f] = rotated(p, q_row, p.q_strides[3], c, pos);
    }
  }
}

// Writes the new keys and values into the caches (and q rotated into q_out, where p.q is given).
template <Elem16 kElem>
void run_kv_append(const KvAppendParams& params, cudaStream_t stream) {
  using Element = ElementOf<kElem>;
  const int64_t elements = int64_t{params.batch} * params.seqlen_new * params.heads_kv * params.head_dim +
                           (params.q != nullptr ? int64_t{params.batch} * params.seqlen_q * params.heads_q * params.head_dim : 0);
  if (elements == 0) return;
  const int64_t blocks = (elements + kAppendThreads - 1) / kAppendThreads;
  const int max_blocks = current_device_info().num_sms * (2048 / kAppendThreads);  // a full wave; the rest loop
  const unsigned grid = static_cast<unsigned>(blocks < max_blocks ? blocks : max_blocks);
  launch_kernel(&kv_append_kernel<Element>, dim3(grid), dim3(kAppendThreads), 0, stream, false,
                "launching the KV-cache append kernel", params);
}

}  // namespace flash_ext::decode
