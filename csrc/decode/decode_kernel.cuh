// Split-KV decode: the attention of a few query rows against a long KV cache, a memory-bound problem.
//
// A CTA (4 warps) takes one (split of the keys, kv head, chunk of rows, sequence). Its rows are the query rows
// of all heads_q / heads_kv query heads that share the kv head (GQA packed into mma M tiles of 16 rows), so
// each K / V byte is read once per chunk rather than once per query head; the key splits give every SM work
// when batch x heads_kv alone would not. The keys are copied in slices of 16 by cp.async into a ring of
// shared-memory stages, several slices ahead; the tile math is the training forward's (S = Q·Kᵀ and O += P·V
// on mma.sync, the online softmax in registers). Two shapes (launch.h, row_tiles):
//   - one row tile (decode): warp w copies and scores slices w, w + 4, ... on its own (it synchronises only
//     with itself, so a slow copy holds back one warp, not the CTA); at the end the warps' (O, lse) merge in
//     shared memory;
//   - four row tiles (speculative decoding): each warp copies one slice of a 64-key stage and scores its own
//     row tile against the whole stage (a CTA barrier per stage). On sm90 (kWgmma) the four warps are one
//     warpgroup whose wgmmas read each stage's K and V once (64 x 64 scores from shared Q and K; P from
//     registers against V), where mma.sync's warps each read the whole stage: a quarter of the shared-memory
//     traffic, at wgmma's rate.
// The CTA writes its split's normalised output and lse, or, with one split, the final out and lse;
// attention_decode_combine_kernel merges the splits.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../common/online_softmax.cuh"
#include "../common/ptx.cuh"
#include "../common/smem_rows.cuh"
#include "../common/warp_gemm.cuh"
#include "../sm90/ptx_sm90.cuh"
#include "../sm90/wgmma.cuh"
#include "decode_params.h"
#include "decode_trace.cuh"
#include "launch.h"

namespace flash_ext::decode {

constexpr float kLog2e = 1.4426950408889634f;

// The cache offset (elements) of position `pos` of sequence b, kv head `head`.
__device__ __forceinline__ int64_t cache_offset(const DecodeParams& p, int b, int64_t pos, int head) {
  int64_t base;
  if (p.block_table != nullptr) {
    const int64_t block = p.block_table[b * p.block_table_stride + pos / p.page_size];
    base = block * p.cache_batch_stride + (pos % p.page_size) * p.cache_row_stride;
  } else {
    const int64_t row = p.cache_batch_idx != nullptr ? p.cache_batch_idx[b] : b;
    base = row * p.cache_batch_stride + pos * p.cache_row_stride;
  }
  return base + int64_t{head} * p.cache_head_stride;
}

// A 32-bit read through the read-only path, written as an asm volatile so that it keeps its place among the
// copies' asm (the compiler may not sink it behind them).
__device__ __forceinline__ int load_nc_int(const int32_t* address) {
  int value;
  asm volatile("ld.global.nc.b32 %0, [%1];\n" : "=r"(value) : "l"(address));
  return value;
}

// One warp's copy of keys [first, first + kWarpKeys) of K and V into a stage (rows at or past `end` are
// zero-filled). Lane r < kWarpKeys finds row r's cache offset (through the block table when paged) once;
// the lanes copying a row take it by shuffle. Consecutive lanes copy consecutive 16-byte chunks of a row.
template <typename Element, int kHeadDim, typename Rows>
__device__ __forceinline__ void load_slice(const DecodeParams& p, int b, int kv_head, int64_t key_begin,
                                           int64_t first, int64_t end, uint32_t k_stage, uint32_t v_stage,
                                           int lane) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kLanesPerRow = kChunks < 32 ? kChunks : 32;
  constexpr int kRowsPerPass = 32 / kLanesPerRow;
  const int64_t own_key = first + lane % kWarpKeys;
  const int64_t own_offset = own_key < end ? cache_offset(p, b, key_begin + own_key, kv_head) : 0;
  const Element* k_cache = static_cast<const Element*>(p.k_cache);
  const Element* v_cache = static_cast<const Element*>(p.v_cache);
#pragma unroll
  for (int pass = 0; pass < kWarpKeys / kRowsPerPass; ++pass) {
    const int row = pass * kRowsPerPass + lane / kLanesPerRow;
    const int64_t offset = __shfl_sync(0xffffffff, own_offset, row);
    const bool valid = first + row < end;
#pragma unroll
    for (int c = lane % kLanesPerRow; c < kChunks; c += kLanesPerRow) {
      const uint32_t dst = Rows::offset(row, c * 8);
      cp_async_16(k_stage + dst, k_cache + offset + c * 8, valid);
      cp_async_16(v_stage + dst, v_cache + offset + c * 8, valid);
    }
  }
}

