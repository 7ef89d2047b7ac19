// Hopper (sm_90a) forward without dropout (head dims 64, 128, 256): persistent and warp-specialised.
//
// Why a second sm90 forward: fwd_kernel.cuh's CTA (8 warps, no producer, one tile) spends part of each tile
// outside its loop (barrier set-up and TMA descriptor fetch, Q's arrival, block 0's unoverlapped S, the
// epilogue: ~20% of a window's 9-block tile), and its K and V of a block are released together. Here one CTA
// per SM takes tiles one after another, and a producer warp keeps loading ahead across tile boundaries, so the
// next tile's Q and first K / V are in shared memory when its loop starts, and each consumer warpgroup issues
// the next tile's first S before this tile's epilogue. Against fwd_kernel.cuh (H200, bf16, 16k tokens, two
// interleaved rounds per call, 2026-12-02), fwd TFLOP/s at 2k / 8k / 16k:
//   hd64  full 392 / 427-429 / 421-425 -> 442-444 / 459-470 / 462-466, causal 323-327 / 403-406 / 421-424 ->
//         378-379 / 447-451 / 467-479
//   hd128 full 549-605 / 601 / 600-605 -> 622-625 / 660-730 / 668-676, causal 456-461 / 551 / 596-608 ->
//         524-537 / 617-623 / 654-658; window (1024, 0) 0.275-0.277 -> 0.270-0.272 ms, (1024, 1024)
//         0.478-0.483 -> 0.469-0.470 ms
//   hd256 full 558-562 / 600-606 / 596-602 -> 654-667 / 714-716 / 722-729, causal 472-476 / 582-616 /
//         633-642 -> 539-542 / 616-641 / 702-724
// fwd_kernel.cuh keeps dropout.
//
// Tiles: the first gridDim.x by blockIdx.x, then from params.tile_counter, in FwdWalkTile's order (each
// head's row blocks from the last: under a causal mask the longest walks start first, and the CTAs running
// together share the head's K / V in L2). A counter, not a fixed stride: a causal grid's walks differ in
// length, and a fixed stride over them (row blocks slowest, longest first) was slower than fwd_kernel.cuh's
// one-tile CTAs (hd128 causal 2k 457 -> 430, 16k 596-618 -> 569-571 TFLOP/s, one call, 2026-12-02). The
// producer takes the next tile once the current one's loads are issued and hands it to the consumers in its Q
// buffer's tile slot (num_tiles at the end).
//
// Roles (FlashAttention-3's warp specialisation): warpgroup 0 is the producer; one of its threads issues
// every TMA load, the warpgroup gives its registers to the consumers (setmaxnreg: 24 per thread, the two
// consumers 240). Warpgroups 1 and 2 each compute 64 rows of the tile's 128, with fwd_kernel.cuh's
// intra-warpgroup pipelining (block i's S and block i - 1's P V issued together, the softmax of block i
// while that P V runs) but one P buffer (see the loop). Buffers and their mbarriers:
//   Q[kQBuffers]: the CTA's tile t in buffer t % kQBuffers, its tile index in the buffer's slot. With two
//     (hd <= 128) tile t + 1's Q loads during tile t; the epilogue stages O over its own Q buffer, which the
//     consumers release (a named barrier) once O is copied out. With one (hd256: Q is 64 KB) the epilogue
//     comes right after the tile's last P V.
//   K[2], V[2]: block g of the CTA's walk (counted over all its tiles) in buffer g % 2; K(g) is released
//     as soon as S(g) completed, V(g) once P V(g) completed. Separate K and V releases give each load
//     a whole step to land with two buffers: K(g + 1) may load once S(g - 1) completed, V(g) once
//     P V(g - 2) completed, and both are needed one step later.
// Shared memory: hd64 2 x 16 (Q) + 2 x 16 (K) + 2 x 16 (V) = 96 KB; hd128 2 x 32 + 2 x 32 + 2 x 32 = 192 KB;
// hd256 64 + 2 x 32 + 2 x 32 = 192 KB.
// O stored by TMA or unstaged is slower (docs/design.md, Tried and not kept).
//
// Launches it takes (fwd_launch_template.cuh): dense or variable-length batches without dropout, also with
// keys read in place from a KV cache (params.keys_in_cache(): cache rows, or pages through a block table);
// softcap and ALiBi in the kExtras instantiation.
#pragma once

#include <cuda.h>  // CUtensorMap (a type only)

#include <cstdint>

