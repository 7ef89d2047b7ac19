// The sm80 backward's dK/dV kernel (bwd_common.cuh has the overview): a CTA per key block keeps K and V in
// shared memory, walks the query blocks that see them, accumulates dK and dV in registers and, unless
// deterministic, adds dQ into the fp32 accumulator with atomics. It also runs the pieces of the split tail
// walks (TailSplit), whose sums bwd_convert_kernels.cuh rounds.
#pragma once

#include <cstdint>
#include <type_traits>

#include "../common/band_mask.cuh"
#include "../common/dq_accum_layout.h"
#include "../common/dropout_bits.cuh"
#include "../common/philox.h"
#include "../common/ptx.cuh"
#include "../common/score_mod.cuh"
#include "../common/tile_copy.cuh"
#include "../common/warp_gemm.cuh"
#include "../params.h"
#include "bwd_common.cuh"
#include "bwd_tile_config.h"

namespace flash_ext::sm80 {

// num_stages (1 or 2): query-block buffers in shared memory, chosen by the host (buffer_stages).
// Tile::kExtras: softcap, ALiBi or dropout is on (common/score_mod.cuh, common/philox.h).
// The three phases per query block and their warp tiles: BwdDkDvTile.
// kWalkPieces = false: a CTA per walk (grid: key blocks x kv heads x batch); walks from split.first_walk on
// are left to the launch with kWalkPieces = true: a CTA per piece (grid: split.pieces x split walks), whose
// dK / dV go to params.dkv_accum with atomics (TailSplit in params.h).
template <typename Tile, typename Element, bool kWalkPieces>
__global__ void __launch_bounds__(Tile::kThreads)
    attention_bwd_dkdv_kernel(const __grid_constant__ BwdParams params, const int num_stages, const TailSplit split) {
  constexpr bool kExtras = Tile::kExtras;
  constexpr int kHeadDim = Tile::kHeadDim;
  using Rows = typename Tile::Rows;            // K, V, Q, dO tiles
  using ScoreRows = typename Tile::ScoreRows;  // Pᵀ, dSᵀ tiles
  constexpr int kBlockKeys = Tile::kBlockKeys;
  constexpr int kBlockQueries = Tile::kBlockQueries;
  constexpr int kQueryTileElements = kBlockQueries * Rows::kRowElements;
  // Phase 1 warp tile: 32 keys (2 m-tiles) x kScoreQueries; phase 2: kGradKeys x kGradCols;
  // phase 3: kDqRows x kDqChunkCols at a time.
  constexpr int kScoreMTiles = 2, kScoreNTiles = Tile::kScoreQueries / 8;
  constexpr int kGradMTiles = Tile::kGradKeys / 16;
  constexpr int kGradNTiles = Tile::kGradCols / 8;
  constexpr int kDqMTiles = Tile::kDqRows / 16;
  const bool fused_dq = params.dq_accum != nullptr;
  // Q / dO copies of whole query blocks by tile_copy.cuh's unrolled path, up to head_dim 128 (H200, bf16,
  // 16k tokens, 2k / 8k, 2026-11-30): hd64 +2.7 / +1.9%, causal +2.5 / +2.8%; hd128 +2.0 / +2.3%, causal
  // +1.9 / +2.4%; hd256 -1.2 / -1.5%, causal -1.1 / -0.5%.
  constexpr bool kWholeQueryTiles = kHeadDim <= 128;

  extern __shared__ __align__(128) unsigned char smem_bytes[];  // 128: the swizzled layout XORs address bits
  Element* smem_k = reinterpret_cast<Element*>(smem_bytes);
  Element* smem_v = smem_k + kBlockKeys * Rows::kRowElements;
  Element* smem_pt = smem_v + kBlockKeys * Rows::kRowElements;       // Pᵀ: keys x queries (dV)
  Element* smem_dst = smem_pt + kBlockKeys * ScoreRows::kRowElements;  // dSᵀ: keys x queries (dK, dQ)
  Element* smem_q = smem_dst + kBlockKeys * ScoreRows::kRowElements;   // then num_stages tiles each of Q and dO
  Element* smem_dout = smem_q + num_stages * kQueryTileElements;
  float* smem_lse = reinterpret_cast<float*>(smem_dout + num_stages * kQueryTileElements);
  float* smem_d = smem_lse + num_stages * kBlockQueries;

  if (!kWalkPieces && blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z) >= split.first_walk) return;
  const int num_key_blocks = (params.seqlen_k + kBlockKeys - 1) / kBlockKeys;  // dense batches (pieces only)
  const int walk = kWalkPieces ? split.first_walk + static_cast<int>(blockIdx.y) : 0;
  const int key_block = kWalkPieces ? walk % num_key_blocks : blockIdx.x;
  const int kv_head = kWalkPieces ? walk / num_key_blocks % params.heads_kv : blockIdx.y;
  const int batch = kWalkPieces ? walk / num_key_blocks / params.heads_kv : blockIdx.z;
  const int len_q = static_cast<int>(params.query_span(batch).length);
  const int len_k = static_cast<int>(params.key_span(batch).length);
  const int first_key = key_block * kBlockKeys;
  if (first_key >= len_k) return;  // variable-length batch: past this sequence's keys
  const int valid_keys = min(kBlockKeys, len_k - first_key);
  const BandMask band(params, len_q, len_k);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  // The warp's tiles in the three phases (within the block).
  const int score_first_key = warp % Tile::kScoreKeyWarps * 32;
  const int score_first_query = warp / Tile::kScoreKeyWarps * Tile::kScoreQueries;
  const int grad_first_key = warp % Tile::kGradKeyWarps * Tile::kGradKeys;
  const int grad_first_col = warp / Tile::kGradKeyWarps * Tile::kGradCols;
  const int dq_first_row = warp % Tile::kDqRowWarps * Tile::kDqRows,
            dq_first_col = warp / Tile::kDqRowWarps * Tile::kDqCols;