// Zeroes the rows of a slice (keys first ...) at or past `end` that this lane copied by load_slice (the same
// lane -> (row, chunk) map, so what the lane overwrites are its own completed copies): rows copied before the
// sequence's length was known.
template <int kHeadDim, typename Rows>
__device__ __forceinline__ void zero_rows_from(unsigned char* stage, int64_t first, int64_t end, int lane) {
  constexpr int kChunks = kHeadDim / 8;
  constexpr int kLanesPerRow = kChunks < 32 ? kChunks : 32;
  constexpr int kRowsPerPass = 32 / kLanesPerRow;
#pragma unroll
  for (int pass = 0; pass < kWarpKeys / kRowsPerPass; ++pass) {
    const int row = pass * kRowsPerPass + lane / kLanesPerRow;
    if (first + row < end) continue;
#pragma unroll
    for (int c = lane % kLanesPerRow; c < kChunks; c += kLanesPerRow) {
      *reinterpret_cast<uint4*>(stage + Rows::offset(row, c * 8)) = make_uint4(0, 0, 0, 0);
    }
  }
}

// The sm90 tile math of the four-row-tile shape (the CTA's four warps are one warpgroup; tiles of kCtaKeys =
// 64 rows in Swizzle128Regions). Empty where the sm_90a instructions are not compiled: launch_template.cuh
// launches the kWgmma kernel only on sm90 with its sm_90a code present.
// Scores of the CTA's 64 rows against a stage's 64 keys (k-step t: head-dim columns 16t .. 16t + 15, region
// t / 4, 32 bytes per step inside it), waited for.
template <typename Element, int kHeadDim>
__device__ __forceinline__ void scores_wgmma(float (&acc_s)[kCtaKeys / 8][4], uint32_t q_tile, uint32_t k_tile) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const uint64_t q_desc = sm90::swizzle128_descriptor(q_tile, 16), k_desc = sm90::swizzle128_descriptor(k_tile, 16);
  sm90::wgmma_fence();
#pragma unroll
  for (int t = 0; t < kHeadDim / 16; ++t) {
    const uint32_t step = (t / 4) * kCtaKeys * 128 + (t % 4) * 32;
    sm90::Wgmma<Element, kCtaKeys>::template ss<0>(acc_s, sm90::descriptor_plus(q_desc, step),
                                                  sm90::descriptor_plus(k_desc, step), t);
  }
  sm90::wgmma_commit();
  sm90::wgmma_wait<0>();
  sm90::register_fence(acc_s);
#endif
}
// O += P V over a stage (k-step t: keys 16t .. 16t + 15; V MN-major, its 64-column regions kCtaKeys rows
// apart): issued, not waited for (values_wgmma_wait).
template <typename Element, int kHeadDim>
__device__ __forceinline__ void values_wgmma(float (&acc_o)[kHeadDim / 8][4], const uint32_t (&p_frag)[kCtaKeys / 16][4],
                                             uint32_t v_tile) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  const uint64_t v_desc = sm90::swizzle128_descriptor(v_tile, kCtaKeys * 128);
  sm90::wgmma_fence();