#include "../common/band_mask.cuh"
#include "../common/online_softmax.cuh"
#include "../common/ptx.cuh"
#include "../common/score_mod.cuh"
#include "../common/score_tile.cuh"
#include "../common/smem_rows.cuh"
#include "../common/warp_gemm.cuh"
#include "../params.h"
#include "fwd_kernel.cuh"  // FwdTensorMaps
#include "ptx_sm90.cuh"
#include "wgmma.cuh"

namespace flash_ext::sm90 {

template <int kHeadDim_>
struct FwdSm90PersistentTile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;  // 2 consumer warpgroups x 64 rows
  // Registers per consumer thread: O holds head_dim / 2 floats, the score tile kBlockN / 2.
  static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;
  static constexpr int kStages = 2;
  // Two Q buffers (the next tile's Q loads during this one) where they fit: at hd256 Q is 64 KB, and the
  // epilogue then leaves before the next tile's Q loads.
  static constexpr int kQBuffers = kHeadDim <= 128 ? 2 : 1;
  static constexpr int kConsumerWarps = 8;
  static constexpr int kThreads = 32 * (4 + kConsumerWarps);
  // setmaxnreg: 24 x 128 + 240 x 256 = 64512 of the SM's 65536 registers (the launch gives 168 each).
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static constexpr int kColumnRegions = kHeadDim / 64;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKvBytes = kBlockN * kHeadDim * 2;
  static constexpr int kKOffset = kQBuffers * kQBytes;
  static constexpr int kVOffset = kKOffset + kStages * kKvBytes;
  // Tiles go from the producer to the consumers through a ring of slots of its own (an int each), freed as soon
  // as the consumers read them; two let the producer announce a tile while the consumers read the one before.
  static constexpr int kTileSlots = 2;
  // mbarriers: q_full[Q], k_full[S], k_empty[S], v_full[S], v_empty[S], v_stale; then the tile slots.
  static constexpr int kBarrierOffset = kVOffset + kStages * kKvBytes;
  static constexpr int kTileSlotOffset = kBarrierOffset + 8 * (kQBuffers + 4 * kStages + 1);
  static constexpr int kSmemBytes = kTileSlotOffset + 4 * kTileSlots + 1024;  // +1024: base alignment
  static_assert(kSmemBytes <= 227 * 1024, "an sm90 CTA has at most 227 KB of shared memory");
};

// What both roles need of tile `tile` of the grid (num_m_blocks row blocks of the longest sequence x heads x
// batch): row block fastest, from the last (a causal mask's longest walk) to the first, then head, then batch.
// CTAs that run together share a head's K / V in L2, and taken in this order from the counter the longest walks
// start first. Only tiles with rows of their sequence are constructed (FwdTileNumbering).
template <typename Tile, bool kKeysInCache>
struct FwdWalkTile {
  int m_block, head, batch;
  int len_q, len_k;                     // the sequence's
  int q_row0, k_row0;                   // where its rows start in the (packed) tensors; dense: 0; cache: position
  int first_key_block, num_key_blocks;  // visited from num_key_blocks - 1 down to first_key_block

  __device__ __forceinline__ FwdWalkTile(int tile, int num_m_blocks, const FwdParams& params) {
    m_block = num_m_blocks - 1 - tile % num_m_blocks;
    head = tile / num_m_blocks % params.heads_q;
    batch = tile / num_m_blocks / params.heads_q;
    const SequenceSpan q_span = params.query_span(batch);
    const SequenceSpan k_span = kKeysInCache ? params.cached_key_span(batch) : params.key_span(batch);
    len_q = static_cast<int>(q_span.length);
    len_k = static_cast<int>(k_span.length);
    q_row0 = static_cast<int>(q_span.begin);
    k_row0 = static_cast<int>(k_span.begin);
    const BandMask band = band_mask(params);
    const int key_begin = band.begin(first_row()), key_end = band.end(first_row() + valid_rows() - 1);
    first_key_block = key_begin / Tile::kBlockN;
    num_key_blocks = key_end > key_begin ? (key_end + Tile::kBlockN - 1) / Tile::kBlockN : first_key_block;
  }
  __device__ __forceinline__ int num_blocks() const { return num_key_blocks - first_key_block; }
  __device__ __forceinline__ int first_row() const { return m_block * Tile::kBlockM; }
  __device__ __forceinline__ int valid_rows() const { return min(Tile::kBlockM, len_q - first_row()); }
  __device__ __forceinline__ BandMask band_mask(const FwdParams& params) const { return BandMask(params, len_q, len_k); }
  // The batch coordinate of Q's TMA boxes: a variable-length batch is one packed batch entry.
  __device__ __forceinline__ int tma_batch(const FwdParams& params) const { return params.is_varlen() ? 0 : batch; }
  // Keys in a cache: rows of the first visited block (the walk's last) past the sequence's keys. They hold
  // whatever the cache does there (stale or unwritten entries, NaN included), and a masked score's zero P times
  // a NaN in V would still be NaN: V's are zeroed before any P V reads them (K's are masked scores already).
  __device__ __forceinline__ int stale_rows(const FwdParams& params) const {
    return kKeysInCache ? max(0, num_key_blocks * Tile::kBlockN - len_k) : 0;
  }
};