  // The CTA walks (query head of the GQA group, query block) pairs, over the query blocks holding
  // a row that sees a key of this block (causal / window band).
  const int row_begin = min(len_q, band.first_row_seeing(first_key));
  const int64_t rows_seeing_end = band.end_row_seeing(first_key + valid_keys);
  const int row_end = rows_seeing_end < len_q ? static_cast<int>(rows_seeing_end) : len_q;
  const int first_query_block = row_begin / kBlockQueries;
  const int num_query_blocks = row_end > row_begin ? (row_end + kBlockQueries - 1) / kBlockQueries : first_query_block;
  const int end_head = (kv_head + 1) * params.heads_per_kv();

  // Starts the copies of one query block's Q, dO, lse and D into buffer `stage`, as one group.
  auto load_query_block = [&](int head, int query_block, int stage) {
    const int first_query = query_block * kBlockQueries;
    const int valid_queries = min(kBlockQueries, len_q - first_query);
    const int64_t packed_row = params.query_span(batch).begin + first_query;  // row in the (packed) tensor
    load_tile_async<Tile, kBlockQueries, kWholeQueryTiles>(
        smem_q + stage * kQueryTileElements,
        static_cast<const Element*>(params.q) + batch * params.q_strides.batch + head * params.q_strides.head +
            packed_row * params.q_strides.row,
        params.q_strides.row, valid_queries);
    load_tile_async<Tile, kBlockQueries, kWholeQueryTiles>(
        smem_dout + stage * kQueryTileElements,
        static_cast<const Element*>(params.dout) + batch * params.dout_strides.batch +
            head * params.dout_strides.head + packed_row * params.dout_strides.row,
        params.dout_strides.row, valid_queries);
    if (threadIdx.x < kBlockQueries) {
      const int i = threadIdx.x;
      const bool valid = i < valid_queries;
      const int64_t row_index = params.lse_index(batch, head, first_query + i);
      cp_async_4(smem_address(smem_lse + stage * kBlockQueries + i), params.lse + (valid ? row_index : 0), valid);
      cp_async_4(smem_address(smem_d + stage * kBlockQueries + i), params.softmax_d + (valid ? row_index : 0), valid);
    }
    cp_async_commit();
  };

