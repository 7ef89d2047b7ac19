// Hopper (sm_90a) dK/dV kernel of the backward: TMA loads and asynchronous warpgroup MMA (wgmma).
// It replaces the sm80 dK/dV kernel (sm80/bwd_dkdv_kernel.cuh) where it takes the call; the preprocess
// (D, the zeroed fp32 dQ accumulator, params.row_stats) and the dQ conversion are the sm80 launcher's.
//
// A CTA owns kBlockN = 128 keys of one (batch, kv head), 64 per warpgroup (wgmma's M), keeps K and V in
// shared memory, and walks the query blocks of kBlockM = 64 rows (128 at head_dim 64; of every query head
// of its GQA group) that can see its keys. Per query block (step), each warpgroup:
//   Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (wgmma, all from shared memory: keys x queries, so each warp's 16 key rows
//     are in the mma.sync accumulator layout, as in the sm80 kernel's phase 1), wait;
//   Pᵀ = exp2(Sᵀ scale log2(e) - lse log2(e)) and dSᵀ = Pᵀ ∘ (dPᵀ - D) (with softcap's factor, the
//     band mask) in registers, stored in 16 bits to shared memory (stmatrix);
//   dV += Pᵀ dO and dK += dSᵀ Q (wgmma, A = its own 64 rows of the stored Pᵀ / dSᵀ, B = dO / Q), issued
//     with the next step's Sᵀ / dPᵀ and completing during the next step's element-wise work; at head_dim 64
//     and hd128 instead A = Pᵀ / dSᵀ from registers, issued at once and completing in the step
//     (BwdSm90Tile::kGradsFromRegisters, kStepsInOrder), with only dSᵀ stored;
//   dQ = dS K for half of the head dim (A = dS read transposed from the stored dSᵀ of both warpgroups,
//     handed over by named barriers, B = K), waited for at the start of the next step and added to the
//     fp32 dQ accumulator with 16-byte atomics (common/dq_accum_layout.h).
// Q, dO and the block's lse log2(e) / D arrive by TMA in one of kStages buffers.
// Persistent (plain attention; BwdSm90Tile::kPersistent): one CTA per SM takes tiles (BwdWalk) from a counter
// until none is left, warp-specialised as FlashAttention-3: a producer warpgroup (registers given to the
// other two, setmaxnreg) issues every TMA load, waiting until the consumers released the buffer (named
// barriers for the query buffers and the next tiles' slots, mbarriers for K and V), and runs ahead across walk
// boundaries: it takes the next tile once it has issued this walk's last
// query block (about kStages steps before the walk ends), loads the next walk's first query block as soon as
// a buffer is free, its V once the last dPᵀ completed and its K once the last dQ did. So the next walk's
// operands are landing while the consumers finish this walk and store its dK / dV. (Issued by a consumer after
// the walk's last wgmma, the ~26 loads would put ~3400 cycles on the staging's critical path and their ~7500
// cycles of latency on the walk boundary: H200, hd128, 2026-12-01.)
// Otherwise (softcap / ALiBi / dropout, short of registers for 240 each) a CTA per walk of 8 warps: thread 0
// issues K, V and the first blocks, and the last of the 8 warps done with a buffer reloads it.
// Shared tiles are in the 128-byte swizzled layout (ptx_sm90.cuh, swizzle128_descriptor).
#pragma once

#include <cuda.h>  // CUtensorMap (a type only)

#include <cstdint>

#include "../common/band_mask.cuh"
#include "../common/dq_accum_layout.h"
#include "../common/dropout_bits.cuh"
#include "../common/finished_walks.cuh"
#include "../common/ordered_dq.cuh"
#include "../common/ptx.cuh"
#include "../common/score_mod.cuh"
#include "../common/warp_gemm.cuh"
#include "../params.h"
#include "ptx_sm90.cuh"
#include "wgmma.cuh"

namespace flash_ext::sm90 {

// TMA descriptors of q and dout (boxes of 64 columns x kBlockM rows) and of k and v (x kBlockN rows); the
// same 4-D (head_dim, rows, heads, batch) view as the forward's (a variable-length batch: batch 1). dk and
// dv (as k and v) where grads_by_tma: the launcher could describe them (BwdSm90Tile::kGradsByTma).
struct BwdTensorMaps {
  CUtensorMap q, dout, k, v, dk, dv;
  bool grads_by_tma;
};

// How the two warpgroups share a step's work (wgmma's M is 64 rows; a warpgroup's dK and dV accumulators,
// 64 keys x kGradCols, take kGradCols registers per thread):
//   head_dim <= 128: each owns 64 of the CTA's 128 keys: its rows of Sᵀ / dPᵀ over all kBlockM queries,
//     its rows of dK / dV over the whole head dim;
//   head_dim 256 (kSplitHeadDim): both work on the CTA's 64 keys; each computes Sᵀ / dPᵀ for half of the
//     queries, and dK / dV for half of the head dim (so each needs the other's Pᵀ / dSᵀ).
// Either way each computes half of dQ from both warpgroups' dSᵀ: half of the head dim (kDqCols), or at
// head_dim 64, whose steps have 128 queries (kDqSplitRows), half of the queries over the whole head dim.
template <int kHeadDim_, bool kExtras>
struct BwdSm90Tile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kSplitHeadDim = kHeadDim > 128;
  static constexpr int kBlockN = kSplitHeadDim ? 64 : 128;  // keys per CTA
  // Queries per step: 128 at head_dim 64, where 64-query steps gave each GEMM half of hd128's work for the
  // same element-wise work per warpgroup; not in the softcap / ALiBi / dropout variants, which spill 140 /
  // 1184 bytes with it (ptxas, sm_90a).
  static constexpr int kBlockM = kHeadDim == 64 && !kExtras ? 128 : 64;
  static constexpr bool kDqSplitRows = kBlockM == 128;  // each warpgroup's dQ: 64 queries x the head dim
  // Persistent CTAs (one per SM, walks from a counter) for plain attention; the softcap / ALiBi / dropout
  // variants, short of registers, keep a CTA per walk: persistent, they spill more (hd128 dropout 100 ->
  // 172 B) and run no faster (softcap, ALiBi) or 8-11% slower (dropout) at 8k (H200, 2026-12-01).
  static constexpr bool kPersistent = !kExtras;
  // The consumers (two warpgroups); the persistent kernel adds a producer warpgroup (threads 256 .. 383).
  static constexpr int kWarps = 8;
  static constexpr int kConsumerThreads = kWarps * 32;
  static constexpr int kThreads = kConsumerThreads + (kPersistent ? 128 : 0);
  // setmaxnreg: 24 x 128 + 240 x 256 = 64512 of the SM's 65536 registers (the launch gives 168 each).
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static constexpr int kScoreQueries = kSplitHeadDim ? kBlockM / 2 : kBlockM;  // a warpgroup's Sᵀ columns
  static constexpr int kGradCols = kSplitHeadDim ? kHeadDim / 2 : kHeadDim;    // its dK / dV columns
  static constexpr int kColumnRegions = kHeadDim / 64;  // 64 16-bit columns = one 128-byte row
  static constexpr int kDqCols = kDqSplitRows ? kHeadDim : kHeadDim / 2;  // dQ columns per warpgroup
  static constexpr int kKvBytes = kBlockN * kHeadDim * 2;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;  // a Q or dO tile
  // Pᵀ or dSᵀ: kBlockN key rows of kBlockM queries, in 64-query regions (128-byte rows).
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;
  static constexpr int kStatBytes = kBlockM * 4;          // a block's lse log2(e), or its D
  // Query-block buffers: step i's buffer is released in step i + 1, once its dV / dK (the last GEMMs
  // reading it) completed, and the reload has the rest of step i + 1 and step i + 2 to land (a step takes
  // ~2.5 us at hd128, a TMA load ~1 us). Three where K, V, three Q / dO buffers and two each of Pᵀ / dSᵀ fit
  // in 224 KB (hd128: 64 + 3 x 32 + 2 x 2 x 16 KB; hd64 with 64-query steps: 144 KB), else two (hd256: 64 +
  // 2 x 64 + 2 x 2 x 8 KB; hd64 with 128-query steps: 32 + 2 x 32 + 2 x 2 x 32 KB).
  static constexpr int kStages = 2 * kKvBytes + 3 * 2 * kQBytes + 4 * kDsBytes <= 224 * 1024 ? 3 : 2;
  // K, V, Q[stage], dO[stage], dSᵀ[2], Pᵀ[2], lse[stage], D[stage], the mbarriers (K and V full, Q full
  // [stage]; persistent: K empty, V empty, and per dQ part the turn keeper's turn granted[2] and dQ added[2]), the
  // release counters and the
  // next tiles' slots, from the 1024-byte aligned base (the swizzle is computed from absolute addresses).
  static constexpr int kVOffset = kKvBytes;
  static constexpr int kQOffset = 2 * kKvBytes;
  static constexpr int kDoutOffset = kQOffset + kStages * kQBytes;
  static constexpr int kDsOffset = kDoutOffset + kStages * kQBytes;
  static constexpr int kPOffset = kDsOffset + 2 * kDsBytes;
  static constexpr int kLseOffset = kPOffset + 2 * kDsBytes;
  static constexpr int kDOffset = kLseOffset + kStages * kStatBytes;
  static constexpr int kBarrierOffset = kDOffset + kStages * kStatBytes;
  static constexpr int kBarriers = 1 + kStages + (kPersistent ? 2 + 8 : 0);
  static constexpr int kCounterOffset = kBarrierOffset + 8 * kBarriers;
  static constexpr int kNextTileOffset = kCounterOffset + 4 * kStages;  // 2 ints (persistent CTAs' next tiles)
  static constexpr int kSmemBytes = kNextTileOffset + 8;
  // dK and dV leave through shared memory and TMA stores: 16-bit tiles in the Pᵀ / dSᵀ buffers (free between
  // walks: dK over the two dSᵀ buffers, dV over the two Pᵀ ones, in K's layout). Stored from registers
  // instead (4-byte stores, 8 rows x 16 bytes per warp instruction), they cost ~5 us per walk at hd128,
  // ~76 us of a window (1024, 0) backward (H200, 16k, 2026-12-01, beside a build without stores). Not at hd256,
  // whose 64 KB of dK / dV exceed the 32 KB of those buffers.
  static constexpr int kGradBytes = kBlockN * kHeadDim * 2;  // dK or dV of the CTA's keys, 16 bits
  // At head_dim 64: dV += Pᵀ dO and dK += dSᵀ Q with Pᵀ / dSᵀ from registers (wgmma's A operand in the
  // accumulator's layout: a warpgroup's 64 key rows are its own), issued and completed within the step that
  // formed them, the next step's Sᵀ / dPᵀ issued beside dQ: no Pᵀ store and no A reads from shared memory, 48
  // of the ~190 KB a warpgroup's step moves through it; bwd +11-16% (H200, 2026-12-03). At hd128 this schedule
  // measured flat to -2% (dV / dK no longer overlap the element-wise work); hd128 runs its own (kStepsInOrder
  // in the kernel), which at hd64 measured flat again. Not at hd256, where each warpgroup's dK / dV need the
  // other's Pᵀ / dSᵀ.
  static constexpr bool kGradsFromRegisters = kHeadDim == 64;
  static constexpr bool kGradsByTma = kGradBytes <= 2 * kDsBytes;
  static_assert(kSmemBytes <= 227 * 1024, "the sm90 dK/dV kernel's shared memory exceeds a CTA's 227 KB");
  // dQ's B operand (K, MN-major) is kDqCols columns inside one 64-column region, or whole regions.
  static_assert(kHeadDim == 64 || kHeadDim == 128 || kHeadDim == 256, "the sm90 backward's head dims");
};