#pragma unroll
  for (int t = 0; t < kCtaKeys / 16; ++t) {
    sm90::Wgmma<Element, kHeadDim>::template rs<1>(acc_o, p_frag[t], sm90::descriptor_plus(v_desc, t * 16 * 128), 1);
  }
  sm90::wgmma_commit();
#endif
}
template <int kHeadDim>
__device__ __forceinline__ void values_wgmma_wait(float (&acc_o)[kHeadDim / 8][4]) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  sm90::wgmma_wait<0>();
  sm90::register_fence(acc_o);
#endif
}
// This thread's completed cp.async writes (and plain stores) made visible to wgmma's reads (the async proxy)
// once the CTA has synchronised.
__device__ __forceinline__ void copies_visible_to_wgmma() {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  sm90::fence_async_shared();
#endif
}

template <typename Element, int kHeadDim, int kRowTiles, bool kWgmma>
__global__ void __launch_bounds__(kThreads) attention_decode_kernel(const DecodeParams p) {
  constexpr bool kShared = kRowTiles > 1;  // the warps share each stage (row_tiles() in launch.h)
  static_assert(kRowTiles == 1 || kRowTiles == kWarps, "one row tile, or one per warp");
  static_assert(!kWgmma || kShared, "wgmma: the four-row-tile shape");
  using Rows = std::conditional_t<kWgmma, Swizzle128Regions<kCtaKeys>, SwizzledRows<kHeadDim>>;
#if !(defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL))
  if constexpr (kWgmma) return;  // sm_90a code only (launched on sm90 alone)
#endif
  constexpr int kStages = stages(kHeadDim);
  constexpr int kTileBytes = kCtaKeys * kHeadDim * 2;  // one stage's K (or V)
  constexpr int kQBytes = 16 * kRowTiles * kHeadDim * 2;
  constexpr int kKeys = kShared ? kCtaKeys : kWarpKeys;  // keys a warp scores per step
  constexpr int kNTilesS = kKeys / 8, kNTilesO = kHeadDim / 8;
  // 1024-byte alignment: Swizzle128Regions' tiles (kWgmma) start at multiples of 1024 bytes, as the swizzle
  // descriptors require (the Q tile and a stage's K or V are whole multiples of 1024 bytes).
  extern __shared__ __align__(1024) unsigned char smem[];

  // The combine kernel (a programmatic dependent) may launch now; it waits for this grid to finish.
  allow_dependent_launch();
  trace_stamp(p, kTraceEntry);

  const int split = blockIdx.x, b = blockIdx.z;
  // The sequence's length and start, read first: issued behind the CTA's copies, the read would wait for
  // them (the asm keeps it ahead of the copies' asm).
  const int seqlen_b = p.seqlens != nullptr ? load_nc_int(p.seqlens + b) : 0;
  const int leftpad_b = p.leftpad != nullptr ? load_nc_int(p.leftpad + b) : 0;
  const int kv_head = blockIdx.y / p.row_chunks, chunk = blockIdx.y % p.row_chunks;
  const int group = p.heads_q / p.heads_kv;
  const int row0 = chunk * 16 * kRowTiles;
  const int rows = min(16 * kRowTiles, group * p.seqlen_q - row0);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row_tile = kShared ? warp : 0;  // this warp's 16 rows of the CTA's

  // Row r is query i = (row0 + r) / group of head kv_head * group + (row0 + r) % group.
  auto query_of = [&](int r) { return (row0 + r) / group; };
  auto head_of = [&](int r) { return kv_head * group + (row0 + r) % group; };

  // The Q tile (zero past `rows`, whose results are not written), copied as its own cp.async group ahead of
  // the first K / V slices: waiting for it does not hold back their copies.
  const Element* q = static_cast<const Element*>(p.q);
  for (int index = threadIdx.x; index < 16 * kRowTiles * kHeadDim / 8; index += kThreads) {
    const int r = index / (kHeadDim / 8), c = index % (kHeadDim / 8) * 8;
    const bool valid = r < rows;
    const int64_t row = valid ? (int64_t{b} * p.seqlen_q + query_of(r)) * p.heads_q + head_of(r) : 0;
    cp_async_16(smem_address(smem) + Rows::offset(r, c), q + row * kHeadDim + c, valid);
  }
  cp_async_commit();

  const uint32_t q_tile = smem_address(smem);
  auto k_stage = [&](int step) { return q_tile + kQBytes + (step % kStages) * 2 * kTileBytes; };
  auto v_stage = [&](int step) { return k_stage(step) + kTileBytes; };
  auto own_rows = [&](uint32_t stage) { return stage + Rows::offset(warp * kWarpKeys, 0); };
  // Slice s (keys lo + 16 s ...) is copied by warp s % kWarps into its rows of stage (s / kWarps) % kStages.
  // Steps: a warp's own slices, or (shared) the CTA's stages of kWarps slices.
  int64_t lo = int64_t{split} * p.keys_per_split;
  auto steps_of = [&](int64_t end) {
    const int slices = end > lo ? static_cast<int>((end - lo + kWarpKeys - 1) / kWarpKeys) : 0;
    return kShared ? (slices + kWarps - 1) / kWarps : (slices > warp ? (slices - warp + kWarps - 1) / kWarps : 0);
  };
  auto slice_first = [&](int step) { return lo + int64_t{step * kWarps + warp} * kWarpKeys; };
  int64_t key_begin = 0;
  auto load = [&](int step, int64_t end) {
    // A shared step's slices past `end` are copied as zeros: every warp reads the whole stage.
    load_slice<Element, kHeadDim, Rows>(p, b, kv_head, key_begin, slice_first(step), end, own_rows(k_stage(step)),
                                        own_rows(v_stage(step)), lane);
  };
  auto prologue = [&](int64_t end) {
    const int count = steps_of(end);
#pragma unroll
    for (int step = 0; step < kStages - 1; ++step) {
      if (step < count) load(step, end);
      cp_async_commit();
    }
  };

  // Dense caches with no leftpad and no left window: the split's keys are at known cache positions, so its first
  // slices are copied before cache_seqlens is read (every position below the capacity is memory of the cache),
  // saving a round trip; the rows they hold past the sequence's end are zeroed once its length is known.
  const bool early = p.block_table == nullptr && p.leftpad == nullptr && p.window_left < 0;
  if (early) prologue(min(p.capacity, lo + p.keys_per_split));
  trace_stamp(p, kTraceCopiesIssued);

  // This CTA's keys, sequence-relative (key 0 is cache position leftpad[b]): its split, narrowed to the band
  // of its rows' windows.
  key_begin = leftpad_b;
  const int64_t len_k = (p.seqlens != nullptr ? int64_t{seqlen_b} : p.capacity) + p.seqlen_new - key_begin;
  const int64_t to_diagonal = len_k - p.seqlen_q;  // query i's causal mask ends at key i + to_diagonal
  int64_t hi = min(min(len_k, p.capacity - key_begin), lo + p.keys_per_split);
  if (p.window_left >= 0) lo = max(lo, query_of(0) + to_diagonal - p.window_left);
  if (p.window_right >= 0) hi = min(hi, query_of(rows - 1) + to_diagonal + p.window_right + 1);
  const int steps = steps_of(hi);
  trace_stamp(p, kTraceLengthRead);
  if (!early) prologue(hi);

  // The rows this thread holds in the accumulator layout: lane / 4 and lane / 4 + 8 of its row tile.
  int64_t diagonal[2];
  float slope[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = 16 * row_tile + lane / 4 + 8 * half;
    diagonal[half] = query_of(r) + to_diagonal;
    slope[half] = (p.alibi_slopes != nullptr && r < rows) ? p.alibi_slopes[b * p.alibi_batch_stride + head_of(r)] : 0.f;
  }
  // The window's key bounds common to all of the CTA's rows (its queries' diagonals rise with the row).
  const int64_t lowest_seen = query_of(rows - 1) + to_diagonal - p.window_left;
  const int64_t highest_seen = query_of(0) + to_diagonal + p.window_right;
  // Plain scores stay unscaled (the softmax scale enters through exp2's FFMA); with softcap or ALiBi the
  // modified scores are formed in natural-log units.
  const bool modified = p.softcap > 0.f || p.alibi_slopes != nullptr;
  const float scale_log2 = modified ? kLog2e : p.softmax_scale * kLog2e;
  const float lse_scale = modified ? 1.f : p.softmax_scale;

  float acc_o[1][kNTilesO][4];
#pragma unroll
  for (int nd = 0; nd < kNTilesO; ++nd)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc_o[0][nd][e] = 0.f;
  OnlineSoftmax<1> softmax;
  cp_async_wait<kStages - 1>();  // the Q tile's group (the slices' groups may still be in flight)
  if constexpr (kWgmma) copies_visible_to_wgmma();
  __syncthreads();
  trace_stamp(p, kTraceQLanded);

  uint32_t q_lanes = 0;
  if constexpr (!kWgmma) q_lanes = a_lane_address<Rows>(q_tile, 16 * row_tile, 0);
  for (int step = 0; step < steps; ++step) {
    cp_async_wait<kStages - 2>();  // this thread's copies of `step`
    if (step < 8) trace_stamp(p, kTraceStepLanded + 2 * step);
    if (early && step < kStages - 1 && slice_first(step) + kWarpKeys > hi) {
      zero_rows_from<kHeadDim, Rows>(smem + (own_rows(v_stage(step)) - q_tile), slice_first(step), hi, lane);
    }
    if constexpr (kWgmma) {
      copies_visible_to_wgmma();
      values_wgmma_wait<kHeadDim>(acc_o[0]);  // step - 1's P V, which reads the stage the next copy refills
    }
    // Every copy of `step` landed, and every reader of step - 1's stage, which the next copy refills, is done.
    if constexpr (kShared) {
      __syncthreads();
    } else {
      __syncwarp();
    }
    if (step + kStages - 1 < steps) load(step + kStages - 1, hi);
    cp_async_commit();

    const uint32_t k_tile = kShared ? k_stage(step) : own_rows(k_stage(step));
    const uint32_t v_tile = kShared ? v_stage(step) : own_rows(v_stage(step));
    float acc_s[1][kNTilesS][4];
    if constexpr (kWgmma) {
      scores_wgmma<Element, kHeadDim>(acc_s[0], q_tile, k_tile);
    } else {
#pragma unroll
      for (int nj = 0; nj < kNTilesS; ++nj)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc_s[0][nj][e] = 0.f;
      gemm_smem<Element, 1, kNTilesS, kHeadDim / 16, kRowsAreMN, Rows, kRowsAreMN, Rows>(
          acc_s, q_lanes, b_rows_n_lane_address<Rows>(k_tile, 0, 0));
    }

    const int64_t first = kShared ? lo + int64_t{step} * kCtaKeys : slice_first(step);
    // Plain scores of keys every row of the CTA sees (a decode step's keys short of the sequence's end) need no
    // per-element work.
    const bool all_visible = first + kKeys <= hi && (p.window_left < 0 || first >= lowest_seen) &&
                             (p.window_right < 0 || first + kKeys - 1 <= highest_seen);
    if (modified || !all_visible) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int nj = 0; nj < kNTilesS; ++nj) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int64_t key = first + nj * 8 + 2 * (lane % 4) + e;
            float& s = acc_s[0][nj][2 * half + e];
            if (modified) {
              s *= p.softmax_scale;
              if (p.softcap > 0.f) s = p.softcap * tanhf(s / p.softcap);
              s -= slope[half] * fabsf(static_cast<float>(diagonal[half] - key));
            }
            bool visible = key < hi;
            if (p.window_left >= 0) visible = visible && key >= diagonal[half] - p.window_left;
            if (p.window_right >= 0) visible = visible && key <= diagonal[half] + p.window_right;
            if (!visible) s = -INFINITY;
          }
        }
      }
    }
    softmax.template update<false>(acc_s, acc_o, scale_log2);
    if (step < 8) trace_stamp(p, kTraceStepScored + 2 * step);
    uint32_t p_frag[1][kNTilesS / 2][4];
    accumulator_to_a_fragments<Element>(acc_s, p_frag);
    if constexpr (kWgmma) {
      values_wgmma<Element, kHeadDim>(acc_o[0], p_frag[0], v_tile);
    } else {
      gemm_rs_ab<Element, 1, kNTilesO, kNTilesS / 2, Rows>(acc_o, p_frag, b_rows_k_lane_address<Rows>(v_tile, 0, 0));
    }
  }
  cp_async_wait<0>();
  if constexpr (kWgmma) values_wgmma_wait<kHeadDim>(acc_o[0]);

  trace_stamp(p, kTraceLoopDone);
  float lse[2];
  softmax.finalize(acc_o, lse_scale, lse);

  // Each warp's normalised rows and lse through shared memory (the ring is free once every warp is past it).
  __syncthreads();
  float* o_w = reinterpret_cast<float*>(smem + kQBytes);  // [warp][row][kHeadDim]
  float* lse_w = o_w + kWarps * 16 * kHeadDim;            // [warp][row]
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = lane / 4 + 8 * half;
    float* row = o_w + (warp * 16 + r) * kHeadDim + 2 * (lane % 4);