// The (position, batch) TMA coordinates of key block `key_block` of tile t's sequence: rows of the (packed) k / v,
// or of its cache row, or, paged, of the page that holds it (Tile::kBlockN divides the page size, launch template).
// `page`: the block-table entry of the block, where paged.
template <typename Tile, bool kKeysInCache>
__device__ __forceinline__ int2 key_block_coordinates(const FwdParams& params,
                                                      const FwdWalkTile<Tile, kKeysInCache>& t, int key_block,
                                                      int page) {
  if constexpr (kKeysInCache) {
    if (params.key_pages != nullptr) {
      return make_int2(key_block * Tile::kBlockN % static_cast<int>(params.cache_seqlen), page);
    }
    return make_int2(t.k_row0 + key_block * Tile::kBlockN, params.key_rows != nullptr ? params.key_rows[t.batch] : t.batch);
  } else {
    return make_int2(t.k_row0 + key_block * Tile::kBlockN, t.tma_batch(params));
  }
}

// Which grid tile the producer's n-th tile is. Dense batches: tile n itself. Variable-length batches: the grid
// has num_m_blocks row blocks for every sequence, and those past a shorter sequence's end have no rows; the
// producer numbers only the tiles with rows (batch slowest, then head, then row block from the last, the grid's
// order) and hands the consumers their grid tiles, so neither role spends a handoff or a counter increment on
// an empty one. A CTA's tiles only increase, so the batch of tile n is found by moving a cursor forward: 32
// sequences per step, their tile counts added up across the warp (call from all 32 lanes of a warp).
template <typename Tile>
struct FwdTileNumbering {
  int batch = 0;         // the cursor: the first sequence not passed yet
  int tiles_before = 0;  // tiles with rows of the sequences before it

  // Grid tile of tile n, or num_tiles past the last tile with rows.
  __device__ __forceinline__ int grid_tile(int n, const FwdParams& params, int num_m_blocks, int num_tiles) {
    if (!params.is_varlen()) return n < num_tiles ? n : num_tiles;
    const int lane = threadIdx.x % 32;
    while (batch < params.batch) {
      const int b = batch + lane;
      // At most the grid's row blocks: a max_seqlen_q below a sequence's length leaves its rows past
      // max_seqlen_q uncomputed (as in the one-tile kernel), never a tile outside the grid.
      const int blocks = b < params.batch ? min(num_m_blocks, (params.cu_seqlens_q[b + 1] - params.cu_seqlens_q[b] +
                                                               Tile::kBlockM - 1) / Tile::kBlockM)
                                          : 0;
      const int tiles = blocks * params.heads_q;
      int through = tiles;  // tiles of the sequences batch .. b
#pragma unroll
      for (int d = 1; d < 32; d *= 2) {
        const int below = __shfl_up_sync(0xffffffffu, through, d);
        if (lane >= d) through += below;
      }
      const unsigned reached = __ballot_sync(0xffffffffu, tiles_before + through > n);
      if (reached != 0) {
        const int hit = __ffs(reached) - 1;
        tiles_before += __shfl_sync(0xffffffffu, through - tiles, hit);
        batch += hit;
        const int hit_blocks = __shfl_sync(0xffffffffu, blocks, hit);
        const int local = n - tiles_before;
        const int head = local / hit_blocks, m_block = hit_blocks - 1 - local % hit_blocks;
        return (num_m_blocks - 1 - m_block) + num_m_blocks * (head + params.heads_q * batch);
      }
      tiles_before += __shfl_sync(0xffffffffu, through, 31);
      batch += 32;
    }
    return num_tiles;
  }
};

