// Torch-free description of one decode call (flash_ext.attention_with_kvcache's attention step on CUDA):
// q against each sequence's keys [leftpad[b], seqlens[b] + seqlen_new) of a dense or paged KV cache.
#pragma once

#include <cstdint>

namespace flash_ext {

struct DecodeParams {
  const void* q = nullptr;  // (batch, seqlen_q, heads_q, head_dim), contiguous
  const void* k_cache = nullptr;
  const void* v_cache = nullptr;
  // Cache strides in elements: one step of dimension 0 (a cache row, or a page), of a position, of a head.
  int64_t cache_batch_stride = 0, cache_row_stride = 0, cache_head_stride = 0;
  const int32_t* block_table = nullptr;  // (batch, max_blocks); nullptr: dense cache
  int64_t block_table_stride = 0;
  int page_size = 0;
  const int32_t* cache_batch_idx = nullptr;  // nullptr: row b
  const int32_t* seqlens = nullptr;          // nullptr: capacity (before the new keys)
  const int32_t* leftpad = nullptr;          // nullptr: 0
  int seqlen_new = 0;
  int64_t capacity = 0;  // the most keys a sequence holds

  int batch = 0, seqlen_q = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  float scale_log2 = 0.f;     // softmax_scale * log2(e)
  float softmax_scale = 0.f;
  float softcap = 0.f;        // 0: off
  const float* alibi_slopes = nullptr;
  int64_t alibi_batch_stride = 0;
  int window_left = -1, window_right = -1;  // -1: unbounded; causal: window_right = 0

  int num_splits = 1;
  int64_t keys_per_split = 0;  // a multiple of 32
  int row_chunks = 1;          // CTAs over the packed (query, head of the group) rows of one kv head
  float* out_partial = nullptr;  // [num_splits][batch * seqlen_q * heads_q][head_dim], normalised per split
  float* lse_partial = nullptr;  // [num_splits][batch * seqlen_q * heads_q], natural log; -inf: no key
  void* out = nullptr;           // (batch, seqlen_q, heads_q, head_dim), contiguous
  float* lse = nullptr;          // (batch, heads_q, seqlen_q)
  unsigned long long* trace = nullptr;  // FLASH_EXT_DECODE_TRACE builds: the timeline buffer (decode_trace.cuh)
};

}  // namespace flash_ext