#pragma unroll
    for (int nd = 0; nd < kNTilesO; ++nd) {
      *reinterpret_cast<float2*>(row + nd * 8) = make_float2(acc_o[0][nd][2 * half], acc_o[0][nd][2 * half + 1]);
    }
    if (lane % 4 == 0) lse_w[warp * 16 + r] = lse[half];
  }
  __syncthreads();
  trace_stamp(p, kTraceRowsShared);

  // Per row, once: its merge weights (one row tile: the warps' parts weighted by exp(lse_w - lse), 0 for an empty
  // row), its lse and where it goes; then each element is a sum over the warps in warp order (bitwise repeatable).
  constexpr int kRows = 16 * kRowTiles;
  float* weight_w = lse_w + kWarps * 16;           // [warp][row]
  float* row_lse = weight_w + kWarps * 16;         // [row]
  int64_t* out_row = reinterpret_cast<int64_t*>(row_lse + kRows);  // [row]: the row of out (and out_partial)
  int64_t* lse_index = out_row + kRows;                            // [row]: its element of lse
  const int64_t rows_all = int64_t{p.batch} * p.seqlen_q * p.heads_q;
  if (threadIdx.x < rows) {
    const int r = threadIdx.x;
    if constexpr (kShared) {  // row r is warp r / 16's alone
      row_lse[r] = lse_w[r];
    } else {
      float lse_max = -INFINITY;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) lse_max = fmaxf(lse_max, lse_w[w * 16 + r]);
      const float base = lse_max == -INFINITY ? 0.f : lse_max;
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += expf(lse_w[w * 16 + r] - base);
      const bool empty = sum == 0.f;  // NaN (a NaN score) is not empty: it propagates
      const float lse_r = empty ? -INFINITY : base + logf(sum);
#pragma unroll
      for (int w = 0; w < kWarps; ++w) weight_w[w * 16 + r] = empty ? 0.f : expf(lse_w[w * 16 + r] - lse_r);
      row_lse[r] = lse_r;
    }
    const int i = query_of(r), h = head_of(r);
    out_row[r] = (int64_t{b} * p.seqlen_q + i) * p.heads_q + h;  // out's row order
    lse_index[r] = (int64_t{b} * p.heads_q + h) * p.seqlen_q + i;
  }
  __syncthreads();
  // Four columns a thread: 16-byte shared reads and partial writes.
  for (int index = threadIdx.x; index < rows * kHeadDim / 4; index += kThreads) {
    const int r = index / (kHeadDim / 4), c = index % (kHeadDim / 4) * 4;
    float4 value;
    if constexpr (kShared) {
      value = *reinterpret_cast<const float4*>(o_w + r * kHeadDim + c);
    } else {
      value = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float weight = weight_w[w * 16 + r];
        const float4 part = *reinterpret_cast<const float4*>(o_w + (w * 16 + r) * kHeadDim + c);
        value.x += weight * part.x;
        value.y += weight * part.y;
        value.z += weight * part.z;
        value.w += weight * part.w;
      }
    }
    const int64_t row = out_row[r];
    if (p.num_splits == 1) {
      Element* out = static_cast<Element*>(p.out) + row * kHeadDim + c;
      out[0] = from_float<Element>(value.x);
      out[1] = from_float<Element>(value.y);
      out[2] = from_float<Element>(value.z);
      out[3] = from_float<Element>(value.w);
      if (c == 0) p.lse[lse_index[r]] = row_lse[r];
    } else {
      *reinterpret_cast<float4*>(p.out_partial + (split * rows_all + row) * kHeadDim + c) = value;
      if (c == 0) p.lse_partial[split * rows_all + row] = row_lse[r];
    }
  }
  trace_stamp(p, kTraceWritten);
}