  // K and V travel in the first query block's copy group.
  const int64_t first_packed_key = params.key_span(batch).begin + first_key;  // row in the (packed) k and v
  load_tile_async<Tile, kBlockKeys>(smem_k,
                                    static_cast<const Element*>(params.k) + batch * params.k_strides.batch +
                                        kv_head * params.k_strides.head + first_packed_key * params.k_strides.row,
                                    params.k_strides.row, valid_keys);
  load_tile_async<Tile, kBlockKeys>(smem_v,
                                    static_cast<const Element*>(params.v) + batch * params.v_strides.batch +
                                        kv_head * params.v_strides.head + first_packed_key * params.v_strides.row,
                                    params.v_strides.row, valid_keys);
  int head = kv_head * params.heads_per_kv();
  int query_block = first_query_block;
  // A piece walks pairs [first, end) of its walk's (query head, query block) pairs, head-major.
  int pairs_left = 0;
  if constexpr (kWalkPieces) {
    const int blocks_per_head = num_query_blocks - first_query_block;
    const int64_t walk_pairs = int64_t{params.heads_per_kv()} * (blocks_per_head > 0 ? blocks_per_head : 0);
    const int first_pair = static_cast<int>(walk_pairs * blockIdx.x / split.pieces);
    pairs_left = static_cast<int>(walk_pairs * (blockIdx.x + 1) / split.pieces) - first_pair;
    if (pairs_left > 0) {
      head += first_pair / blocks_per_head;
      query_block += first_pair % blocks_per_head;
    }
  }
  if (kWalkPieces ? pairs_left > 0 : query_block < num_query_blocks) {
    load_query_block(head, query_block, 0);
  } else {
    cp_async_commit();
    head = end_head;  // nothing to walk
  }

  float acc_dv[kGradMTiles][kGradNTiles][4] = {};
  float acc_dk[kGradMTiles][kGradNTiles][4] = {};
  // Phase 1 operands: A of Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ, B (rows are queries) of both.
  const uint32_t k_lane_addr = a_lane_address<Rows>(smem_address(smem_k), score_first_key, 0);
  const uint32_t v_lane_addr = a_lane_address<Rows>(smem_address(smem_v), score_first_key, 0);
  const uint32_t q_as_bt_addr = b_rows_n_lane_address<Rows>(smem_address(smem_q), score_first_query, 0);
  const uint32_t dout_as_bt_addr = b_rows_n_lane_address<Rows>(smem_address(smem_dout), score_first_query, 0);
  // Phase 2: A of dV += Pᵀ·dO and dK += dSᵀ·Q, B (rows are queries) of both.
  const uint32_t pt_lane_addr = a_lane_address<ScoreRows>(smem_address(smem_pt), grad_first_key, 0);
  const uint32_t dst_lane_addr = a_lane_address<ScoreRows>(smem_address(smem_dst), grad_first_key, 0);
  const uint32_t dout_as_b_addr = b_rows_k_lane_address<Rows>(smem_address(smem_dout), 0, grad_first_col);
  const uint32_t q_as_b_addr = b_rows_k_lane_address<Rows>(smem_address(smem_q), 0, grad_first_col);
  // This thread's score elements: keys thread_key + 16 mi + 8 half (of the sequence), queries
  // thread_query + 8 nj + e (of the block). Zero-filled rows past len_k must get P = 0, or their
  // dS would reach dQ.
  const int thread_key = first_key + score_first_key + lane / 4;
  const int thread_query = score_first_query + 2 * (lane % 4);

