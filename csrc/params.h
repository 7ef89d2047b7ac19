// Torch-free description of one attention call, filled in csrc/api/params_from_tensors.cpp and read by
// every kernel (CPU and CUDA). Kernel translation units include this header and never
// torch: that keeps each .cu file's compile time to the kernel itself.
//
// Layout conventions (flash-attn's):
//   dense batch (cu_seqlens_q == nullptr)
//     q, out, dq        (batch, seqlen_q, heads_q,  head_dim)
//     k, v, dk, dv      (batch, seqlen_k, heads_kv, head_dim)
//     lse, softmax_d    (batch, heads_q, seqlen_q), fp32, contiguous
//   variable-length batch (cu_seqlens_q != nullptr): the sequences are packed one after another
//     q, out, dq        (total_q, heads_q,  head_dim)   sequence b is rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1
//     k, v, dk, dv      (total_k, heads_kv, head_dim)   likewise with cu_seqlens_k
//     lse, softmax_d    (heads_q, total_q), fp32, contiguous
//     TensorStrides::batch is 0 and seqlen_q / seqlen_k hold the longest sequence (max_seqlen_*).
// Strides are in elements and int64 (a (batch * seqlen * heads * head_dim) product can pass
// 2^31). The last dimension is always contiguous (stride 1).
//
// Within one sequence of len_q queries and len_k keys, every feature uses the same coordinates:
// query row i in 0..len_q-1, key column j in 0..len_k-1, and the diagonal j = i + len_k - len_q
// (bottom-right aligned: the last query faces the last key).
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace flash_ext {

enum class DType { kFloat32, kFloat16, kBFloat16 };

// Strides of a 4-D (batch, seqlen, heads, head_dim) tensor whose last dimension is contiguous.
struct TensorStrides {
  int64_t batch = 0;
  int64_t row = 0;   // one step along seqlen
  int64_t head = 0;
};

// Rows [begin, begin + length) of one sequence in its (packed) tensor.
struct SequenceSpan {
  int64_t begin = 0;
  int64_t length = 0;
};

// A half-open range [begin, end) of key columns or query rows of one sequence; empty when
// begin >= end.
struct IndexRange {
  int64_t begin = 0;
  int64_t end = 0;
  FLASH_EXT_HOST_DEVICE bool empty() const { return begin >= end; }
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

  // ---- Which keys a query sees: a band around the diagonal ----
  // Query i sees key j iff  i + len_k - len_q - window_left <= j <= i + len_k - len_q + window_right,
  // where kUnbounded (-1) lifts that side. Causal is window_right == 0 (params_from_tensors.cpp sets it for
  // causal=True); kernels see only the band (common/band_mask.cuh, the CPU path's visible_keys).
  static constexpr int kUnbounded = -1;
  int window_left = kUnbounded;
  int window_right = kUnbounded;

  // ---- Score modifiers, applied in this order to s = softmax_scale * q.k ----
  float softcap = 0.f;                    // > 0: s = softcap * tanh(s / softcap); 0: off
  // The softcap / ALiBi / dropout forward keeps scores in its own units (sm80/fwd_kernel.cuh): raw q.k, or
  // with softcap tanh(s / softcap). Its softmax multiplies them by fwd_score_scale_log2 (scale_log2, or
  // softcap * log2(e)) and its lse by fwd_score_scale (softmax_scale, or softcap).
  float fwd_score_scale_log2 = 0.f;
  float fwd_score_scale = 0.f;
  const float* alibi_slopes = nullptr;    // fp32; nullptr: off. s -= slope * |i + len_k - len_q - j| with
  int64_t alibi_slopes_batch_stride = 0;  // slope = alibi_slopes[b * batch_stride + h]; stride 0: one slope per head

  // ---- Dropout on the normalised probabilities (see common/philox.h for the random mapping) ----
  float dropout_p = 0.f;           // probability of dropping an element; 0: off
  float dropout_scale = 1.f;       // 1 / (1 - dropout_p): kept probabilities are multiplied by it
  uint32_t dropout_threshold = 0;  // a random word below it drops its element (dropout_drop_threshold)
  uint64_t philox_seed = 0;
  uint64_t philox_offset = 0;
  // CUDA: where seed and offset are only known on the device (CUDA-graph capture, and the backward,
  // which reads the forward's rng_state tensor without a device-to-host copy): the kernels use
  // *philox_seed_ptr and *philox_offset_ptr + philox_offset_intragraph instead of the two values above.
  const int64_t* philox_seed_ptr = nullptr;
  const int64_t* philox_offset_ptr = nullptr;
  uint64_t philox_offset_intragraph = 0;
  int64_t* rng_state_out = nullptr;  // CUDA forward: receives [seed, offset] (the op's rng_state output)

  // ---- Variable-length batches ----
  const int32_t* cu_seqlens_q = nullptr;  // (batch + 1) prefix sums of the query lengths; nullptr: dense
  const int32_t* cu_seqlens_k = nullptr;  // (batch + 1) prefix sums of the key lengths
  // lse / softmax_d of (sequence b, head h, row i of the sequence) is at
  //   b * lse_batch_stride + h * lse_head_stride + query_span(b).begin + i
  int64_t lse_batch_stride = 0;    // dense: heads_q * seqlen_q; varlen: 0
  int64_t lse_head_stride = 0;     // dense: seqlen_q;           varlen: total_q
  int64_t total_q = 0;             // varlen: rows of q (all sequences); dense: unused
  int64_t total_k = 0;             // varlen: rows of k and v

  // ---- Keys read in place from a cache (the sm90 forward only, variable-length q) ----
  // key_lengths != nullptr: k and v are (cache_batch, cache_seqlen, heads_kv, head_dim) caches, not packed rows,
  // and sequence b's keys are its key_lengths[b] keys, key j at position key_starts[b] + j (nullptr: j) of cache
  // row key_rows[b] (nullptr: b). Positions past a sequence's keys are never read into a score or an output:
  // they may hold anything, NaN included. (attention_with_kvcache's prefill: no gather into packed rows.)
  const int32_t* key_lengths = nullptr;
  const int32_t* key_starts = nullptr;
  const int32_t* key_rows = nullptr;
  int64_t cache_batch = 0;
  int64_t cache_seqlen = 0;
  // Paged caches (key_pages != nullptr; then no key_starts or key_rows): k and v are (pages, page_size, heads_kv,
  // head_dim) pools, cache_batch their pages and cache_seqlen page_size, and key j of sequence b is slot
  // j % page_size of page key_pages[b * key_pages_stride + j / page_size].
  const int32_t* key_pages = nullptr;
  int64_t key_pages_stride = 0;

  // The persistent sm90 forward's CTAs take their tiles after the first gridDim.x, ... from this counter, zeroed
  // per call (api/ops_cuda.cpp); nullptr: that kernel is not launched.
  int* tile_counter = nullptr;

  FLASH_EXT_HOST_DEVICE int heads_per_kv() const { return heads_q / heads_kv; }

  FLASH_EXT_HOST_DEVICE bool is_varlen() const { return cu_seqlens_q != nullptr; }
  FLASH_EXT_HOST_DEVICE bool keys_in_cache() const { return key_lengths != nullptr; }
  FLASH_EXT_HOST_DEVICE bool has_dropout() const { return dropout_p > 0.f; }
  // Softcap or ALiBi: the score modifiers, which the sm90 kernels compile in (one instantiation each way).
  FLASH_EXT_HOST_DEVICE bool has_score_mods() const { return softcap > 0.f || alibi_slopes != nullptr; }
  // Softcap, ALiBi or dropout: the "extras" instantiations of the sm80 kernels, which keep the plain
  // kernels' one-FFMA score path free of them.
  FLASH_EXT_HOST_DEVICE bool has_extras() const { return has_score_mods() || has_dropout(); }

  // The query (key) rows of sequence b.
  FLASH_EXT_HOST_DEVICE SequenceSpan query_span(int64_t b) const {
    if (!is_varlen()) return {0, seqlen_q};
    return {cu_seqlens_q[b], static_cast<int64_t>(cu_seqlens_q[b + 1]) - cu_seqlens_q[b]};
  }
  // (Not for keys in a cache: cached_key_span.)
  FLASH_EXT_HOST_DEVICE SequenceSpan key_span(int64_t b) const {
    if (!is_varlen()) return {0, seqlen_k};
    return {cu_seqlens_k[b], static_cast<int64_t>(cu_seqlens_k[b + 1]) - cu_seqlens_k[b]};
  }
  // Keys in a cache: the positions of sequence b's keys in its cache row. A function of its own, so that the
  // kernels that never read a cache (all but the sm90 forward) keep key_span's code: a branch in key_span
  // itself spilled 16 more bytes in the sm90 dK/dV kernel at hd128 (ptxas, sm_90a).
  FLASH_EXT_HOST_DEVICE SequenceSpan cached_key_span(int64_t b) const {
    return {key_starts != nullptr ? key_starts[b] : 0, key_lengths[b]};
  }

  // The keys query `row` sees in a sequence of len_q queries and len_k keys, clamped to
  // [0, len_k). Both ends are non-decreasing in `row`, which is what lets a tiled kernel skip
  // whole tiles outside the band.
  FLASH_EXT_HOST_DEVICE IndexRange visible_keys(int64_t row, int64_t len_q, int64_t len_k) const {
    const int64_t diagonal = row + len_k - len_q;
    int64_t begin = window_left == kUnbounded ? 0 : diagonal - window_left;
    int64_t end = window_right == kUnbounded ? len_k : diagonal + window_right + 1;
    begin = begin < 0 ? 0 : (begin > len_k ? len_k : begin);
    end = end < 0 ? 0 : (end > len_k ? len_k : end);
    return {begin, end};
  }

  // The query rows that see at least one key of [key_begin, key_end) (not empty), clamped to
  // [0, len_q): the inverse of visible_keys.
  FLASH_EXT_HOST_DEVICE IndexRange rows_seeing(int64_t key_begin, int64_t key_end, int64_t len_q,
                                               int64_t len_k) const {
    // Row i sees some key of the range iff its band ends after key_begin and starts before key_end:
    //   i + len_k - len_q + window_right >= key_begin  and  i + len_k - len_q - window_left <= key_end - 1.
    int64_t begin = window_right == kUnbounded ? 0 : key_begin - window_right - len_k + len_q;
    int64_t end = window_left == kUnbounded ? len_q : key_end - 1 + window_left - len_k + len_q + 1;
    begin = begin < 0 ? 0 : (begin > len_q ? len_q : begin);
    end = end < 0 ? 0 : (end > len_q ? len_q : end);
    return {begin, end};
  }

  FLASH_EXT_HOST_DEVICE float alibi_slope(int64_t b, int64_t h) const {
    return alibi_slopes == nullptr ? 0.f : alibi_slopes[b * alibi_slopes_batch_stride + h];
  }

  FLASH_EXT_HOST_DEVICE int64_t lse_index(int64_t b, int64_t h, int64_t row) const {
    return b * lse_batch_stride + h * lse_head_stride + query_span(b).begin + row;
  }
};

// BwdParams::dkdv_finished holds one counter per 128-byte line: thousands of waiting warps poll them, and
// counters sharing a line would share one L2 slice.
constexpr int kFinishedCounterStride = 32;

// The deterministic sm90 dK/dV kernel's turns: one per (query head, 8-row group of the dQ accumulator, column
// half), rounded up to whole 128-byte lines.
constexpr int64_t dq_turn_ints(int heads_q, int64_t dq_accum_rows) {
  const int64_t turns = int64_t{heads_q} * (dq_accum_rows / 8) * 2;
  return (turns + kFinishedCounterStride - 1) / kFinishedCounterStride * kFinishedCounterStride;
}

struct BwdParams : FwdParams {
  const void* dout = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  TensorStrides dout_strides, dq_strides, dk_strides, dv_strides;

  float* softmax_d = nullptr;  // D = rowsum(dout * out), fp32 scratch in lse's layout (CUDA)
  // CUDA, where the plan adds dQ with atomics (bwd_plan.h, dq_by_atomics): summed into this zeroed buffer (tiled:
  // common/dq_accum_layout.h), then scaled and rounded into dq.
  // nullptr: dQ by a separate atomic-free pass.
  float* dq_accum = nullptr;
  int64_t dq_accum_rows = 0;  // its rows per head (DqAccumLayout::rows_for)
  // CUDA, with dq_accum: lse * log2(e) and D per query row in the dQ accumulator's row numbering
  // ([2][heads_q][dq_accum_rows] floats: each sequence's rows 8-aligned, so that the sm90 dK/dV kernel
  // copies a query block's values in one 16-byte-aligned bulk copy); written by the preprocess kernel.
  // Padding rows are left unwritten (the kernel masks them).
  float* row_stats = nullptr;
  // CUDA, with dq_accum: per (batch, kv head), the sm90 dK/dV kernel's finished CTAs (after
  // dq_accum's floats, zeroed with them; one int per 128-byte line, kFinishedCounterStride). Where the
  // sm90 kernel ran, the dQ conversion is launched to overlap its last wave and converts a sequence's rows
  // once all of that sequence's CTAs are counted here (common/finished_walks.cuh); after the sm80 kernel
  // it simply runs after it.
  int* dkdv_finished = nullptr;
  // CUDA, with dq_accum: the sm90 dK/dV kernel's tile counter (its persistent CTAs take tiles
  // gridDim.x, gridDim.x + 1, ... from it); the 128-byte line after dkdv_finished's, zeroed with them.
  int* dkdv_tile_counter = nullptr;
  // CUDA, deterministic = true on the sm90 dK/dV kernel: the turns that order its dQ additions
  // (common/ordered_dq.cuh), dq_turn_ints(...) ints after the tile counter's line, zeroed with it.
  int* dq_turns = nullptr;
  // CUDA, where the backward's plan splits the sm80 dK/dV kernel's tail walks (bwd_plan.h): scratch in which
  // the pieces' fp32 dK and dV sums meet (TailSplit), zeroed by the launcher. nullptr: no split.
  float* dkv_accum = nullptr;
  bool deterministic = false;
  // deterministic = true on the sm90 dK/dV kernel: (batch, kv head) pairs per group of its tile order
  // (BwdWalk::coords_of), set by its launcher.
  int ordered_head_group = 1;
};

// The dK/dV kernel walks, per CTA, one (batch, kv head, key block)'s query blocks (its "walk"); the
// walks are numbered key block fastest, then kv head, then batch. With one CTA per SM, walks beyond the
// last whole wave (the tail) would run alone on a few SMs for a whole walk's time; those are split into
// `pieces` pieces (contiguous runs of the walk's (query head, query block) pairs) run by a second launch,
// whose dK / dV sums meet in BwdParams::dkv_accum. first_walk: the first split walk (INT32_MAX: none).
struct TailSplit {
  int first_walk = 0x7fffffff;
  int pieces = 1;
};

}  // namespace flash_ext
