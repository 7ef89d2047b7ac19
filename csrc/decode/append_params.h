// Torch-free description of the in-place append of flash_ext.attention_with_kvcache on CUDA: the new keys and
// values written into the cache at positions cache_seqlens[b] + i (through the block table when paged), with the
// rotary embedding applied to them and to q where rotary_cos / rotary_sin are given.
#pragma once

#include <cstdint>

namespace flash_ext {

struct KvAppendParams {
  // Strides are in elements, one per dimension.
  // The new keys and values (batch, seqlen_new, heads_kv, head_dim).
  const void* k_new = nullptr;
  const void* v_new = nullptr;
  int64_t k_new_strides[4] = {}, v_new_strides[4] = {};
  // The caches, dense (batch_cache, capacity, heads_kv, head_dim) or paged (num_pages, page_size, ...).
  void* k_cache = nullptr;
  void* v_cache = nullptr;
  int64_t k_cache_strides[4] = {}, v_cache_strides[4] = {};
  int64_t cache_rows = 0;         // size(0): cache rows, or pages
  const int32_t* block_table = nullptr;  // (batch, max_blocks); nullptr: dense
  int64_t block_table_stride = 0;
  int page_size = 0;
  const int32_t* cache_batch_idx = nullptr;  // nullptr: row b
  const int32_t* seqlens = nullptr;          // nullptr: every sequence is full (then nothing fits)
  int64_t capacity = 0;                      // the most keys a sequence holds
  int batch = 0, seqlen_new = 0, heads_kv = 0, head_dim = 0;

  // Rotary (cos == nullptr: none): (seqlen_ro, rotary_dim / 2) tables, contiguous.
  const void* cos = nullptr;
  const void* sin = nullptr;
  int64_t seqlen_ro = 0;
  int rotary_half = 0;  // rotary_dim / 2
  bool interleaved = true;
  // q rotated into q_out (batch, seqlen_q, heads_q, head_dim), contiguous; query i at cache_seqlens[b] + i when
  // q_positions_advance, else at cache_seqlens[b]. q == nullptr: q is not rotated.
  const void* q = nullptr;
  int64_t q_strides[4] = {};
  void* q_out = nullptr;
  int seqlen_q = 0, heads_q = 0;
  bool q_positions_advance = false;
};

}  // namespace flash_ext