// One tile of the dK/dV kernel: the keys key_block kBlockN .. + kBlockN - 1 of one (batch, kv head), walked
// over the (query head of the GQA group, query block) pairs, head-major, of the query blocks holding a row
// that sees one of them. Tiles are numbered key block fastest, then kv head, then batch: the order in which
// the dQ conversion expects sequences to finish (common/finished_walks.cuh); deterministic, in groups of
// (batch, kv head) pairs instead (coords_of), whose sequences finish later.
template <typename Tile, bool kOrdered>
struct BwdWalk {
  int key_block, kv_head, batch;
  SequenceSpan q_span, k_span;
  int len_q, len_k;
  BandMask band;
  int first_key;
  bool has_keys;  // false: past this sequence's keys (a variable-length batch): nothing to compute or write
  int valid_keys;
  int first_query_block, blocks_per_head, num_steps;
  int previous_first_block = 0, previous_blocks = 0;  // ordered: query_blocks_seeing(key_block + 1)
  int walk_rotation;
  int heads_per_kv;
  int64_t sequence_accum_row;  // row 0 of this sequence in the dQ accumulator's and row_stats' numbering

  // The (key block, kv head, batch) of `tile`. Unordered: key block fastest, then kv head, then batch.
  // Ordered (deterministic): the (batch, kv head) pairs in groups of params.ordered_head_group (the launcher's
  // ordered_tile_group_width), a group's tiles taking key blocks from the last one down, pair fastest. A walk
  // waits at each query block for the walk of the key block above it (common/ordered_dq.cuh), which was taken
  // a group's width of tiles before it: taken together (width 1), a head's walks trail one another in a chain
  // of waits; deterministic bwd at width 1 was 0.50-0.75x the default at hd256 and at hd64 without a mask.
  struct Coords {
    int key_block, kv_head, batch;
  };
  __device__ __forceinline__ static Coords coords_of(int tile, int key_blocks, const BwdParams& params) {
    if constexpr (kOrdered) {
      const int pairs = params.heads_kv * params.batch;
      const int group_width = params.ordered_head_group;
      const int group = tile / (key_blocks * group_width);
      const int in_group = tile - group * key_blocks * group_width;
      const int width = min(group_width, pairs - group * group_width);
      const int pair = group * group_width + in_group % width;
      return {key_blocks - 1 - in_group / width, pair % params.heads_kv, pair / params.heads_kv};
    } else {
      return {tile % key_blocks, tile / key_blocks % params.heads_kv, tile / key_blocks / params.heads_kv};
    }
  }
  __device__ __forceinline__ BwdWalk(const BwdParams& params, int tile, int key_blocks)
      : BwdWalk(params, coords_of(tile, key_blocks, params)) {}
  __device__ __forceinline__ BwdWalk(const BwdParams& params, Coords coords)
      : key_block(coords.key_block),
        kv_head(coords.kv_head),
        batch(coords.batch),
        q_span(params.query_span(batch)),
        k_span(params.key_span(batch)),
        len_q(static_cast<int>(q_span.length)),
        len_k(static_cast<int>(k_span.length)),
        band(params, len_q, len_k) {
    first_key = key_block * Tile::kBlockN;
    has_keys = first_key < len_k;
    valid_keys = has_keys ? min(Tile::kBlockN, len_k - first_key) : 0;
    query_blocks_seeing(key_block, first_query_block, blocks_per_head);
    if (kOrdered) query_blocks_seeing(key_block + 1, previous_first_block, previous_blocks);
    heads_per_kv = params.heads_per_kv();
    num_steps = heads_per_kv * blocks_per_head;
    // At head_dim 256 each walk starts at a different query block (rotated by its key block), so that the
    // walks of one head do not add into the same dQ rows at the same time (in order, the 128 walks of a head
    // at 8k all visit query block 0, then 1, ..., and a step adds twice hd128's dQ bytes per FLOP). H200, bf16,
    // 2k / 8k / 16k, 2026-11-30: hd256 +16 / +9 / +11%, causal -1.5 / +6 / +13%; hd64 -1%, hd128 -2 to +1%
    // (left unrotated).
    // Not when deterministic: the order of common/ordered_dq.cuh relies on walks starting at their first block.
    walk_rotation = blocks_per_head > 0 && !kOrdered ? key_block % blocks_per_head : 0;
    sequence_accum_row =
        DqAccumLayout::first_row(params.is_varlen() ? q_span.begin : int64_t{batch} * params.seqlen_q, batch);
  }
  // The query blocks [first, first + count) of a head holding a row that sees one of key block `block`'s keys
  // (none past the sequence's keys).
  __device__ __forceinline__ void query_blocks_seeing(int block, int& first, int& count) const {
    const int block_first_key = block * Tile::kBlockN;
    const int block_keys = block_first_key < len_k ? min(Tile::kBlockN, len_k - block_first_key) : 0;
    const int row_begin = min(len_q, band.first_row_seeing(block_first_key));
    const int64_t rows_seeing_end = band.end_row_seeing(block_first_key + block_keys);
    const int row_end = rows_seeing_end < len_q ? static_cast<int>(rows_seeing_end) : len_q;
    first = row_begin / Tile::kBlockM;
    count = block_keys > 0 && row_end > row_begin ? (row_end + Tile::kBlockM - 1) / Tile::kBlockM - first : 0;
  }
  // Ordered: the turn this walk waits for at step i's query block (common/ordered_dq.cuh): key block
  // key_block + 1's, where that walk sees the block, else none (0); and the turn it passes on.
  __device__ __forceinline__ int awaited_dq_turn(int i) const {
    const int block = first_query_block + i % blocks_per_head;
    return block >= previous_first_block && block < previous_first_block + previous_blocks ? key_block + 2 : 0;
  }
  __device__ __forceinline__ int passed_dq_turn() const { return key_block + 1; }
  __device__ __forceinline__ int head(int i) const { return kv_head * heads_per_kv + i / blocks_per_head; }
  __device__ __forceinline__ int first_query(int i) const {
    int block = i % blocks_per_head;
    if constexpr (Tile::kSplitHeadDim) {
      block += walk_rotation;
      if (block >= blocks_per_head) block -= blocks_per_head;
    }
    return (first_query_block + block) * Tile::kBlockM;
  }
};