// kExtras: softcap and ALiBi (common/score_mod.cuh), as in fwd_kernel.cuh. kKeysInCache: keys read in place
// from a KV cache (params.keys_in_cache()); an instantiation of its own, as the cache's coordinates and stale rows
// cost the training forward 1-3% at hd64 / hd256 when compiled into its producer and tile set-up.
template <typename Element, int kHeadDim_, bool kExtras, bool kKeysInCache>
__global__ void __launch_bounds__(FwdSm90PersistentTile<kHeadDim_>::kThreads, 1)
    attention_fwd_sm90_persistent_kernel(const __grid_constant__ FwdParams params,
                                         const __grid_constant__ FwdTensorMaps maps) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tile = FwdSm90PersistentTile<kHeadDim_>;
  using WalkTile = FwdWalkTile<Tile, kKeysInCache>;
  constexpr int kQBuffers = Tile::kQBuffers;
  constexpr int kBlockM = Tile::kBlockM;
  constexpr int kBlockN = Tile::kBlockN;
  constexpr int kHeadDim = Tile::kHeadDim;
  constexpr int kStages = Tile::kStages;
  constexpr int kNTilesS = kBlockN / 8;
  constexpr int kNTilesO = kHeadDim / 8;
  constexpr int kChunksPerRow = kHeadDim / 8;

  extern __shared__ unsigned char smem_raw[];
  const uint32_t smem_base = (smem_address(smem_raw) + 1023) & ~1023u;
  unsigned char* smem = smem_raw + (smem_base - smem_address(smem_raw));
  auto smem_q = [&](int buffer) { return smem_base + buffer * Tile::kQBytes; };
  auto smem_k = [&](int stage) { return smem_base + Tile::kKOffset + stage * Tile::kKvBytes; };
  auto smem_v = [&](int stage) { return smem_base + Tile::kVOffset + stage * Tile::kKvBytes; };
  const uint32_t bars = smem_base + Tile::kBarrierOffset;
  auto bar_q_full = [&](int buffer) { return bars + 8 * buffer; };
  auto bar_k_full = [&](int stage) { return bars + 8 * (kQBuffers + stage); };
  auto bar_k_empty = [&](int stage) { return bars + 8 * (kQBuffers + kStages + stage); };
  auto bar_v_full = [&](int stage) { return bars + 8 * (kQBuffers + 2 * kStages + stage); };
  auto bar_v_empty = [&](int stage) { return bars + 8 * (kQBuffers + 3 * kStages + stage); };
  const uint32_t bar_v_stale = bars + 8 * (kQBuffers + 4 * kStages);  // a V block with stale rows, to the producer
  // Named barriers between the producer warp and the 8 consumer warps: per tile slot, written (the producer
  // arrives, the consumers wait) and read (the consumers arrive right after reading it, the producer waits
  // before writing it again); per Q buffer, free again (the consumers arrive once O left it, the producer waits
  // before the next Q). A barrier's completion makes the accesses before each thread's arrival visible to all
  // its threads (PTX barrier.cta); racecheck still reports the slots' handoff, as it does for the same handoff
  // alone (scripts/racecheck_handoff_probe.cu; docs/design.md §4.5). Ids 1 and 2 are the consumer warpgroups'.
  constexpr int kSlotWrittenBarrier = 3;                            // + the slot
  constexpr int kSlotReadBarrier = 3 + Tile::kTileSlots;            // + the slot
  constexpr int kBufferFreeBarrier = 3 + 2 * Tile::kTileSlots;      // + the Q buffer
  static_assert(kBufferFreeBarrier + kQBuffers <= 16, "16 named barriers per CTA");
  constexpr int kHandoffThreads = 32 * (Tile::kConsumerWarps + 1);
  volatile int* tile_slot = reinterpret_cast<volatile int*>(smem + Tile::kTileSlotOffset);

  // The grid: row blocks of the longest sequence (seqlen_q) x heads x batch.
  const int num_m_blocks = static_cast<int>((params.seqlen_q + kBlockM - 1) / kBlockM);
  const int num_tiles = num_m_blocks * params.heads_q * params.batch;

  if (threadIdx.x == 0) {
    for (int b = 0; b < kQBuffers; ++b) mbarrier_init(bar_q_full(b), 1);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(bar_k_full(s), 1);
      mbarrier_init(bar_k_empty(s), Tile::kConsumerWarps);
      mbarrier_init(bar_v_full(s), 1);
      mbarrier_init(bar_v_empty(s), Tile::kConsumerWarps);
    }
    if constexpr (kKeysInCache) mbarrier_init(bar_v_stale, 1);
    mbarrier_init_fence();
  }
  __syncthreads();

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  if (warp < 4) {
    // ---- producer ----
    release_registers<Tile::kProducerRegisters>();
    if (warp != 0) return;
    // Warp 0 walks the tiles (the named barriers count whole warps); its lane 0 issues every load.
    const bool leader = lane == 0;
    if (leader) {
      prefetch_tensor_map(&maps.q);
      prefetch_tensor_map(&maps.k);
      prefetch_tensor_map(&maps.v);
    }
    // An empty barrier's first wait (parity 1 on a fresh barrier) passes: every K / V buffer starts free.
    // Each tile, and at the end num_tiles, goes to the consumers in the tile slot of its Q buffer; q_full then
    // completes with its Q (a tile without keys: at the arrival alone, no Q).
    int block_count = 0, q_count = 0, stale_count = 0;
    FwdTileNumbering<Tile> numbering;
    for (int n = blockIdx.x;; ++q_count) {
      const int tile = numbering.grid_tile(n, params, num_m_blocks, num_tiles);
      const int slot = q_count % Tile::kTileSlots;
      __syncwarp();
      if (q_count >= Tile::kTileSlots) named_barrier_sync(kSlotReadBarrier + slot, kHandoffThreads);
      if (leader) tile_slot[slot] = tile;
      __syncwarp();
      named_barrier_arrive(kSlotWrittenBarrier + slot, kHandoffThreads);
      if (tile >= num_tiles) break;
      const int q_buffer = q_count % kQBuffers;
      if (q_count >= kQBuffers) named_barrier_sync(kBufferFreeBarrier + q_buffer, kHandoffThreads);
      const WalkTile t(tile, num_m_blocks, params);
      const bool has_keys = t.num_blocks() > 0;
      const int kv_head = t.head / params.heads_per_kv();
      if (leader) {
        // The consumers read and wrote the buffer (O staged and copied out) through the generic proxy; TMA (the
        // async proxy) overwrites it: a proxy fence after the barrier orders the two.
        fence_async_shared();
        mbarrier_arrive_expect_bytes(bar_q_full(q_buffer), has_keys ? Tile::kQBytes : 0);
        for (int c = 0; has_keys && c < Tile::kColumnRegions; ++c) {
          tma_load_4d(smem_q(q_buffer) + c * kBlockM * 128, &maps.q, bar_q_full(q_buffer), c * 64,
                      t.q_row0 + t.first_row(), t.head, t.tma_batch(params));
        }
      }
      // Paged: lane l holds the block-table entry of the walk's block 32 k + l while blocks 32 k ... are
      // loaded, and the entries of the next 32 are read meanwhile (one table read on the path per tile).
      auto page_entries = [&](int first) {
        const int i = first + lane;
        return kKeysInCache && params.key_pages != nullptr && i < t.num_blocks()
                   ? params.key_pages[t.batch * params.key_pages_stride +
                                      (t.num_key_blocks - 1 - i) * kBlockN / params.cache_seqlen]
                   : 0;
      };
      int pages = page_entries(0), next_pages = page_entries(32);
      const int stale_rows = t.stale_rows(params);
      for (int i = 0; i < t.num_blocks(); ++i, ++block_count) {
        const int stage = block_count % kStages;
        const uint32_t free_parity = ((block_count / kStages) & 1) ^ 1;
        if (kKeysInCache && i % 32 == 0 && i > 0) {
          pages = next_pages;
          next_pages = page_entries(i + 32);
        }
        const int page = kKeysInCache ? __shfl_sync(0xffffffffu, pages, i % 32) : 0;
        const int2 key_at = key_block_coordinates(params, t, t.num_key_blocks - 1 - i, page);
        mbarrier_wait(bar_k_empty(stage), free_parity);
        if (leader) {
          mbarrier_arrive_expect_bytes(bar_k_full(stage), Tile::kKvBytes);
          for (int c = 0; c < Tile::kColumnRegions; ++c) {
            tma_load_4d(smem_k(stage) + c * kBlockN * 128, &maps.k, bar_k_full(stage), c * 64, key_at.x, kv_head,
                        key_at.y);
          }
        }
        mbarrier_wait(bar_v_empty(stage), free_parity);
        // A block with stale rows lands at bar_v_stale; the warp zeroes those rows, then completes v_full.
        const bool stale = i == 0 && stale_rows > 0;
        const uint32_t v_bar = stale ? bar_v_stale : bar_v_full(stage);
        if (leader) {
          mbarrier_arrive_expect_bytes(v_bar, Tile::kKvBytes);
          for (int c = 0; c < Tile::kColumnRegions; ++c) {
            tma_load_4d(smem_v(stage) + c * kBlockN * 128, &maps.v, v_bar, c * 64, key_at.x, kv_head, key_at.y);
          }
        }
        if (stale) {
          mbarrier_wait(bar_v_stale, stale_count++ & 1);
          const int chunks_per_region = stale_rows * 8;  // 16-byte chunks of the stale rows, in one 64-column region
          for (int idx = lane; idx < Tile::kColumnRegions * chunks_per_region; idx += 32) {
            const int region = idx / chunks_per_region;
            const int row = kBlockN - stale_rows + idx % chunks_per_region / 8;
            *reinterpret_cast<uint4*>(smem + Tile::kVOffset + stage * Tile::kKvBytes + region * kBlockN * 128 + row * 128 +
                                      idx % 8 * 16) = make_uint4(0, 0, 0, 0);
          }
          fence_async_shared();  // the zeros, written by the generic proxy, are read by wgmma (the async proxy)
          __syncwarp();
          if (leader) mbarrier_arrive(bar_v_full(stage));
        }
      }
      // The next tile, once this one's loads are all issued (one taken earlier would wait here while other
      // CTAs may run out of work).
      int next = 0;
      if (leader) next = static_cast<int>(gridDim.x) + atomicAdd(params.tile_counter, 1);
      n = __shfl_sync(0xffffffffu, next, 0);
    }
    // The consumers' arrivals no write waited for: the last two slots' reads (the end included) and the last Q
    // buffers' releases, so that no barrier is left part-way at exit.
    for (int c = max(0, q_count - Tile::kTileSlots + 1); c <= q_count; ++c) {
      named_barrier_sync(kSlotReadBarrier + c % Tile::kTileSlots, kHandoffThreads);
    }
    for (int c = max(0, q_count - kQBuffers); c < q_count; ++c) {
      named_barrier_sync(kBufferFreeBarrier + c % kQBuffers, kHandoffThreads);
    }
    return;
  }

  // ---- consumers ----
  claim_registers<Tile::kConsumerRegisters>();
  const int group = warp / 4 - 1;  // consumer warpgroup: rows 64 * group .. + 63 of the tile
  const int warp_first_row = 64 * group + 16 * (warp % 4);
  const int thread_in_group = threadIdx.x % 128;
  using MmaO = Wgmma<Element, kHeadDim>;
  auto release = [&](uint32_t bar) {
    if (lane == 0) mbarrier_arrive(bar);
  };

  // S = Q Kᵀ of block g of the walk (Q from buffer q_buffer) into acc_s: issued and committed, not waited for.
  auto issue_scores = [&](int g, int q_buffer, float (&acc_s)[1][kNTilesS][4]) {
    const int stage = g % kStages;
    issue_qk_gemm<Element, kBlockM, kBlockN, kHeadDim>(acc_s[0], smem_q(q_buffer) + group * 64 * 128, smem_k(stage),
                                                       bar_k_full(stage), (g / kStages) & 1);
  };
  // O of tile t's rows from `first_row` of its sequence on.
  auto tile_out = [&](const WalkTile& t) {
    return static_cast<Element*>(params.out) + t.batch * params.out_strides.batch + t.head * params.out_strides.head +
           static_cast<int64_t>(t.q_row0 + t.first_row()) * params.out_strides.row;
  };
  // Output 0 and lse -inf for this warpgroup's rows of a tile whose rows see no key.
  auto write_empty_tile = [&](const WalkTile& t) {
    const int first_row = t.first_row();
    const int valid_rows = t.valid_rows();
    Element* out = tile_out(t);
    float* lse = params.lse + params.lse_index(t.batch, t.head, first_row);
    for (int i = thread_in_group; i < 64 * kChunksPerRow; i += 128) {
      const int row = 64 * group + i / kChunksPerRow, col = i % kChunksPerRow * 8;
      if (row < valid_rows) *reinterpret_cast<uint4*>(out + row * params.out_strides.row + col) = make_uint4(0, 0, 0, 0);
    }
    if (thread_in_group < 64 && 64 * group + thread_in_group < valid_rows) lse[64 * group + thread_in_group] = -INFINITY;
  };
  // Epilogue of a finished tile (o_packed: its normalised O in 16 bits, [n-tile][row half]; row_lse): O over
  // the warpgroup's own rows of the tile's Q buffer (its last S completed; the other warpgroup reads only its
  // own rows), copied out in 16-byte chunks, then the buffer released.
  auto store_tile = [&](int tile, int q_buffer, const uint32_t (&o_packed)[kNTilesO][2], const float (&row_lse)[2]) {
    const WalkTile t(tile, num_m_blocks, params);
    const int first_row = t.first_row();
    const int valid_rows = t.valid_rows();
    Element* out = tile_out(t);
    float* lse = params.lse + params.lse_index(t.batch, t.head, first_row);
    // The warpgroup's reads of this buffer's rows for an earlier tile come first (ordered anyway, through the
    // buffer's release and its next Q's arrival at its mbarrier, which racecheck does not follow).
    named_barrier_sync(1 + group, 128);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_first_row + lane / 4 + 8 * half;
#pragma unroll
      for (int j = 0; j < kNTilesO; ++j) {
        *reinterpret_cast<uint32_t*>(smem + q_buffer * Tile::kQBytes +
                                     swizzled_offset(kBlockM, row, j * 8 + 2 * (lane % 4))) = o_packed[j][half];
      }
      if (lane % 4 == 0 && row < valid_rows) lse[row] = row_lse[half];
    }
    named_barrier_sync(1 + group, 128);
    for (int chunk_id = thread_in_group; chunk_id < 64 * kChunksPerRow; chunk_id += 128) {
      const int row = 64 * group + chunk_id / kChunksPerRow;
      const int col = chunk_id % kChunksPerRow * 8;
      if (row < valid_rows) {
        *reinterpret_cast<uint4*>(out + row * params.out_strides.row + col) =
            *reinterpret_cast<const uint4*>(smem + q_buffer * Tile::kQBytes + swizzled_offset(kBlockM, row, col));
      }
    }
    // The buffer's next writer is TMA (the async proxy): order this thread's shared-memory accesses first.
    fence_async_shared();
    __syncwarp();
    named_barrier_arrive(kBufferFreeBarrier + q_buffer, kHandoffThreads);
  };

  // Across tiles the warpgroup keeps its tensor work going: a tile's epilogue runs after the next tile's
  // first S was issued, while it computes. (The S is issued and waited for within one iteration: an S in
  // flight across the loop's back edge made ptxas serialise the wgmmas, C7515.)
  // The finished tile's O is carried to its epilogue in 16 bits: converted right after its last P V, so that
  // the epilogue (after the next S was issued) reads no register a wgmma wrote (ptxas inserted a wait for
  // the S there, C7517, when it read acc_o).
  float acc_s[1][kNTilesS][4];
  uint32_t o_packed[kNTilesO][2];
  float row_lse[2];
  int block_count = 0;
  int finished_tile = -1, finished_q_buffer = 0;  // a tile whose epilogue is pending, and its Q buffer
  for (int q_count = 0;; ++q_count) {
    const int q_buffer = q_count % kQBuffers;
    const int slot = q_count % Tile::kTileSlots;
    __syncwarp();
    named_barrier_sync(kSlotWrittenBarrier + slot, kHandoffThreads);
    const int tile = tile_slot[slot];
    __syncwarp();
    named_barrier_arrive(kSlotReadBarrier + slot, kHandoffThreads);
    if (tile >= num_tiles) break;
    mbarrier_wait(bar_q_full(q_buffer), (q_count / kQBuffers) & 1);
    const WalkTile t(tile, num_m_blocks, params);
    const int num_blocks = t.num_blocks();
    if (num_blocks <= 0) {
      // No Q came: the pending epilogue goes first (its buffer is the one the producer waits for next).
      if (finished_tile >= 0) store_tile(finished_tile, finished_q_buffer, o_packed, row_lse);
      finished_tile = -1;
      write_empty_tile(t);
      __syncwarp();
      named_barrier_arrive(kBufferFreeBarrier + q_buffer, kHandoffThreads);
      continue;
    }
    const int first_row = t.first_row();
    const int valid_rows = t.valid_rows();
    const BandMask band = t.band_mask(params);
    // Blocks needing the element-wise mask: as in fwd_kernel.cuh.
    const int last_row = first_row + valid_rows - 1;
    const int hi_unmasked = max(t.first_key_block, min(t.num_key_blocks, band.end(first_row) / kBlockN));
    const int lo_unmasked =
        min(hi_unmasked, max(t.first_key_block, (band.begin(last_row) + kBlockN - 1) / kBlockN));

    // Not zeroed: the tile's first P V overwrites it (its first k-step does not accumulate).
    float acc_o[1][kNTilesO][4];
    auto issue_pv = [&](int i, const uint32_t (&p_frag)[1][kBlockN / 16][4]) {
      const int stage = (block_count + i) % kStages;
      const uint64_t v_desc = opaque_u64(swizzle128_descriptor(smem_v(stage), kBlockN * 128));
      mbarrier_wait(bar_v_full(stage), ((block_count + i) / kStages) & 1);
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < kBlockN / 16; ++s) {
        MmaO::template rs<1>(acc_o[0], p_frag[0][s], descriptor_plus(v_desc, s * 16 * 128), i > 0 || s > 0);
      }
      wgmma_commit();
    };
    OnlineSoftmax<1> softmax;
    // Softcap and ALiBi of this tile's (batch, head); nothing without kExtras.
    const auto mod = [&] {
      if constexpr (kExtras) {
        return ScoreMod(params, t.batch, t.head, t.len_q, t.len_k);
      } else {
        return 0;
      }
    }();
    // Block i's completed scores -> unnormalised probabilities in place (fp32); the rescale of O is left to
    // the caller (o_factor; returns whether any row of the warp needs it), since O may still accumulate.
    auto scores_to_probabilities = [&](int i, float (&o_factor)[2]) {
      const int key_block = t.num_key_blocks - 1 - i;
      const bool needs_mask = key_block >= hi_unmasked || key_block < lo_unmasked;
      bool rescale;
      if constexpr (kExtras) {
        float row_offset[2] = {};  // ALiBi's row terms (score_tile.cuh)
        if (mod.active()) modify_scores(acc_s, first_row + warp_first_row, key_block * kBlockN, mod, row_offset);
        if (needs_mask) mask_scores(acc_s, first_row + warp_first_row, key_block * kBlockN, band);
        rescale = softmax.template raise_bases<false>(acc_s, params.fwd_score_scale_log2, row_offset, o_factor);
        softmax.exponentiate(acc_s, params.fwd_score_scale_log2, row_offset);
      } else {
        if (needs_mask) mask_scores(acc_s, first_row + warp_first_row, key_block * kBlockN, band);
        rescale = softmax.template raise_bases<false>(acc_s, params.scale_log2, o_factor);
        softmax.exponentiate(acc_s, params.scale_log2);
      }
      return rescale;
    };

    issue_scores(block_count, q_buffer, acc_s);
    if (finished_tile >= 0) store_tile(finished_tile, finished_q_buffer, o_packed, row_lse);

    // One P buffer (FlashAttention-3's order): block i's probabilities stay in fp32 until P V of block
    // i - 1, which reads the 16-bit P, has completed; only then are they converted over it. Two alternating
    // P buffers (fwd_kernel.cuh) convert earlier but hold 32 more registers per thread, which the walk's
    // state does not leave at 240.
    uint32_t p_frag[1][kBlockN / 16][4];
    float o_factor[2];
    wgmma_wait<0>();
    register_fence(acc_s[0]);
    release(bar_k_empty(block_count % kStages));
    scores_to_probabilities(0, o_factor);
    accumulator_to_a_fragments<Element>(acc_s, p_frag);
    for (int i = 1; i < num_blocks; ++i) {
      issue_scores(block_count + i, q_buffer, acc_s);
      issue_pv(i - 1, p_frag);
      wgmma_wait<1>();  // S of block i (P V of block i - 1 may still run)
      register_fence(acc_s[0]);
      release(bar_k_empty((block_count + i) % kStages));
      const bool rescale = scores_to_probabilities(i, o_factor);
      wgmma_wait<0>();  // P V of block i - 1
      register_fence(acc_o[0]);
      release(bar_v_empty((block_count + i - 1) % kStages));
      accumulator_to_a_fragments<Element>(acc_s, p_frag);
      if (rescale) softmax.rescale(acc_o, o_factor);
    }
    issue_pv(num_blocks - 1, p_frag);
    wgmma_wait<0>();
    register_fence(acc_o[0]);
    release(bar_v_empty((block_count + num_blocks - 1) % kStages));
    softmax.finalize(acc_o, kExtras ? params.fwd_score_scale : params.softmax_scale, row_lse);
#pragma unroll
    for (int j = 0; j < kNTilesO; ++j) {
#pragma unroll
      for (int half = 0; half < 2; ++half) o_packed[j][half] = pack_float2<Element>(acc_o[0][j][2 * half], acc_o[0][j][2 * half + 1]);
    }
    finished_tile = tile;
    finished_q_buffer = q_buffer;
    block_count += num_blocks;
    if constexpr (kQBuffers == 1) {
      // The next tile's Q goes into this buffer: O leaves first.
      store_tile(finished_tile, finished_q_buffer, o_packed, row_lse);
      finished_tile = -1;
    }
  }
  if (finished_tile >= 0) store_tile(finished_tile, finished_q_buffer, o_packed, row_lse);
#endif  // sm_90a
}

}  // namespace flash_ext::sm90