  for (int stage = 0; kWalkPieces ? pairs_left > 0 : head < end_head;) {
    int next_head = head, next_query_block = query_block + 1;
    if (next_query_block == num_query_blocks) {
      next_query_block = first_query_block;
      ++next_head;
    }
    const bool has_next = kWalkPieces ? pairs_left > 1 : next_head < end_head;
    cp_async_wait<0>();
    // This block's copies have landed for every thread; every warp is done with the previous
    // block (its buffer, Pᵀ and dSᵀ): the next block may load into that buffer now.
    __syncthreads();
    if (num_stages == 2 && has_next) load_query_block(next_head, next_query_block, stage ^ 1);

    const int first_query = query_block * kBlockQueries;
    const int valid_queries = min(kBlockQueries, len_q - first_query);
    const uint32_t stage_offset = stage * kQueryTileElements * sizeof(Element);
    const float* block_lse = smem_lse + stage * kBlockQueries;
    const float* block_d = smem_d + stage * kBlockQueries;

    // ---- Phase 1: the warp's 32 keys x kScoreQueries of Sᵀ and dPᵀ; Pᵀ and dSᵀ to shared memory.
    {
      float acc_s[kScoreMTiles][kScoreNTiles][4] = {};   // Sᵀ, then Pᵀ in place (dropped and rescaled)
      float acc_dp[kScoreMTiles][kScoreNTiles][4] = {};  // dPᵀ, then dSᵀ in place
      gemm_smem<Element, kScoreMTiles, kScoreNTiles, kHeadDim / 16, kRowsAreMN, Rows, kRowsAreMN, Rows>(
          acc_s, k_lane_addr, q_as_bt_addr + stage_offset);
      gemm_smem<Element, kScoreMTiles, kScoreNTiles, kHeadDim / 16, kRowsAreMN, Rows, kRowsAreMN, Rows>(
          acc_dp, v_lane_addr, dout_as_bt_addr + stage_offset);
      const ScoreMod mod(params, batch, head, len_q, len_k);  // unused (and optimised away) without kExtras
      // The diagonal key of this thread's first query column, as a float (ALiBi distances).
      const float first_query_on_diagonal = mod.row_on_diagonal(first_query + thread_query);
      // Dropout: bit (mi, half, nj, e) set = element kept (all set without dropout).
      uint32_t keep_bits = ~0u;
      if constexpr (kExtras) {
        if (params.has_dropout()) {
          keep_bits = transposed_keep_bits<kScoreMTiles, kScoreNTiles>(
              philox_seed_offset(params), static_cast<uint64_t>(batch) * params.heads_q + head,
              first_query + thread_query, thread_key, params.dropout_threshold);
        }
      }
      const float kept_scale = kExtras && params.has_dropout() ? params.dropout_scale : 1.f;
      // P (and dS) of every element; `masked`: whether any (query, key) of the block lies outside the
      // band or past the sequences' ends (a uniform branch: most blocks need no mask); `dropped`:
      // dropout is on (kExtras only; a separate copy so that softcap / ALiBi without dropout do not
      // pay for the keep selects: 5 instructions per element).
      auto scores_to_gradients = [&](auto masked, auto dropped) {
        // The queries that see each of the thread's keys (masked blocks), in one of two forms that compute
        // the same bounds. Per key: [seen_by.begin, seen_by.end) of BandMask in 64 bits, which the
        // compiler hoists out of the walk (loop-invariant but for first_query). Per block: the bounds of
        // the thread's first key, thread_key, clamped to [-32, kBlockQueries + 32] (its other keys are
        // 8, 16 and 24 further, so the clamps below stay exact in int32). ptxas and the H200 (bf16, 2k /
        // 8k, 2026-11-30) disagree with each other: per block, hd128 loses its 24 B spill but hd64 / 128
        // run 4-5% slower (non-causal too, which never takes this path); hd256 runs 1.2-1.9% faster and
        // loses its 24 B spill. Per block from head_dim 160 (hd256's geometry; 160-224 not measured apart).
        constexpr bool kPerBlockBounds = kHeadDim > 128;
        int lo_base = 0, hi_base = 0;
        if constexpr (decltype(masked)::value && kPerBlockBounds) {
          const int64_t thread_key_on_diagonal = static_cast<int64_t>(thread_key) - band.diagonal_offset - first_query;
          const int64_t lo_unclamped = thread_key_on_diagonal - band.right;
          const int64_t hi_unclamped = thread_key_on_diagonal + band.left;
          lo_base = static_cast<int>(lo_unclamped < -32                  ? -32
                                      : lo_unclamped > kBlockQueries + 32 ? kBlockQueries + 32
                                                                        : lo_unclamped);
          hi_base = static_cast<int>(hi_unclamped < -32                  ? -32
                                      : hi_unclamped > kBlockQueries + 32 ? kBlockQueries + 32
                                                                        : hi_unclamped);
        }
#pragma unroll
        for (int mi = 0; mi < kScoreMTiles; ++mi) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const int key = thread_key + 16 * mi + 8 * half;
            // The queries that see `key`, as query_in_block bounds [lo, hi]: two compares per element.
            // Masked entries get P = 0 by a select, so the exp2 of a row that sees no key (lse = -inf:
            // every entry of it is masked) is never used. Keys past len_k (zero-filled rows) see nothing.
            int lo = 0, hi = kBlockQueries - 1;
            if constexpr (decltype(masked)::value && kPerBlockBounds) {
              lo = min(max(lo_base + 16 * mi + 8 * half, 0), kBlockQueries);
              hi = key >= len_k ? -1 : min(max(hi_base + 16 * mi + 8 * half, -1), valid_queries - 1);
            } else if constexpr (decltype(masked)::value) {
              const IndexRange seen_by = band.queries_seeing_key(key);
              const int64_t lo_unclamped = seen_by.begin - first_query, hi_unclamped = seen_by.end - 1 - first_query;
              lo = lo_unclamped < 0 ? 0 : static_cast<int>(lo_unclamped < kBlockQueries ? lo_unclamped : kBlockQueries);
              hi = hi_unclamped >= valid_queries ? valid_queries - 1
                                                 : static_cast<int>(hi_unclamped < -1 ? -1 : hi_unclamped);
            }
#pragma unroll
            for (int nj = 0; nj < kScoreNTiles; ++nj) {
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                const int query_in_block = thread_query + nj * 8 + e;
                const bool visible = !decltype(masked)::value || (query_in_block >= lo && query_in_block <= hi);
                const int r = 2 * half + e;
                const float lse_log2 = block_lse[query_in_block] * kLog2e;
                // dV takes the dropped, rescaled P; dS = P ∘ (dP ∘ keep·scale − D) ∘ (1 − tanh²)
                // takes P itself, the softcap factor and keep·scale on dP.
                float p, dp = acc_dp[mi][nj][r], grad_factor = 1.f;
                if constexpr (kExtras) {
                  float tanh_value;
                  const float modified =
                      mod.raw_score(acc_s[mi][nj][r], first_query_on_diagonal + static_cast<float>(nj * 8 + e),
                                    static_cast<float>(key), tanh_value);
                  p = visible ? exp2f(fmaf(modified, params.scale_log2, -lse_log2)) : 0.f;
                  grad_factor = 1.f - tanh_value * tanh_value;
                  if constexpr (decltype(dropped)::value) {
                    const bool kept = keep_bits >> (((mi * 2 + half) * kScoreNTiles + nj) * 2 + e) & 1;
                    acc_s[mi][nj][r] = kept ? p * kept_scale : 0.f;
                    dp = kept ? dp * kept_scale : 0.f;
                  } else {
                    acc_s[mi][nj][r] = p;
                  }
                } else {
                  p = visible ? exp2f(fmaf(acc_s[mi][nj][r], params.scale_log2, -lse_log2)) : 0.f;
                  acc_s[mi][nj][r] = p;
                }
                acc_dp[mi][nj][r] = p * grad_factor * (dp - block_d[query_in_block]);
              }
            }
          }
        }
      };
      // Unmasked: every query row of the block is valid and sees every key of it (band rows grow
      // monotonically, so the corners decide; band.end clamps at len_k).
      const bool block_unmasked = valid_queries == kBlockQueries &&
                                  band.begin(first_query + kBlockQueries - 1) <= first_key &&
                                  band.end(first_query) >= first_key + kBlockKeys;
      auto scores_to_gradients_masked_or_not = [&](auto dropped) {
        if (block_unmasked) {
          scores_to_gradients(std::false_type{}, dropped);
        } else {
          scores_to_gradients(std::true_type{}, dropped);
        }
      };
      if (kExtras && params.has_dropout()) {
        // std::true_type where kExtras; plain attention instantiates no dropout copy (the branch is dead there).
        scores_to_gradients_masked_or_not(std::integral_constant<bool, kExtras>{});
      } else {
        scores_to_gradients_masked_or_not(std::false_type{});
      }
      // 16-bit Pᵀ and dSᵀ to shared memory: accumulator registers (0, 1) of (mi, nj) are key row
      // lane/4 of m-tile mi, query columns 2 (lane % 4) and + 1 of n-tile nj; (2, 3) the row + 8.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      // sm90: one stmatrix per 16 keys x 16 queries (n-tiles 2j, 2j + 1) and tile, instead of four 32-bit
      // stores (head_dim 64: 16 instead of 64 per thread and query block). Lane l addresses row l % 8 of
      // matrix l / 8 = (keys + 8 (l / 8 % 2), n-tile 2j + l / 16); the other blocks are immediate offsets.
      static_assert(kScoreNTiles % 2 == 0, "n-tiles in pairs");
      const uint32_t lane_row_offset =
          ScoreRows::offset(score_first_key + lane % 8 + 8 * (lane / 8 % 2), score_first_query + 8 * (lane / 16));
      // One accumulator tile to a shared tile, a 16 x 16 block per stmatrix (all of Pᵀ before dSᵀ:
      // interleaved per block, ptxas spilled 12 / 32 B at hd64).
      auto store_tile = [&](Element* smem_tile, const float (&acc)[kScoreMTiles][kScoreNTiles][4]) {
#pragma unroll
        for (int mi = 0; mi < kScoreMTiles; ++mi) {
#pragma unroll
          for (int j = 0; j < kScoreNTiles / 2; ++j) {
            stmatrix_x4(smem_address(smem_tile) + lane_row_offset + ScoreRows::offset(16 * mi, 16 * j),
                        {pack_float2<Element>(acc[mi][2 * j][0], acc[mi][2 * j][1]),
                         pack_float2<Element>(acc[mi][2 * j][2], acc[mi][2 * j][3]),
                         pack_float2<Element>(acc[mi][2 * j + 1][0], acc[mi][2 * j + 1][1]),
                         pack_float2<Element>(acc[mi][2 * j + 1][2], acc[mi][2 * j + 1][3])});
          }
        }
      };
      store_tile(smem_pt, acc_s);
      store_tile(smem_dst, acc_dp);