// kExtras: softcap and ALiBi (common/score_mod.cuh); kDropout (implies kExtras): dropout too, the keep
// bits regenerated from the forward's Philox stream (common/dropout_bits.cuh), a variant of its own as in
// the forward. kOrderedDq (deterministic = true): dQ added in the fixed order of common/ordered_dq.cuh; the
// persistent kernel's turns are kept by the producer warpgroup's second warp (the turn keeper), the per-walk
// kernel's by each consumer warp.
template <typename Element, int kHeadDim, bool kExtras, bool kDropout, bool kOrderedDq>
__global__ void __launch_bounds__(BwdSm90Tile<kHeadDim, kExtras>::kThreads, 1)
    attention_bwd_dkdv_sm90_kernel(const __grid_constant__ BwdParams params, const __grid_constant__ BwdTensorMaps maps) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tile = BwdSm90Tile<kHeadDim, kExtras>;
  using Walk = BwdWalk<Tile, kOrderedDq>;
  constexpr bool kPersistent = Tile::kPersistent;
  constexpr bool kTurnKeeper = kOrderedDq && kPersistent;
  static_assert(kExtras || !kDropout, "the dropout variant includes softcap and ALiBi");
  constexpr int kBlockM = Tile::kBlockM;
  constexpr int kBlockN = Tile::kBlockN;
  constexpr int kStages = Tile::kStages;
  constexpr int kNTilesS = Tile::kScoreQueries / 8;  // a warpgroup's Sᵀ: 64 keys x kScoreQueries queries
  constexpr int kNTilesGrad = Tile::kGradCols / 8;   // dK, dV: 64 keys x kGradCols
  // kStepsInOrder (every hd128 variant): each step's GEMMs issued and completed within the step, in
  // FlashAttention-4's order: dV / dK from registers, nothing of the next step in flight. Against the pipelined
  // form (H200, 2026-12-03): plain bwd +4-12% (2k-16k, causal or not), deterministic +2-5%, softcap / ALiBi /
  // dropout bwd time -5 / -7 / -3% at 8k.
  // dQ: 64 queries x kDqCols, computed in kDqParts parts of kDqCols / kDqParts columns. Two where the persistent
  // kernel's dQ is in flight beside Sᵀ / dPᵀ (240 registers a consumer: the whole dQ there took the
  // accumulators to 224 and ptxas serialised the wgmmas, C7512, and spilled 152 bytes at hd128), and for the
  // ordered dQ's turn keepers (one per part); else one.
  constexpr bool kStepsInOrder = kHeadDim == 128;
  constexpr int kDqParts = kPersistent && (!kStepsInOrder || kOrderedDq) ? 2 : 1;
  constexpr int kNTilesDq = Tile::kDqCols / kDqParts / 8;

  // Declared 1024-byte aligned, the period of the 128-byte swizzle (computed from absolute addresses), so
  // that no slack is needed to align it (at hd64 with 128-query steps the tiles take all but 32 bytes of
  // the 227 KB a CTA may have); checked, since a misaligned base would make the tiles overrun it.
  extern __shared__ __align__(1024) unsigned char smem[];
  const uint32_t smem_base = smem_address(smem);
  if (smem_base % 1024 != 0) __trap();
  const uint32_t smem_k = smem_base;
  const uint32_t smem_v = smem_base + Tile::kVOffset;
  auto smem_q = [&](int stage) { return smem_base + Tile::kQOffset + stage * Tile::kQBytes; };
  auto smem_dout = [&](int stage) { return smem_base + Tile::kDoutOffset + stage * Tile::kQBytes; };
  auto smem_ds = [&](int buffer) { return smem_base + Tile::kDsOffset + buffer * Tile::kDsBytes; };
  auto smem_p = [&](int buffer) { return smem_base + Tile::kPOffset + buffer * Tile::kDsBytes; };
  const float* stat_lse = reinterpret_cast<const float*>(smem + Tile::kLseOffset);  // [stage][kBlockM]
  const float* stat_d = reinterpret_cast<const float*>(smem + Tile::kDOffset);
  const uint32_t bar_kv_full = smem_base + Tile::kBarrierOffset;
  auto bar_q_full = [&](int stage) { return bar_kv_full + 8 * (1 + stage); };
  // Persistent only: the consumers' releases of K and V (8 warps each).
  const uint32_t bar_k_empty = bar_kv_full + 8 * (1 + kStages);
  const uint32_t bar_v_empty = bar_k_empty + 8;
  // The turn keepers' (kTurnKeeper): step g's turn of dQ part `part` granted to the consumers, and their part of
  // step g's dQ added (8 warps), in slot g % 2.
  auto bar_turn_granted = [&](int g, int part) { return bar_v_empty + 8 * (1 + 2 * part + g % 2); };
  auto bar_dq_added = [&](int g, int part) { return bar_v_empty + 8 * (5 + 2 * part + g % 2); };
  int* release_count = reinterpret_cast<int*>(smem + Tile::kCounterOffset);

  const int key_blocks = (params.seqlen_k + kBlockN - 1) / kBlockN;
  const int num_tiles = key_blocks * params.heads_kv * params.batch;
  // Persistent: the tile of walk r >= 1 in slot r % 2, handed from the producer warp to the consumers at named
  // barriers (below: full, then free again once read; walks without steps let the producer run ahead).
  int* next_tile_slot = reinterpret_cast<int*>(smem + Tile::kNextTileOffset);

  // Q, dO, lse log2(e) and D of step i of `walk` into buffer g % kStages, g = i + the CTA's steps before the
  // walk (one thread).
  auto load_query_block = [&](const Walk& walk, int i, int steps_before) {
    const int stage = (steps_before + i) % kStages;
    const int head = walk.head(i);
    const int first_query = walk.first_query(i);
    const int row = static_cast<int>(walk.q_span.begin) + first_query;  // TMA row of the (packed) tensor
    const int tma_batch = params.is_varlen() ? 0 : walk.batch;
    mbarrier_arrive_expect_bytes(bar_q_full(stage), 2 * Tile::kQBytes + 2 * Tile::kStatBytes);
    for (int c = 0; c < Tile::kColumnRegions; ++c) {
      tma_load_4d(smem_q(stage) + c * kBlockM * 128, &maps.q, bar_q_full(stage), c * 64, row, head, tma_batch);
      tma_load_4d(smem_dout(stage) + c * kBlockM * 128, &maps.dout, bar_q_full(stage), c * 64, row, head, tma_batch);
    }
    const float* stats = params.row_stats + head * params.dq_accum_rows + walk.sequence_accum_row + first_query;
    bulk_load(smem_base + Tile::kLseOffset + stage * Tile::kStatBytes, stats, Tile::kStatBytes, bar_q_full(stage));
    bulk_load(smem_base + Tile::kDOffset + stage * Tile::kStatBytes, stats + params.heads_q * params.dq_accum_rows,
              Tile::kStatBytes, bar_q_full(stage));
  };
  // A walk's V or K (one thread; both complete bar_kv_full, whose expected bytes load_values announces). No
  // TMA is issued for an empty walk (a CTA must not exit with copies into its shared memory in flight).
  auto load_key_tile = [&](const Walk& walk, const CUtensorMap* map, uint32_t tile) {
    const int key_row = static_cast<int>(walk.k_span.begin) + walk.first_key;
    const int tma_batch = params.is_varlen() ? 0 : walk.batch;
    for (int c = 0; c < Tile::kColumnRegions; ++c) {
      tma_load_4d(tile + c * kBlockN * 128, map, bar_kv_full, c * 64, key_row, walk.kv_head, tma_batch);
    }
  };
  auto load_values = [&](const Walk& walk) {
    mbarrier_arrive_expect_bytes(bar_kv_full, 2 * Tile::kKvBytes);
    load_key_tile(walk, &maps.v, smem_v);
  };
  auto load_keys = [&](const Walk& walk) { load_key_tile(walk, &maps.k, smem_k); };
  if (threadIdx.x == 0) {
    mbarrier_init(bar_kv_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(bar_q_full(s), 1);
      release_count[s] = 0;
    }
    if constexpr (kPersistent) {
      mbarrier_init(bar_k_empty, Tile::kWarps);
      mbarrier_init(bar_v_empty, Tile::kWarps);
    }
    if constexpr (kTurnKeeper) {
      for (int part = 0; part < 2; ++part) {
        for (int slot = 0; slot < 2; ++slot) {
          mbarrier_init(bar_turn_granted(slot, part), 1);
          mbarrier_init(bar_dq_added(slot, part), Tile::kWarps);
        }
      }
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  // Launched as a programmatic dependent of the preprocess (sm80/bwd_launch_template.cuh), this CTA may run
  // before that kernel has finished: its set-up and the first K / V (inputs) go first; the query blocks'
  // lse / D, the dQ accumulator and the counters (the preprocess's) only after the wait. The dQ conversion
  // may start on SMs this grid leaves idle (common/finished_walks.cuh), but only after the wait: before it, a
  // conversion started early could read the finished-walk counters before the preprocess zeroed them (a
  // reused buffer holds the last call's complete counts) and convert an accumulator still being zeroed.
  const int producer_thread = Tile::kConsumerThreads;  // persistent: the producer warpgroup's first thread
  // Named barriers (0: __syncthreads; 1 .. 4: the dSᵀ halves, store_p_ds): the consumers' own (__syncthreads's
  // would wait for the producer too), and (persistent) those between the consumers and the producer warp: one
  // per query buffer, at which every consumer thread releases it and the producer warp waits for it, and per
  // tile slot one at which the producer announces the tile and one at which the consumers free the slot.
  // (Named barriers, not mbarriers, because compute-sanitizer's racecheck follows them: with mbarrier releases
  // it reports the consumers' lse / D loads as racing with the producer's next TMA; docs/design.md, Tried and
  // not kept.)
  constexpr int kConsumerBarrier = 5;
  constexpr int kQueryBufferBarrier = 6;                      // + the buffer
  constexpr int kTileSlotFullBarrier = 6 + kStages;           // + the slot
  constexpr int kTileSlotFreeBarrier = kTileSlotFullBarrier + 2;  // + the slot
  // At the query buffers' barriers: the consumers and the producer warp; at the tile slots': the turn keepers too.
  constexpr int kBufferThreads = Tile::kConsumerThreads + 32;
  constexpr int kHandoffThreads = kBufferThreads + (kTurnKeeper ? 32 * kDqParts : 0);
  static_assert(kTileSlotFreeBarrier + 2 <= 16, "a CTA has 16 named barriers");
  // The CTA's first tile: its index, or (per-walk CTAs, deterministic) the next from params.dkdv_tile_counter,
  // which the preprocess zeroes: so that the tiles a walk waits for (common/ordered_dq.cuh) were taken by CTAs
  // that had started, whatever order the CTAs are scheduled in.
  const bool tile_from_counter = !kPersistent && kOrderedDq;
  int first_tile = blockIdx.x;
  auto load_first_key_tiles = [&] {
    const Walk walk(params, first_tile, key_blocks);
    if (walk.num_steps > 0) {
      load_values(walk);
      load_keys(walk);
    }
  };
  if (threadIdx.x == (kPersistent ? producer_thread : 0)) {
    prefetch_tensor_map(&maps.q);
    prefetch_tensor_map(&maps.dout);
    if (!tile_from_counter) load_first_key_tiles();
  }
  wait_for_prerequisite_grid();
  allow_dependent_launch();
  if (tile_from_counter) {
    if (threadIdx.x == 0) next_tile_slot[0] = atomicAdd(params.dkdv_tile_counter, 1);
    __syncthreads();
    first_tile = next_tile_slot[0];
    if (threadIdx.x == 0) load_first_key_tiles();
  }

  if constexpr (kPersistent) {
    if (threadIdx.x >= Tile::kConsumerThreads) {
      // ---- producer: warp 8, whose first lane issues every load, walk after walk ----
      release_registers<Tile::kProducerRegisters>();
      if constexpr (kTurnKeeper) {
        const int keeper_part = threadIdx.x / 32 - (Tile::kWarps + 1);
        if (keeper_part >= 0 && keeper_part < kDqParts) {
          // ---- turn keepers: warps 9 and 10, whose lane 0 keeps the CTA's dQ turns (common/ordered_dq.cuh) of
          // dQ part `keeper_part`, walk after walk: step g's turn read early, step g - 1's passed on once all 8
          // consumer warps added that part of its dQ (bar_dq_added), then step g's awaited (unless the early read
          // matched) and granted to the consumers (bar_turn_granted). A keeper per part, so that a walk below
          // waits for the part it adds next, never for this walk's other part (one keeper for both passed the
          // turn after the second part's additions, half a step later). Granting g after passing g - 1 keeps
          // slot g % 2's phases apart: the consumers have waited for step g - 2's grant before they added g - 1.
          const bool keeper = threadIdx.x % 32 == 0;
          int g = 0;
          int* turn_to_pass = nullptr;  // step g - 1's
          int passed_value = 0;
          auto pass_turn = [&] {
            if (turn_to_pass == nullptr) return;
            mbarrier_wait(bar_dq_added(g - 1, keeper_part), static_cast<uint32_t>((g - 1) / 2) & 1);
            if (keeper) release_dq_turn(turn_to_pass, passed_value);
            turn_to_pass = nullptr;
          };
          int tile = first_tile;
          for (int round = 0; tile < num_tiles; ++round) {
            const Walk walk(params, tile, key_blocks);
            for (int i = 0; i < walk.num_steps; ++i, ++g) {
              int* turn = params.dq_turns + dq_turn_index(walk.head(i), params.dq_accum_rows,
                                                          walk.sequence_accum_row + walk.first_query(i), keeper_part);
              const int seen = keeper ? read_dq_turn(turn) : 0;
              pass_turn();
              if (keeper) {
                acquire_dq_turn(turn, walk.awaited_dq_turn(i), seen);
                mbarrier_arrive(bar_turn_granted(g, keeper_part));
              }
              __syncwarp();
              turn_to_pass = turn;
              passed_value = walk.passed_dq_turn();
            }
            named_barrier_sync(kTileSlotFullBarrier + (round + 1) % 2, kHandoffThreads);
            tile = next_tile_slot[(round + 1) % 2];
            named_barrier_arrive(kTileSlotFreeBarrier + (round + 1) % 2, kHandoffThreads);
          }
          pass_turn();
          return;
        }
      }
      if (threadIdx.x / 32 != Tile::kWarps) return;
      const bool leader = threadIdx.x == producer_thread;
      // Query buffer g % kStages free again: the consumers released step g's use of it. (bar.sync is .aligned:
      // the warp reconverges first, its lanes may have left the mbarrier waits' polling loops apart.)
      auto wait_for_release = [&](int g) {
        __syncwarp();
        named_barrier_sync(kQueryBufferBarrier + g % kStages, kBufferThreads);
      };
      // An empty mbarrier's first wait (parity 1 on a fresh barrier) passes: K and V start free.
      int steps_issued = 0, walks_loaded = 0;
      int tile = first_tile;
      int rounds = 0;  // rounds run: each wrote the next walk's tile into its slot (the last one past the end)
      for (int round = 0; tile < num_tiles; ++round, ++rounds) {
        const Walk walk(params, tile, key_blocks);
        const int num_steps = walk.num_steps;
        auto load_step = [&](int i) {
          const int g = steps_issued + i;
          if (g >= kStages) wait_for_release(g - kStages);
          if (leader) {
            // The consumers read the buffer's lse / D with ordinary loads (the generic proxy); TMA (the async
            // proxy) overwrites them: a proxy fence after the barrier orders the two.
            fence_async_shared();
            load_query_block(walk, i, steps_issued);
          }
        };
        if (num_steps > 0) {
          // Walk 0's K / V were issued above. Later walks: the first query block as soon as its buffer is free
          // (during the last walk's last steps), V once the last walk's last dPᵀ completed, K once its last dQ
          // did.
          if (round > 0) {
            load_step(0);
            const uint32_t free_parity = (walks_loaded & 1) ^ 1;
            mbarrier_wait(bar_v_empty, free_parity);
            if (leader) load_values(walk);
            mbarrier_wait(bar_k_empty, free_parity);
            if (leader) load_keys(walk);
          }
          for (int i = round > 0 ? 1 : 0; i < num_steps; ++i) load_step(i);
          ++walks_loaded;
        }
        // The next tile, once this walk's loads are all issued (a tile taken earlier would be held by this
        // CTA while others may run out), announced to the consumers; its K and V prefetched into L2.
        // Slot (round + 1) % 2 is free once the consumers read its tile of two walks before.
        int next_tile = 0;
        if (leader) next_tile = static_cast<int>(gridDim.x) + atomicAdd(params.dkdv_tile_counter, 1);
        next_tile = __shfl_sync(0xffffffffu, next_tile, 0);
        if (round >= 2) named_barrier_sync(kTileSlotFreeBarrier + (round + 1) % 2, kHandoffThreads);
        if (leader) next_tile_slot[(round + 1) % 2] = next_tile;
        __syncwarp();
        named_barrier_arrive(kTileSlotFullBarrier + (round + 1) % 2, kHandoffThreads);
        if (leader) {
          if (next_tile < num_tiles && !params.is_varlen()) {
            const auto next = Walk::coords_of(next_tile, key_blocks, params);
            const int key_row = next.key_block * kBlockN;
            for (int c = 0; c < Tile::kColumnRegions; ++c) {
              tma_prefetch_l2_4d(&maps.k, c * 64, key_row, next.kv_head, next.batch);
              tma_prefetch_l2_4d(&maps.v, c * 64, key_row, next.kv_head, next.batch);
            }
          }
        }
        __syncwarp();
        steps_issued += num_steps;
        tile = next_tile;
      }
      // The releases of the CTA's last kStages steps, for which no load waited, and of its last two tile slots.
      for (int g = max(0, steps_issued - kStages); g < steps_issued; ++g) wait_for_release(g);
      for (int slot_round = max(1, rounds - 1); slot_round <= rounds; ++slot_round) {
        named_barrier_sync(kTileSlotFreeBarrier + slot_round % 2, kHandoffThreads);
      }
      return;
    }
    claim_registers<Tile::kConsumerRegisters>();
  } else if (threadIdx.x == 0) {
    const Walk walk(params, first_tile, key_blocks);
    for (int i = 0; i < min(walk.num_steps, kStages); ++i) load_query_block(walk, i, 0);
  }

  // ---- consumers (threads 0 .. 255) ----
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group = warp / 4;
  const int warp_in_group = warp % 4;
  // This warpgroup's share (BwdSm90Tile): its first key of the block, first query of Sᵀ, first dK / dV column.
  const int group_first_key = Tile::kSplitHeadDim ? 0 : 64 * group;
  const int group_first_query = Tile::kSplitHeadDim ? Tile::kScoreQueries * group : 0;
  const int group_first_grad_col = Tile::kSplitHeadDim ? Tile::kGradCols * group : 0;

  // Operand descriptors (k-step t):
  //   Sᵀ = K Qᵀ, dPᵀ = V dOᵀ: A = the warpgroup's 64 rows of K / V, B = its kScoreQueries rows of Q / dO,
  //     both K-major over the head dim: region t / 4, 32 bytes per step inside it.
  //   dV += Pᵀ dO, dK += dSᵀ Q: B = the warpgroup's kGradCols columns of dO / Q, MN-major, queries 16t ..
  //     16t + 15, regions kBlockM rows apart.
  //   dQ = dS K: A = dS, MN-major (the stored dSᵀ: keys 16t .. + 15 of 128-byte query rows); B = the
  //     warpgroup's kDqCols columns of K, MN-major, keys 16t .. + 15.
  auto kv_scores_descriptor = [&](uint32_t tile, int t) {
    return swizzle128_descriptor(tile + (t / 4) * kBlockN * 128 + group_first_key * 128 + (t % 4) * 32, 16);
  };
  auto query_scores_descriptor = [&](uint32_t tile, int t) {
    return swizzle128_descriptor(tile + (t / 4) * kBlockM * 128 + group_first_query * 128 + (t % 4) * 32, 16);
  };
  auto query_grad_descriptor = [&](uint32_t tile, int t) {
    return swizzle128_descriptor(tile + (group_first_grad_col / 64) * kBlockM * 128 + t * 16 * 128, kBlockM * 128);
  };
  using MmaS = Wgmma<Element, Tile::kScoreQueries>;
  using MmaGrad = Wgmma<Element, Tile::kGradCols>;
  using MmaDq = Wgmma<Element, Tile::kDqCols / kDqParts>;

  // stmatrix of dSᵀ: lane l addresses row l % 8 of matrix l / 8 = (keys + 8 (l / 8 % 2), queries + 8 (l / 16)).
  const int ds_store_row = group_first_key + 16 * warp_in_group + lane % 8 + 8 * (lane / 8 % 2);
  // dQ: this warpgroup computes rows dq_first_row .. + 63 of the block, columns dq_first_col .. + kDqCols - 1.
  const int dq_first_row = Tile::kDqSplitRows ? 64 * group : 0;
  const int dq_first_col = Tile::kDqSplitRows ? 0 : Tile::kDqCols * group;
  const DqAccumLayout dq_layout{params.dq_accum_rows, kHeadDim};
  constexpr int kRowGroupStride = DqAccumLayout::row_group_stride(kHeadDim);
  static_assert(kBlockM <= DqAccumLayout::kOverhangRows, "blocks past the last sequence stay in the buffer");

  int tile = first_tile;
  int steps_before = 0;   // the CTA's steps in earlier walks: step i of a walk uses buffer (steps_before + i) % kStages
  uint32_t kv_phase = 0;  // parity of the next completion of bar_kv_full
  for (int round = 0; tile < num_tiles; ++round) {
    const Walk walk(params, tile, key_blocks);
    const int num_steps = walk.num_steps;
    const int batch = walk.batch;
    const int kv_head = walk.kv_head;
    const int len_q = walk.len_q;
    const int len_k = walk.len_k;
    const BandMask& band = walk.band;
    auto step_head = [&](int i) { return walk.head(i); };
    auto step_first_query = [&](int i) { return walk.first_query(i); };
    auto stage_of = [&](int i) { return (steps_before + i) % kStages; };
    auto phase_of = [&](int i) { return static_cast<uint32_t>((steps_before + i) / kStages) & 1; };
    // Called by each warp once its wgmmas reading step i's buffer completed: persistent, an arrival for the
    // producer; else the last of the 8 warps reloads it.
    auto release_query_block = [&](int i) {
      if constexpr (kPersistent) {
        // Every thread's reads of the buffer's lse / D (scores_to_gradients) are before its arrival; the
        // producer orders its TMA after them with a proxy fence once the barrier completed.
        named_barrier_arrive(kQueryBufferBarrier + stage_of(i), kBufferThreads);
      } else if (last_warp_to_release<Tile::kWarps>(&release_count[stage_of(i)]) && i + kStages < num_steps) {
        load_query_block(walk, i + kStages, steps_before);
      }
    };
    // Persistent: K or V released to the producer (each warp, once its last wgmma reading it completed).
    auto release_key_tile = [&](uint32_t bar_empty) {
      if (kPersistent && lane == 0) mbarrier_arrive(bar_empty);
    };

    // This thread's score elements: keys thread_key + 8 half (of the sequence), queries
    // thread_query + 8 j + e (of the block).
    const int warp_first_key = walk.first_key + group_first_key + 16 * warp_in_group;
    const int thread_key = warp_first_key + lane / 4;
    const int thread_query = group_first_query + 2 * (lane % 4);

    float acc_dk[kNTilesGrad][4] = {};
    float acc_dv[kNTilesGrad][4] = {};
    if (num_steps > 0) mbarrier_wait(bar_kv_full, kv_phase);

    // Sᵀ and dPᵀ of step i: issued and committed (one group), not waited for.
    auto issue_scores = [&](int i, float (&acc_s)[1][kNTilesS][4], float (&acc_dp)[1][kNTilesS][4],
                            bool two_groups) {
      const int stage = stage_of(i);
      mbarrier_wait(bar_q_full(stage), phase_of(i));
      wgmma_fence();
#pragma unroll
      for (int t = 0; t < kHeadDim / 16; ++t) {
        MmaS::template ss<0>(acc_s[0], kv_scores_descriptor(smem_k, t), query_scores_descriptor(smem_q(stage), t), t);
      }
      if (two_groups) wgmma_commit();  // Sᵀ, then dPᵀ (a constant at every call; a generic lambda here crashes cicc)
#pragma unroll
      for (int t = 0; t < kHeadDim / 16; ++t) {
        MmaS::template ss<0>(acc_dp[0], kv_scores_descriptor(smem_v, t), query_scores_descriptor(smem_dout(stage), t),
                             t);
      }
      wgmma_commit();
    };

    // Step i's completed Sᵀ, dPᵀ -> Pᵀ and dSᵀ in place. A warp's block needs the
    // element-wise mask unless every query row is valid and sees every one of the warp's 16 keys (band rows
    // grow monotonically: the corners decide; band.end clamps at len_k). Masked entries get P = dS = 0 by
    // selects (their lse / D may be padding).
    // part (a constant at every call, folded once inlined): 0 both;
    // without softcap / ALiBi / dropout also 1, Pᵀ only (while dPᵀ computes), and 2, dSᵀ from that Pᵀ.
    auto scores_to_gradients = [&](int i, float (&acc_s)[1][kNTilesS][4], float (&acc_dp)[1][kNTilesS][4],
                                   int part) {
      const int stage = stage_of(i);
      const int head = step_head(i);
      const int first_query = step_first_query(i);
      const int valid_queries = min(kBlockM, len_q - first_query);
      const float* lse = stat_lse + stage * kBlockM;
      const float* d = stat_d + stage * kBlockM;
      const bool warp_unmasked = valid_queries == kBlockM && band.begin(first_query + kBlockM - 1) <= warp_first_key &&
                                 band.end(first_query) >= warp_first_key + 16;
      const ScoreMod mod(params, batch, head, len_q, len_k);  // unused without kExtras
      const float first_query_on_diagonal = mod.row_on_diagonal(first_query + thread_query);
      // Dropout: bit (half, j % 8, e) of mask j / 8 set = element kept, one 32-bit mask per 64 queries
      // (warp-collective: every lane computes its share).
      constexpr int kKeepTiles = kNTilesS < 8 ? kNTilesS : 8;
      uint32_t keep_bits[kNTilesS / kKeepTiles];
#pragma unroll
      for (int w = 0; w < kNTilesS / kKeepTiles; ++w) {
        keep_bits[w] = ~0u;
        if constexpr (kDropout) {
          keep_bits[w] = transposed_keep_bits<1, kKeepTiles>(
              philox_seed_offset(params), static_cast<uint64_t>(batch) * params.heads_q + head,
              first_query + thread_query + 8 * kKeepTiles * w, thread_key, params.dropout_threshold);
        }
      }
      auto elementwise = [&](auto masked) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int key = thread_key + 8 * half;
          int lo = 0, hi = kBlockM - 1;  // the queries of the block that see `key`
          if constexpr (decltype(masked)::value) {
            const IndexRange seen_by = band.queries_seeing_key(key);
            const int64_t lo_unclamped = seen_by.begin - first_query, hi_unclamped = seen_by.end - 1 - first_query;
            lo = lo_unclamped < 0 ? 0 : static_cast<int>(lo_unclamped < kBlockM ? lo_unclamped : kBlockM);
            hi = hi_unclamped >= valid_queries ? valid_queries - 1
                                               : static_cast<int>(hi_unclamped < -1 ? -1 : hi_unclamped);
          }
#pragma unroll
          for (int j = 0; j < kNTilesS; ++j) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int query = thread_query + 8 * j + e;
              const int r = 2 * half + e;
              float score = acc_s[0][j][r], grad_factor = 1.f;
              if constexpr (kExtras) {
                float tanh_value;
                score = mod.raw_score(score, first_query_on_diagonal + static_cast<float>(8 * j + e),
                                      static_cast<float>(key), tanh_value);
                grad_factor = 1.f - tanh_value * tanh_value;
              }
              if (!kExtras && part == 2) {
                float ds = acc_s[0][j][r] * (acc_dp[0][j][r] - d[query]);
                if constexpr (decltype(masked)::value) ds = query >= lo && query <= hi ? ds : 0.f;
                acc_dp[0][j][r] = ds;
              } else {
                // dV takes the dropped, rescaled P; dS = P ∘ (dP ∘ keep · scale - D) ∘ (1 - tanh²) takes P itself.
                const float p = exp2f(fmaf(score, params.scale_log2, -lse[query]));
                float p_for_dv = p, dp = !kExtras && part == 1 ? 0.f : acc_dp[0][j][r];  // part 1: dPᵀ still computing
                if constexpr (kDropout) {
                  const bool kept = keep_bits[j / kKeepTiles] >> ((half * kKeepTiles + j % kKeepTiles) * 2 + e) & 1;
                  p_for_dv = kept ? p * params.dropout_scale : 0.f;
                  dp = kept ? dp * params.dropout_scale : 0.f;
                }
                float ds = p * grad_factor * (dp - d[query]);
                if constexpr (decltype(masked)::value) {
                  const bool visible = query >= lo && query <= hi;
                  p_for_dv = visible ? p_for_dv : 0.f;
                  ds = visible ? ds : 0.f;
                }
                acc_s[0][j][r] = p_for_dv;
                if (kExtras || part == 0) acc_dp[0][j][r] = ds;
              }
            }
          }
        }
      };
      if (warp_unmasked) {
        elementwise(std::false_type{});
      } else {
        elementwise(std::true_type{});
      }
    };

    // Step i's Pᵀ and dSᵀ in 16 bits to shared memory (buffers i % 2), one stmatrix per 16 keys x 16 queries
    // (the four 8 x 8 matrices of an A fragment), and this warpgroup's half of dSᵀ announced to the other
    // (named barrier 1 + 2 (i % 2) + group, arrive only).
    auto store_fragments = [&](uint32_t tile, const uint32_t (&frag)[1][kNTilesS / 2][4]) {
#pragma unroll
      for (int jj = 0; jj < kNTilesS / 2; ++jj) {
        // 16-byte chunk of the query row: with 128-query steps, 8 chunks per 64-query region, jj / 4 the region.
        const int chunk = group_first_query / 8 + 2 * (jj % 4) + lane / 16;
        stmatrix_x4(tile + (jj / 4) * kBlockN * 128 + ds_store_row * 128 + ((chunk ^ (ds_store_row % 8)) * 16),
                    {frag[0][jj][0], frag[0][jj][1], frag[0][jj][2], frag[0][jj][3]});
      }
    };
    auto announce_ds = [&](int i) {
      fence_async_shared();
      named_barrier_arrive(1 + 2 * (i % 2) + group, Tile::kConsumerThreads);
    };
    auto store_p_ds = [&](int i, const float (&acc_s)[1][kNTilesS][4], const float (&acc_dp)[1][kNTilesS][4]) {
      uint32_t frag[1][kNTilesS / 2][4];
      accumulator_to_a_fragments<Element>(acc_s, frag);
      store_fragments(smem_p(i % 2), frag);
      accumulator_to_a_fragments<Element>(acc_dp, frag);
      store_fragments(smem_ds(i % 2), frag);
      announce_ds(i);
    };

    // dV += Pᵀ dO, dK += dSᵀ Q of step i (A = this warpgroup's 64 key rows of the stored Pᵀ / dSᵀ, K-major over
    // the block's queries): issued and committed, not waited for.
    auto issue_grads = [&](int i) {
      const int stage = stage_of(i);
      auto own_rows = [&](uint32_t tile, int t) {
        return swizzle128_descriptor(tile + (t / 4) * kBlockN * 128 + group_first_key * 128 + (t % 4) * 32, 16);
      };
      wgmma_fence();
#pragma unroll
      for (int t = 0; t < kBlockM / 16; ++t) {
        MmaGrad::template ss<1>(acc_dv, own_rows(smem_p(i % 2), t), query_grad_descriptor(smem_dout(stage), t), 1);
      }
#pragma unroll
      for (int t = 0; t < kBlockM / 16; ++t) {
        MmaGrad::template ss<1>(acc_dk, own_rows(smem_ds(i % 2), t), query_grad_descriptor(smem_q(stage), t), 1);
      }
      wgmma_commit();
    };

    // Step i's Pᵀ / dSᵀ in 16 bits as A fragments (kGradsFromRegisters, kStepsInOrder), live until the GEMMs
    // reading them completed; dV += Pᵀ dO or dK += dSᵀ Q from them (B = `operands`: step i's dO or Q), issued
    // after the caller's wgmma_fence, not committed.
    uint32_t frag_p[1][kNTilesS / 2][4];
    uint32_t frag_ds[1][kNTilesS / 2][4];
    auto issue_grad_from_registers = [&](float (&acc)[kNTilesGrad][4], const uint32_t (&frag)[1][kNTilesS / 2][4],
                                         uint32_t operands) {
#pragma unroll
      for (int t = 0; t < kBlockM / 16; ++t) {
        MmaGrad::template rs<1>(acc, frag[0][t], query_grad_descriptor(operands, t), 1);
      }
    };
    // kGradsFromRegisters: dV and dK of step i issued from the fragments and committed, not waited for; then
    // dSᵀ stored for dQ and announced.
    auto issue_grads_from_registers = [&](int i, const float (&acc_s)[1][kNTilesS][4],
                                          const float (&acc_dp)[1][kNTilesS][4]) {
      const int stage = stage_of(i);
      accumulator_to_a_fragments<Element>(acc_s, frag_p);
      accumulator_to_a_fragments<Element>(acc_dp, frag_ds);
      wgmma_fence();
      issue_grad_from_registers(acc_dv, frag_p, smem_dout(stage));
      issue_grad_from_registers(acc_dk, frag_ds, smem_q(stage));
      wgmma_commit();
      store_fragments(smem_ds(i % 2), frag_ds);
      announce_ds(i);
    };

    // Part `part` of dQ of step i (this warpgroup's 64 queries x kNTilesDq n-tiles) = dS K over the block's
    // keys, once (part 0) the other warpgroup's half of dSᵀ is stored: issued and committed, not waited for.
    auto issue_dq = [&](int i, float (&acc_dq)[kNTilesDq][4], int part) {
      if (part == 0) named_barrier_sync(1 + 2 * (i % 2) + (1 - group), Tile::kConsumerThreads);
      // A: dSᵀ's 64-query region of this warpgroup's queries (kDqSplitRows), or its only region.
      const uint32_t ds_tile = smem_ds(i % 2) + dq_first_row / 64 * kBlockN * 128;
      // The part's columns of K: region first_col / 64, 2 (first_col % 64) bytes into its rows.
      const int first_col = dq_first_col + part * 8 * kNTilesDq;
      const uint32_t k_cols = smem_k + (first_col / 64) * kBlockN * 128 + (first_col % 64) * 2;
      wgmma_fence();
#pragma unroll
      for (int t = 0; t < kBlockN / 16; ++t) {
        MmaDq::template ss<1, 1>(acc_dq, swizzle128_descriptor(ds_tile + t * 16 * 128, kBlockN * 128),
                                 swizzle128_descriptor(k_cols + t * 16 * 128, kBlockN * 128), t);
      }
      wgmma_commit();
    };

    // This warp's first dQ accumulator row at step i, and (deterministic) its turn there: one per (query head,
    // 8-row group, column half) (common/ordered_dq.cuh).
    auto dq_accum_row = [&](int i) {
      return walk.sequence_accum_row + step_first_query(i) + dq_first_row + 16 * warp_in_group;
    };
    auto dq_turn = [&](int i) {
      return params.dq_turns + dq_turn_index(step_head(i), params.dq_accum_rows, dq_accum_row(i), group);
    };
    // Per-warp turns (kOrderedDq, per-walk kernel), where the warp's rows start inside the sequence: a warp
    // whose 16 rows lie past its end adds zeros (to padding or to the next sequence's rows, whose turns are not
    // its own), which commute. (With the turn keeper, one turn per step covers all warps alike.)
    auto takes_turns = [&](int i) {
      return kOrderedDq && !kTurnKeeper && step_first_query(i) + dq_first_row + 16 * warp_in_group < len_q;
    };
    // Lane 0's early read of step i's turn (issued before the GEMM whose wait precedes the first addition),
    // and the step whose turn is still to pass (-1: none): passed one step late, when its atomics completed.
    auto read_turn_early = [&](int i) { return takes_turns(i) && lane == 0 ? read_dq_turn(dq_turn(i)) : 0; };
    int turn_to_pass = -1;
    auto pass_turn = [&] {
      if (turn_to_pass >= 0) pass_dq_turn(dq_turn(turn_to_pass), walk.passed_dq_turn());
      turn_to_pass = -1;
    };

    // Step i's completed dQ added to the fp32 accumulator. Rows past the sequence's end (dS = 0) are added
    // too: DqAccumLayout says where they land. Ordered: part 0 waits for the turn (the keeper's grant, or the
    // warp's own, seen: its early read), and after the last part the turn is the keeper's to pass (the warp's
    // arrival) or the warp's (one step later).
    auto add_dq = [&](int i, const float (&acc_dq)[kNTilesDq][4], int part, int seen) {
      const int g = steps_before + i;
      const bool ordered = takes_turns(i);
      if constexpr (kTurnKeeper) {
        mbarrier_wait(bar_turn_granted(g, part), static_cast<uint32_t>(g / 2) & 1);
      }
      if (ordered && part == 0) wait_for_dq_turn(dq_turn(i), walk.awaited_dq_turn(i), seen);
      const int64_t accum_row = dq_accum_row(i);
      float* dq_accum_lane =
          params.dq_accum + dq_layout.tile_offset(accum_row, step_head(i), dq_first_col + part * 8 * kNTilesDq) + 4 * lane;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
#pragma unroll
        for (int pair = 0; pair < kNTilesDq / 2; ++pair) {
          atomic_add_float4(dq_accum_lane + half * kRowGroupStride + pair * DqAccumLayout::kTileFloats,
                            acc_dq[2 * pair][2 * half], acc_dq[2 * pair][2 * half + 1], acc_dq[2 * pair + 1][2 * half],
                            acc_dq[2 * pair + 1][2 * half + 1]);
        }
      }
      if constexpr (kTurnKeeper) {
        __syncwarp();
        if (lane == 0) mbarrier_arrive(bar_dq_added(g, part));
      }
      if (ordered && part == kDqParts - 1) turn_to_pass = i;
    };

    float acc_s[1][kNTilesS][4];   // Sᵀ, then Pᵀ in place
    float acc_dp[1][kNTilesS][4];  // dPᵀ, then dSᵀ in place
    if constexpr (kStepsInOrder) {
      // Per step i (FlashAttention-4's order): Sᵀ and dPᵀ issued as two groups; Pᵀ formed once Sᵀ completed
      // (while dPᵀ computes), dSᵀ once dPᵀ did (both at once with softcap / ALiBi / dropout); dV issued from
      // Pᵀ's fragments; dSᵀ stored and, once the other warpgroup's half is too, dQ (this warpgroup's 64 columns,
      // or their first half) and dK (from dSᵀ's fragments) issued; dQ added once dV and it completed, while dK
      // computes (a second part after that). Nothing of the next step is in flight: at most dK + dV + Sᵀ / dPᵀ,
      // or dK + dV + the fragments + dQ (192 registers each in the plain kernel).
      for (int i = 0; i < num_steps; ++i) {
        const int stage = stage_of(i);
        issue_scores(i, acc_s, acc_dp, !kExtras);
        if constexpr (!kExtras) {
          wgmma_wait<1>();  // Sᵀ
          register_fence(acc_s[0]);
          scores_to_gradients(i, acc_s, acc_dp, 1);
          wgmma_wait<0>();  // dPᵀ
          register_fence(acc_dp[0]);
          if (i == num_steps - 1) release_key_tile(bar_v_empty);  // the walk's last dPᵀ completed
          scores_to_gradients(i, acc_s, acc_dp, 2);
        } else {
          // softcap / ALiBi / dropout: Pᵀ and dSᵀ in one pass (dSᵀ needs softcap's factor and the keep bits).
          wgmma_wait<0>();
          register_fence(acc_s[0]);
          register_fence(acc_dp[0]);
          scores_to_gradients(i, acc_s, acc_dp, 0);
        }
        accumulator_to_a_fragments<Element>(acc_s, frag_p);
        accumulator_to_a_fragments<Element>(acc_dp, frag_ds);
        wgmma_fence();
        issue_grad_from_registers(acc_dv, frag_p, smem_dout(stage));
        wgmma_commit();
        store_fragments(smem_ds(i % 2), frag_ds);
        announce_ds(i);
        float acc_dq[kNTilesDq][4];
        pass_turn();
        const int seen = read_turn_early(i);
        issue_dq(i, acc_dq, 0);
        wgmma_fence();
        issue_grad_from_registers(acc_dk, frag_ds, smem_q(stage));
        wgmma_commit();
        wgmma_wait<1>();  // dV and dQ (its first part)
        register_fence(acc_dq);
        add_dq(i, acc_dq, 0, seen);
        if constexpr (kDqParts == 2) {
          issue_dq(i, acc_dq, 1);
          wgmma_wait<0>();  // dK and dQ's second part
          register_fence(acc_dq);
          add_dq(i, acc_dq, 1, 0);
        } else {
          wgmma_wait<0>();  // dK
        }
        // The fragments and the query buffer are free.
        register_fence(frag_p[0]);
        register_fence(frag_ds[0]);
        release_query_block(i);
      }
      pass_turn();  // the walk's last: at once (its successors wait for it)
      if (num_steps > 0) release_key_tile(bar_k_empty);  // the walk's last dQ completed
    } else if constexpr (Tile::kGradsFromRegisters) {
      // Per step i: Pᵀ / dSᵀ formed from the completed Sᵀ / dPᵀ, dV / dK issued from registers and dSᵀ stored;
      // dQ part 0 issued; once dV / dK completed, the query buffer released and step i + 1's Sᵀ / dPᵀ issued;
      // the dQ parts added while they compute. dV / dK are issued and waited for in the same iteration: in
      // flight across the loop's back edge, their register operands made ptxas serialise every wgmma
      // (C7512). At most Sᵀ / dPᵀ or the fragments are live beside dK / dV.
      auto step = [&](int i, auto has_next) {
        register_fence(acc_s[0]);
        register_fence(acc_dp[0]);
        if (!decltype(has_next)::value) release_key_tile(bar_v_empty);  // the walk's last dPᵀ completed
        scores_to_gradients(i, acc_s, acc_dp, 0);
        issue_grads_from_registers(i, acc_s, acc_dp);
        float acc_dq[kNTilesDq][4];
        pass_turn();
        const int seen = read_turn_early(i);
        issue_dq(i, acc_dq, 0);
        wgmma_wait<1>();  // dV / dK of step i: the fragments and the query buffer are free
        register_fence(frag_p[0]);
        register_fence(frag_ds[0]);
        release_query_block(i);
        if constexpr (decltype(has_next)::value) {
          issue_scores(i + 1, acc_s, acc_dp, false);
          wgmma_wait<1>();  // dQ part 0
        } else {
          wgmma_wait<0>();
        }
        register_fence(acc_dq);
        add_dq(i, acc_dq, 0, seen);
        if constexpr (kDqParts == 2) {
          issue_dq(i, acc_dq, 1);
          wgmma_wait<0>();  // dQ part 1 (and step i + 1's Sᵀ / dPᵀ)
          register_fence(acc_dq);
          add_dq(i, acc_dq, 1, 0);
        } else {
          wgmma_wait<0>();
        }
      };
      if (num_steps > 0) {
        issue_scores(0, acc_s, acc_dp, false);
        wgmma_wait<0>();
        for (int i = 0; i < num_steps - 1; ++i) step(i, std::true_type{});
        step(num_steps - 1, std::false_type{});
        pass_turn();  // the walk's last: at once (its successors wait for it)
        release_key_tile(bar_k_empty);  // the walk's last dQ completed
      }
    } else {
      // Per step i: step i - 1's dQ (once the other warpgroup's half of its dSᵀ is stored), waited for and added;
      // step i's Sᵀ, dPᵀ and step i - 1's dV / dK issued; the element-wise work of step i runs while that dV / dK
      // completes (FlashAttention-3's intra-warpgroup overlap, here of the gradient GEMMs, whose accumulators
      // are live anyway); then step i's Pᵀ and dSᵀ are stored. (With dQ in flight during the element-wise work
      // instead, ptxas serialised the wgmmas for want of registers: C7511.) In two parts, dQ's first part is
      // added while Sᵀ / dPᵀ compute, its second while dV / dK do.
      for (int i = 0; i < num_steps; ++i) {
        if (i > 0) {
          // Step i - 1's dQ, then step i's Sᵀ / dPᵀ: the dQ atomics run while Sᵀ / dPᵀ compute.
          float acc_dq[kNTilesDq][4];
          pass_turn();
          const int seen = read_turn_early(i - 1);
          issue_dq(i - 1, acc_dq, 0);
          issue_scores(i, acc_s, acc_dp, false);
          wgmma_wait<1>();  // dQ of step i - 1 (its first part)
          register_fence(acc_dq);
          add_dq(i - 1, acc_dq, 0, seen);
          if constexpr (kDqParts == 2) issue_dq(i - 1, acc_dq, 1);
          issue_grads(i - 1);
          wgmma_wait<1>();  // Sᵀ, dPᵀ of step i (and dQ's second part); step i - 1's dV / dK may still run
          if constexpr (kDqParts == 2) {
            register_fence(acc_dq);
            add_dq(i - 1, acc_dq, 1, 0);
          }
        } else {
          issue_scores(i, acc_s, acc_dp, false);
          wgmma_wait<0>();
        }
        register_fence(acc_s[0]);
        register_fence(acc_dp[0]);
        if (i == num_steps - 1) release_key_tile(bar_v_empty);  // the walk's last dPᵀ completed
        scores_to_gradients(i, acc_s, acc_dp, 0);
        if (i > 0) {
          wgmma_wait<0>();  // step i - 1's dV / dK: its Pᵀ / dSᵀ buffers and its Q / dO are free
          release_query_block(i - 1);
        }
        store_p_ds(i, acc_s, acc_dp);
      }
      if (num_steps > 0) {
        float acc_dq[kNTilesDq][4];
        // The last step's dQ and dV / dK issued together: the gradients' GEMMs run while the dQ is added.
        pass_turn();
        const int seen = read_turn_early(num_steps - 1);
        issue_dq(num_steps - 1, acc_dq, 0);
        issue_grads(num_steps - 1);
        wgmma_wait<1>();
        register_fence(acc_dq);
        add_dq(num_steps - 1, acc_dq, 0, seen);
        if constexpr (kDqParts == 2) {
          issue_dq(num_steps - 1, acc_dq, 1);
          wgmma_wait<0>();
          register_fence(acc_dq);
          add_dq(num_steps - 1, acc_dq, 1, 0);
        }
        pass_turn();  // the walk's last: at once (its successors wait for it)
        wgmma_wait<0>();
        release_query_block(num_steps - 1);
        release_key_tile(bar_k_empty);  // the walk's last dQ completed
      }
    }
    register_fence(acc_dk);
    register_fence(acc_dv);

    // Every warp's wgmmas of this walk completed (its last wgmma_wait), so after this barrier (the consumers')
    // no warp reads the Pᵀ / dSᵀ buffers any more, and every warp has issued its dQ additions: from here on
    // the walk may be counted for the dQ conversion (finished_walks.cuh; below), without waiting for the
    // dK / dV stores (a release after them did, every walk).
    named_barrier_sync(kConsumerBarrier, Tile::kConsumerThreads);
    int next_tile = num_tiles;
    if constexpr (kPersistent) {
      named_barrier_sync(kTileSlotFullBarrier + (round + 1) % 2, kHandoffThreads);
      next_tile = next_tile_slot[(round + 1) % 2];
      named_barrier_arrive(kTileSlotFreeBarrier + (round + 1) % 2, kHandoffThreads);
    }
    if (num_steps > 0) kv_phase ^= 1;
    steps_before += num_steps;
    auto count_walk = [&] {
      if (walk.has_keys && params.dkdv_finished != nullptr) {
        count_finished_walk(&params.dkdv_finished[kFinishedCounterStride * (batch * params.heads_kv + kv_head)]);
      }
    };

    // dK = scale dSᵀ Q and dV of keys first_key .. + valid_keys - 1. By TMA (BwdSm90Tile::kGradsByTma) from
    // the Pᵀ / dSᵀ buffers: no wgmma reads them after the barrier above, and the next walk writes them first in
    // its first step, after the barrier below. TMA clips a dense batch's last block at seqlen_k; a
    // variable-length batch's partial block (its next rows are the next sequence's) is stored from registers.
    const bool grads_by_tma =
        Tile::kGradsByTma && maps.grads_by_tma && (walk.valid_keys == kBlockN || !params.is_varlen());
    // Where dK / dV leave by TMA, thread 32 counts the walk after the staging barrier below, while thread 0
    // issues the stores: the count's release waits until the CTA's dQ additions are performed, and made by
    // thread 0 before the staging, that wait would delay the barrier (thread 32: window (1024, 0) GPU time
    // 904 -> 898 us, (1024, 1024) unchanged; H200, hd128, 16k, 2026-12-01).
    if (threadIdx.x == 0 && !(walk.has_keys && grads_by_tma)) count_walk();
    if (walk.has_keys && grads_by_tma) {
      // 16 bits in K's layout, one stmatrix per 16 keys x 16 columns (as store_p_ds).
      auto stage_grad = [&](const float (&acc)[kNTilesGrad][4], float scale, uint32_t tile) {
#pragma unroll
        for (int jj = 0; jj < kNTilesGrad / 2; ++jj) {
          const int chunk = 2 * (jj % 4) + lane / 16;  // 16-byte chunk of the 64-column region jj / 4
          stmatrix_x4(tile + (jj / 4) * kBlockN * 128 + ds_store_row * 128 + ((chunk ^ (ds_store_row % 8)) * 16),
                      {pack_float2<Element>(acc[2 * jj][0] * scale, acc[2 * jj][1] * scale),
                       pack_float2<Element>(acc[2 * jj][2] * scale, acc[2 * jj][3] * scale),
                       pack_float2<Element>(acc[2 * jj + 1][0] * scale, acc[2 * jj + 1][1] * scale),
                       pack_float2<Element>(acc[2 * jj + 1][2] * scale, acc[2 * jj + 1][3] * scale)});
        }
      };
      stage_grad(acc_dk, params.softmax_scale, smem_ds(0));
      stage_grad(acc_dv, 1.f, smem_p(0));
      fence_async_shared();
      named_barrier_sync(kConsumerBarrier, Tile::kConsumerThreads);
      if (threadIdx.x == 32) count_walk();  // while thread 0 issues the stores and waits for their reads
      if (threadIdx.x == 0) {
        const int key_row = static_cast<int>(walk.k_span.begin) + walk.first_key;
        const int tma_batch = params.is_varlen() ? 0 : batch;
        for (int c = 0; c < Tile::kColumnRegions; ++c) {
          tma_store_4d(&maps.dk, smem_ds(0) + c * kBlockN * 128, c * 64, key_row, kv_head, tma_batch);
          tma_store_4d(&maps.dv, smem_p(0) + c * kBlockN * 128, c * 64, key_row, kv_head, tma_batch);
        }
        bulk_commit_and_wait_reads();
      }
      named_barrier_sync(kConsumerBarrier, Tile::kConsumerThreads);
    } else if (walk.has_keys) {
      // From registers: each thread writes keys thread_key (+ 8) and two columns per n-tile of the
      // warpgroup's columns.
      Element* dk =
          static_cast<Element*>(params.dk) + batch * params.dk_strides.batch + kv_head * params.dk_strides.head;
      Element* dv =
          static_cast<Element*>(params.dv) + batch * params.dv_strides.batch + kv_head * params.dv_strides.head;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int key_in_sequence = thread_key + 8 * half;
        if (key_in_sequence >= len_k) continue;
        const int64_t key = walk.k_span.begin + key_in_sequence;  // row in the (packed) dk and dv
#pragma unroll
        for (int j = 0; j < kNTilesGrad; ++j) {
          const int col = group_first_grad_col + 8 * j + 2 * (lane % 4);
          *reinterpret_cast<uint32_t*>(dv + key * params.dv_strides.row + col) =
              pack_float2<Element>(acc_dv[j][2 * half], acc_dv[j][2 * half + 1]);
          *reinterpret_cast<uint32_t*>(dk + key * params.dk_strides.row + col) = pack_float2<Element>(
              acc_dk[j][2 * half] * params.softmax_scale, acc_dk[j][2 * half + 1] * params.softmax_scale);
        }
      }
    }
    tile = next_tile;
  }
#endif  // sm_90a
}

}  // namespace flash_ext::sm90