// Merges the splits of one (sequence, query, head) row per CTA, thread c taking column c: one pass over the splits
// in chunks, each chunk's lse and partial values loaded together (one round trip per chunk, not per split), the
// running sum rescaled when a chunk raises the max; the splits are summed in order (bitwise repeatable). Launched
// as a programmatic dependent of the decode kernel: its CTAs are resident early and wait for that grid to finish.
constexpr int kCombineThreads = 128;

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(kCombineThreads) attention_decode_combine_kernel(const DecodeParams p) {
  constexpr int kChunk = 16;
  constexpr int kCols = (kHeadDim + kCombineThreads - 1) / kCombineThreads;
  trace_combine_stamp(p, 0);
  wait_for_prerequisite_grid();
  trace_combine_stamp(p, 1);
  const int64_t rows_all = int64_t{p.batch} * p.seqlen_q * p.heads_q;
  const int64_t row = blockIdx.x;
  float run_max = -INFINITY, sum = 0.f, value[kCols] = {};
  for (int first = 0; first < p.num_splits; first += kChunk) {
    float lse[kChunk], part[kChunk][kCols];
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const int s = first + j < p.num_splits ? first + j : p.num_splits - 1;
      lse[j] = first + j < p.num_splits ? p.lse_partial[s * rows_all + row] : -INFINITY;
#pragma unroll
      for (int i = 0; i < kCols; ++i) {
        const int c = threadIdx.x + i * kCombineThreads;
        part[j][i] = c < kHeadDim ? p.out_partial[(s * rows_all + row) * kHeadDim + c] : 0.f;
      }
    }
    float chunk_max = run_max;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) chunk_max = fmaxf(chunk_max, lse[j]);
    const float base = chunk_max == -INFINITY ? 0.f : chunk_max;
    const float rescale = expf(run_max - base);  // 0 while nothing was summed
    sum *= rescale;
#pragma unroll
    for (int i = 0; i < kCols; ++i) value[i] *= rescale;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      const float weight = expf(lse[j] - base);
      sum += weight;
#pragma unroll
      for (int i = 0; i < kCols; ++i) value[i] += weight * part[j][i];
    }
    run_max = chunk_max;
  }
  const bool empty = sum == 0.f;  // NaN (a NaN score) is not empty: it propagates
  const float base = run_max == -INFINITY ? 0.f : run_max;
#pragma unroll
  for (int i = 0; i < kCols; ++i) {
    const int c = threadIdx.x + i * kCombineThreads;
    if (c < kHeadDim) static_cast<Element*>(p.out)[row * kHeadDim + c] = from_float<Element>(empty ? 0.f : value[i] / sum);
  }
  if (threadIdx.x == 0) {
    const int64_t h = row % p.heads_q, i = (row / p.heads_q) % p.seqlen_q, b = row / (int64_t{p.heads_q} * p.seqlen_q);
    p.lse[(b * p.heads_q + h) * p.seqlen_q + i] = empty ? -INFINITY : base + logf(sum);
  }
  trace_combine_stamp(p, 2);
}

}  // namespace flash_ext::decode