#else
#pragma unroll
      for (int mi = 0; mi < kScoreMTiles; ++mi) {
#pragma unroll
        for (int nj = 0; nj < kScoreNTiles; ++nj) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            const uint32_t offset = ScoreRows::offset(score_first_key + 16 * mi + lane / 4 + 8 * half, thread_query + 8 * nj);
            *reinterpret_cast<uint32_t*>(reinterpret_cast<unsigned char*>(smem_pt) + offset) =
                pack_float2<Element>(acc_s[mi][nj][2 * half], acc_s[mi][nj][2 * half + 1]);
            *reinterpret_cast<uint32_t*>(reinterpret_cast<unsigned char*>(smem_dst) + offset) =
                pack_float2<Element>(acc_dp[mi][nj][2 * half], acc_dp[mi][nj][2 * half + 1]);
          }
        }
      }
#endif
    }
    __syncthreads();  // Pᵀ and dSᵀ of the whole block are in shared memory

    // ---- Phase 2: dV += Pᵀ·dO and dK += dSᵀ·Q for the warp's kGradKeys x kGradCols.
    gemm_smem<Element, kGradMTiles, kGradNTiles, kBlockQueries / 16, kRowsAreMN, ScoreRows, kRowsAreK, Rows>(
        acc_dv, pt_lane_addr, dout_as_b_addr + stage_offset);
    gemm_smem<Element, kGradMTiles, kGradNTiles, kBlockQueries / 16, kRowsAreMN, ScoreRows, kRowsAreK, Rows>(
        acc_dk, dst_lane_addr, q_as_b_addr + stage_offset);

    // ---- Phase 3: dQ (kBlockQueries x kHeadDim) += dS·K, added to the fp32 buffer with atomics, a
    // 16-byte one per lane for each 8 x 16 tile of it (DqAccumLayout); the warp's columns go in chunks
    // (the accumulator stays <= 32 floats beside dK, dV).
    if (fused_dq) {
      constexpr int kChunkCols = Tile::kDqChunkCols;
      constexpr int kTileCols = DqAccumLayout::kTileCols;
      const uint32_t ds_lane_addr = a_transposed_lane_address<ScoreRows>(smem_address(smem_dst), 0, dq_first_row);  // A: dS = (dSᵀ)ᵀ
      const uint32_t k_as_b_addr = b_rows_k_lane_address<Rows>(smem_address(smem_k), 0, dq_first_col);             // B: K
      const DqAccumLayout dq_layout{params.dq_accum_rows, kHeadDim};
      constexpr int kRowGroupStride = DqAccumLayout::row_group_stride(kHeadDim);
      static_assert(kBlockQueries <= DqAccumLayout::kOverhangRows, "blocks past the last sequence stay in the buffer");
      const int64_t sequence_begin =
          params.is_varlen() ? params.query_span(batch).begin : static_cast<int64_t>(batch) * params.seqlen_q;
      const int64_t accum_row = DqAccumLayout::first_row(sequence_begin, batch) + first_query + dq_first_row;
      // This lane's 4 floats of the warp's first tile (rows dq_first_row .. + 7, columns dq_first_col .. + 15);
      // every other tile of the warp is a compile-time offset from it.
      float* dq_accum_lane = params.dq_accum + dq_layout.tile_offset(accum_row, head, dq_first_col) + 4 * lane;
#pragma unroll
      for (int chunk = 0; chunk < Tile::kDqCols / kChunkCols; ++chunk) {
        float acc_dq[kDqMTiles][kChunkCols / 8][4] = {};
        gemm_smem<Element, kDqMTiles, kChunkCols / 8, kBlockKeys / 16, kRowsAreK, ScoreRows, kRowsAreK, Rows>(
            acc_dq, ds_lane_addr, Rows::move(k_as_b_addr, 0, chunk * kChunkCols));
#pragma unroll
        for (int mi = 0; mi < kDqMTiles; ++mi) {
#pragma unroll
          for (int half = 0; half < 2; ++half) {
            // Rows past the sequence's end (dS = 0) are added too: DqAccumLayout says where they land.
#pragma unroll
            for (int pair = 0; pair < kChunkCols / kTileCols; ++pair) {
              atomic_add_float4(dq_accum_lane + (2 * mi + half) * kRowGroupStride +
                                    (chunk * kChunkCols / kTileCols + pair) * DqAccumLayout::kTileFloats,
                                acc_dq[mi][2 * pair][2 * half], acc_dq[mi][2 * pair][2 * half + 1],
                                acc_dq[mi][2 * pair + 1][2 * half], acc_dq[mi][2 * pair + 1][2 * half + 1]);
            }
          }
        }
      }
    }

    if (num_stages == 1 && has_next) {
      __syncthreads();  // every warp is done with this block's buffer
      load_query_block(next_head, next_query_block, 0);
    }
    head = next_head;
    query_block = next_query_block;
    if (num_stages == 2) stage ^= 1;
    if constexpr (kWalkPieces) --pairs_left;
  }

  if constexpr (kWalkPieces) {  // this piece's share of the walk's dK and dV, scaled as below
    float* dk_sum = params.dkv_accum + int64_t{blockIdx.y} * 2 * kBlockKeys * kHeadDim;
    float* dv_sum = dk_sum + kBlockKeys * kHeadDim;
#pragma unroll
    for (int mi = 0; mi < kGradMTiles; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int key = grad_first_key + 16 * mi + lane / 4 + 8 * half;  // in the block
#pragma unroll
        for (int nd = 0; nd < kGradNTiles; ++nd) {
          const int at = key * kHeadDim + grad_first_col + nd * 8 + 2 * (lane % 4);
          atomicAdd(dv_sum + at, acc_dv[mi][nd][2 * half]);
          atomicAdd(dv_sum + at + 1, acc_dv[mi][nd][2 * half + 1]);
          atomicAdd(dk_sum + at, acc_dk[mi][nd][2 * half] * params.softmax_scale);
          atomicAdd(dk_sum + at + 1, acc_dk[mi][nd][2 * half + 1] * params.softmax_scale);
        }
      }
    }
    return;
  }

  // Each thread writes keys grad_first_key + 16 mi + lane/4 (+ 8) and two columns per n-tile.
  Element* dk = static_cast<Element*>(params.dk) + batch * params.dk_strides.batch + kv_head * params.dk_strides.head;
  Element* dv = static_cast<Element*>(params.dv) + batch * params.dv_strides.batch + kv_head * params.dv_strides.head;
  const int64_t first_packed_row = params.key_span(batch).begin;
#pragma unroll
  for (int mi = 0; mi < kGradMTiles; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int key_in_sequence = first_key + grad_first_key + 16 * mi + lane / 4 + 8 * half;
      if (key_in_sequence >= len_k) continue;
      const int64_t key = first_packed_row + key_in_sequence;  // row in the (packed) dk and dv
#pragma unroll
      for (int nd = 0; nd < kGradNTiles; ++nd) {
        const int col = grad_first_col + nd * 8 + 2 * (lane % 4);
        *reinterpret_cast<uint32_t*>(dv + key * params.dv_strides.row + col) =
            pack_float2<Element>(acc_dv[mi][nd][2 * half], acc_dv[mi][nd][2 * half + 1]);
        *reinterpret_cast<uint32_t*>(dk + key * params.dk_strides.row + col) = pack_float2<Element>(
            acc_dk[mi][nd][2 * half] * params.softmax_scale, acc_dk[mi][nd][2 * half + 1] * params.softmax_scale);
      }
    }
  }
}

}  // namespace flash_ext::sm80
