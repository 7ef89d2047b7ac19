// Backward of attention on mma.sync (sm80 and newer), by recomputation: nothing of size
// seqlen_q x seqlen_k is stored; P is rebuilt from q, k and the forward's lse.
//
// With S = scale · Q·Kᵀ, P = softmax(S), O = P·V and D_i = rowsum(dO ∘ O)_i:
//   dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P ∘ (dP − D),  dK = scale · dSᵀ·Q,  dQ = scale · dS·K.
//
// Launches:
//   1. the fp32 dQ accumulator zeroed (a memset); preprocess: D for every query row;
//   2. dK/dV: a CTA per (key block, kv head) keeps K and V in shared memory, walks every query
//      block (and every query head of its GQA group) that can see them, and accumulates dK and
//      dV in registers. Per query block it computes the transposed tiles Sᵀ = K·Qᵀ and
//      dPᵀ = V·dOᵀ, puts Pᵀ and dSᵀ in shared memory, and from there dV += Pᵀ·dO, dK += dSᵀ·Q
//      and, with deterministic = false, dQ += dS·K, added into an fp32 buffer with atomics
//      (FlashAttention-2's 5 GEMMs; warp tiles in bwd_tile_config.h);
//   3. deterministic = false: dQ = scale · buffer, rounded (convert kernel);
//      deterministic = true: a dQ kernel per query block recomputes S and dP against the key
//      blocks it sees and accumulates dQ in registers: 7 GEMMs instead of 5, no atomics, so the
//      gradients are bit-reproducible.
#pragma once

#include <cstdint>

#include "../common/band_mask.cuh"
#include "../common/dq_accum_layout.h"
#include "../common/dropout_bits.cuh"
#include "../common/finished_walks.cuh"
#include "../common/philox.h"
#include "../common/ptx.cuh"
#include "../common/score_mod.cuh"
#include "../common/tile_copy.cuh"
#include "../common/warp_gemm.cuh"
#include "../params.h"
#include "bwd_tile_config.h"

namespace flash_ext::sm80 {

constexpr float kLog2e = 1.4426950408889634f;

// The dQ accumulator row (DqAccumLayout) of query row `row` of batch entry `batch`, numbered as the
// preprocess kernel numbers them: a variable-length batch is one packed entry whose
// sequence is looked up in cu_seqlens_q (binary search: the last b with cu_seqlens_q[b] <= row, which
// skips sequences of length 0).
__device__ __forceinline__ int64_t dq_accum_row(const BwdParams& params, int64_t batch, int64_t row) {
  if (!params.is_varlen()) return DqAccumLayout::first_row(batch * params.seqlen_q, batch) + row;
  int lo = 0, hi = params.batch;  // cu_seqlens_q[lo] <= row < cu_seqlens_q[hi]
  while (hi - lo > 1) {
    const int mid = (lo + hi) / 2;
    if (params.cu_seqlens_q[mid] <= row) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return DqAccumLayout::first_row(params.cu_seqlens_q[lo], lo) + row - params.cu_seqlens_q[lo];
}

// The preprocess kernel's lanes per (row, head): the row's 16-byte chunks of 16-bit elements, two per lane
// (more loads in flight per thread, and each warp's index arithmetic shared by more rows), rounded up to a
// power of 2 (a shuffle reduction within the lanes' group of the warp).
constexpr int kPreprocessChunksPerLane = 2;
constexpr int preprocess_lanes_per_row(int head_dim) {
  const int lanes = (head_dim / 8 + kPreprocessChunksPerLane - 1) / kPreprocessChunksPerLane;
  return lanes <= 1 ? 1 : lanes <= 2 ? 2 : lanes <= 4 ? 4 : lanes <= 8 ? 8 : 16;
}

// D = sum_d dout * out per query row, in fp32, and with params.row_stats the row's lse * log2(e) and D
// copied there too (the sm90 dK/dV kernel's layout). kLanesPerRow lanes per (row, head), two 16-byte chunks
// of dout and of out each, so that every lane has loads in flight (H200, 16k tokens x 16 heads, hd128: one
// warp per row, half of its lanes idle, took 95.7 us with the accumulator's zeroing; one chunk per lane 48.8
// us, two 42.1 us, four 44.3 us; rows fastest 41.3 us, heads fastest 42.0).
// Rows are numbered through the batch: rows_per_batch is seqlen_q for a dense batch; a variable-length batch
// is one packed "batch" of total_q rows (its batch strides are 0).
// It also zeroes `zeros` (the fp32 dQ accumulator and the sm90 kernel's counters after it, zero_count 16-byte
// chunks; none when deterministic): each thread a strided share, 16-byte stores, instead of a memset of
// its own before this kernel (H200, hd128, 16k x 16 heads: 69.3 us against 30.5 + 41.2 us).
template <int kHeadDim, typename Element>
__global__ void __launch_bounds__(256)
    attention_bwd_preprocess_kernel(const __grid_constant__ BwdParams params, const int64_t rows_per_batch,
                                    const int64_t num_rows, float4* zeros, const int64_t zero_count) {
  // The sm90 dK/dV kernel is launched as a programmatic dependent: it sets up and loads K / V while this
  // grid's last CTAs run, and waits for all of it before reading anything this kernel writes.
  allow_dependent_launch();
  {
    const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < zero_count; i += threads) {
      zeros[i] = make_float4(0.f, 0.f, 0.f, 0.f);
    }
  }
  constexpr int kElementsPerChunk = 16 / sizeof(Element);
  constexpr int kChunks = kHeadDim / kElementsPerChunk;
  static_assert(kHeadDim % kElementsPerChunk == 0 && kChunks <= 32, "the preprocess kernel's head dims");
  constexpr int kLanesPerRow = preprocess_lanes_per_row(kHeadDim);
  static_assert(kChunks <= kLanesPerRow * kPreprocessChunksPerLane, "preprocess_lanes_per_row covers the row");
  // Rows fastest, then heads: a warp's rows are consecutive in lse, D and row_stats, so its 4-byte reads and
  // writes of them coalesce (with heads fastest, each was a sector of its own).
  const int64_t row_id = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kLanesPerRow;
  const int chunk = threadIdx.x % kLanesPerRow;
  const bool valid_row = row_id < num_rows * params.heads_q;
  int head = 0;
  int64_t row = 0, batch = 0;
  float sum = 0.f;
  if (valid_row) {
    head = static_cast<int>(row_id / num_rows);
    const int64_t token = row_id - head * num_rows;
    batch = token / rows_per_batch;
    row = token - batch * rows_per_batch;
    const Element* dout = static_cast<const Element*>(params.dout) + batch * params.dout_strides.batch +
                          row * params.dout_strides.row + head * params.dout_strides.head;
    const Element* out = static_cast<const Element*>(params.out) + batch * params.out_strides.batch +
                         row * params.out_strides.row + head * params.out_strides.head;
    uint4 dout_chunks[kPreprocessChunksPerLane], out_chunks[kPreprocessChunksPerLane];
#pragma unroll
    for (int c = 0; c < kPreprocessChunksPerLane; ++c) {  // chunks chunk, chunk + kLanesPerRow
      const int col = (chunk + c * kLanesPerRow) * kElementsPerChunk;
      if (col < kHeadDim) {
        dout_chunks[c] = *reinterpret_cast<const uint4*>(dout + col);
        out_chunks[c] = *reinterpret_cast<const uint4*>(out + col);
      } else {
        dout_chunks[c] = out_chunks[c] = make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int c = 0; c < kPreprocessChunksPerLane; ++c) {
      const Element* dout_values = reinterpret_cast<const Element*>(&dout_chunks[c]);
      const Element* out_values = reinterpret_cast<const Element*>(&out_chunks[c]);
#pragma unroll
      for (int e = 0; e < kElementsPerChunk; ++e) sum += to_float(dout_values[e]) * to_float(out_values[e]);
    }
  }
  // The row's lanes are kLanesPerRow consecutive lanes of one warp.
#pragma unroll
  for (int offset = kLanesPerRow / 2; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
  if (!valid_row || chunk != 0) return;
  params.softmax_d[batch * params.lse_batch_stride + head * params.lse_head_stride + row] = sum;
  if (params.row_stats != nullptr) {
    const int64_t at = head * params.dq_accum_rows + dq_accum_row(params, batch, row);
    params.row_stats[at] = params.lse[params.lse_index(batch, head, row)] * kLog2e;
    params.row_stats[params.heads_q * params.dq_accum_rows + at] = sum;
  }
}

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

// dq = softmax_scale · dq_accum, rounded to the input dtype. A warp per (row group of 8 accumulator rows,
// head, pair of 16-column tiles): the accumulator is read in memory order, each load instruction one whole
// 512-byte tile (lane l: row l / 4, float4 l % 4 of it), and the warp's 1 KB is contiguous. (One thread per
// tile row, the warps' lanes 512 bytes apart: 64.3 us at hd128, 16k x 16 heads on the H200, 3.1 TB/s.)
// Float4 q of a row holds columns 2q, 2q + 1 (x, y) and 8 + 2q, 8 + 2q + 1 (z, w) (DqAccumLayout); two
// shuffles within each quad give lane q of it columns 4q .. 4q + 3, so each store instruction writes 8 rows
// x 32 contiguous bytes.
// Warp order: dense, batch, then head, then the sequence's row groups (row_groups per sequence): the order
// in which the dK/dV kernel finishes them, for the overlap of finished_walks.cuh; variable-length, head, then
// all row_groups of the accumulator (padding groups between sequences are read, not stored).
// wait.keys_per_walk > 0: launched to overlap the sm90 dK/dV kernel, each warp first waits for its
// sequence's (batch, kv head) walks (params.dkdv_finished).
struct DkDvWait {
  int keys_per_walk = 0;        // the dK/dV kernel's keys per walk; 0: it has finished (no wait)
  int key_blocks_launched = 0;  // its key blocks per (batch, kv head)
};

template <int kHeadDim, typename Element>
__global__ void __launch_bounds__(256)
    attention_bwd_convert_dq_kernel(const __grid_constant__ BwdParams params, const int64_t row_groups,
                                    const DkDvWait wait) {
  static_assert(kHeadDim % (2 * DqAccumLayout::kTileCols) == 0, "whole pairs of tiles");
  constexpr int kTilePairs = kHeadDim / (2 * DqAccumLayout::kTileCols);
  const int64_t warp_id = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  const int pair = warp_id % kTilePairs;
  const int64_t unit = warp_id / kTilePairs;
  if (unit >= params.heads_q * row_groups * (params.is_varlen() ? 1 : params.batch)) return;  // whole warps
  const int64_t group = unit % row_groups;
  int sequence, head;
  int64_t begin, length, accum_row0;
  if (params.is_varlen()) {
    head = static_cast<int>(unit / row_groups);
    accum_row0 = group * DqAccumLayout::kTileRows;
    // The sequence whose accumulator rows hold this group: the last b with first_row(b) <= accum_row0
    // (sequences are 8-aligned there, DqAccumLayout::first_row).
    int lo = 0, hi = params.batch;
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (DqAccumLayout::first_row(params.cu_seqlens_q[mid], mid) <= accum_row0) {
        lo = mid;
      } else {
        hi = mid;
      }
    }
    sequence = lo;
    begin = params.cu_seqlens_q[sequence];
    length = params.cu_seqlens_q[sequence + 1] - begin;
    accum_row0 -= DqAccumLayout::first_row(begin, sequence);  // within the sequence, from here on
  } else {
    head = static_cast<int>(unit / row_groups % params.heads_q);
    sequence = static_cast<int>(unit / row_groups / params.heads_q);
    begin = int64_t{sequence} * params.seqlen_q;
    length = params.seqlen_q;
    accum_row0 = group * DqAccumLayout::kTileRows;
  }
  const int64_t row = accum_row0 + lane / 4;  // within the sequence
  const bool stored = row < length;
  // A variable-length batch is one packed entry: its rows are numbered through all sequences.
  Element* dq = static_cast<Element*>(params.dq) +
                (params.is_varlen() ? (begin + row) * params.dq_strides.row
                                    : sequence * params.dq_strides.batch + row * params.dq_strides.row) +
                head * params.dq_strides.head;
  if (wait.keys_per_walk > 0) {
    const int kv_head = head / params.heads_per_kv();
    const int64_t counter = kFinishedCounterStride * (int64_t{sequence} * params.heads_kv + kv_head);
    wait_for_finished_walks(
        &params.dkdv_finished[counter],
        counted_walks(params.key_span(sequence).length, wait.keys_per_walk, wait.key_blocks_launched));
  }

  const DqAccumLayout layout{params.dq_accum_rows, kHeadDim};
  const int first_col = 2 * pair * DqAccumLayout::kTileCols;
  const float4* src = reinterpret_cast<const float4*>(
      params.dq_accum + layout.tile_offset(DqAccumLayout::first_row(begin, sequence) + accum_row0, head, first_col));
  float4 f[2];
#pragma unroll
  for (int t = 0; t < 2; ++t) f[t] = __ldcg(&src[t * 32 + lane]);  // tiles are 32 float4 long and adjacent

  // Quad lane q holds a = columns 2q, 2q + 1 and b = 8 + 2q, 8 + 2q + 1 of its row; it is to store
  // 4q .. 4q + 3, i.e. lanes 0, 1 the a's of lanes (0, 1), (2, 3), lanes 2, 3 the b's of (0, 1), (2, 3).
  // First shuffle: from lane ((q & 1) << 1) | (q >> 1), which sends a if it is even, b if odd; second:
  // from that lane ^ 1, which sends the other kind.
  const int q = lane % 4;
  const int source = (lane & ~3) | ((q & 1) << 1) | (q >> 1);
  const float s = params.softmax_scale;
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const uint32_t a = pack_float2<Element>(f[t].x * s, f[t].y * s);
    const uint32_t b = pack_float2<Element>(f[t].z * s, f[t].w * s);
    const uint32_t first = __shfl_sync(0xffffffff, q % 2 == 0 ? a : b, source);
    const uint32_t second = __shfl_sync(0xffffffff, q % 2 == 1 ? a : b, source ^ 1);
    if (stored) {
      *reinterpret_cast<uint2*>(dq + first_col + t * DqAccumLayout::kTileCols + 4 * q) =
          q < 2 ? make_uint2(first, second) : make_uint2(second, first);
    }
  }
}

// dk and dv of the split tail walks (TailSplit) from the pieces' sums in params.dkv_accum: 8 columns of
// one key row of dK or dV per thread.
template <int kHeadDim, int kBlockKeys, typename Element>
__global__ void __launch_bounds__(256)
    attention_bwd_convert_dkv_kernel(const __grid_constant__ BwdParams params, const TailSplit split,
                                     const int num_split_walks) {
  constexpr int kChunksPerRow = kHeadDim / 8;
  const int64_t id = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (id >= int64_t{num_split_walks} * 2 * kBlockKeys * kChunksPerRow) return;
  const int col = id % kChunksPerRow * 8;
  const int key_in_block = id / kChunksPerRow % kBlockKeys;
  const bool is_dv = id / kChunksPerRow / kBlockKeys % 2 == 1;
  const int split_walk = static_cast<int>(id / kChunksPerRow / kBlockKeys / 2);
  const int num_key_blocks = (params.seqlen_k + kBlockKeys - 1) / kBlockKeys;
  const int walk = split.first_walk + split_walk;
  const int key = walk % num_key_blocks * kBlockKeys + key_in_block;
  if (key >= params.seqlen_k) return;
  const int kv_head = walk / num_key_blocks % params.heads_kv;
  const int batch = walk / num_key_blocks / params.heads_kv;
  const float4* src = reinterpret_cast<const float4*>(params.dkv_accum +
                                                      ((int64_t{split_walk} * 2 + is_dv) * kBlockKeys + key_in_block) *
                                                          kHeadDim +
                                                      col);
  const float4 a = src[0], b = src[1];
  const TensorStrides& strides = is_dv ? params.dv_strides : params.dk_strides;
  Element* dst = static_cast<Element*>(is_dv ? params.dv : params.dk) + batch * strides.batch +
                 kv_head * strides.head + key * strides.row + col;
  *reinterpret_cast<uint4*>(dst) = {pack_float2<Element>(a.x, a.y), pack_float2<Element>(a.z, a.w),
                                    pack_float2<Element>(b.x, b.y), pack_float2<Element>(b.z, b.w)};
}

// num_stages (1 or 2): key-block buffers in shared memory, chosen by the host (buffer_stages).
template <typename Tile, typename Element, bool kExtras>
__global__ void __launch_bounds__(Tile::kThreads)
    attention_bwd_dq_kernel(const __grid_constant__ BwdParams params, const int num_stages) {
  constexpr int kHeadDim = Tile::kHeadDim;
  using Rows = typename Tile::Rows;
  constexpr int kBlockKeys = Tile::kBlockKeys;
  constexpr int kBlockQueries = Tile::kBlockQueries;
  constexpr int kNTilesK = kBlockKeys / 8;  // score-tile columns are keys here
  constexpr int kNTilesD = kHeadDim / 8;

  extern __shared__ __align__(128) unsigned char smem_bytes[];  // 128: the swizzled layout XORs address bits
  Element* smem_q = reinterpret_cast<Element*>(smem_bytes);
  Element* smem_dout = smem_q + kBlockQueries * Rows::kRowElements;
  // num_stages buffers of (K, V).
  constexpr int kKvStageElements = 2 * kBlockKeys * Rows::kRowElements;
  Element* smem_k = smem_dout + kBlockQueries * Rows::kRowElements;  // stage s: + s * kKvStageElements
  Element* smem_v = smem_k + kBlockKeys * Rows::kRowElements;

  const int query_block = blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int kv_head = head / params.heads_per_kv();
  const int len_q = static_cast<int>(params.query_span(batch).length);
  const int len_k = static_cast<int>(params.key_span(batch).length);
  const int first_query = query_block * kBlockQueries;
  if (first_query >= len_q) return;  // variable-length batch: past this sequence's end
  const int valid_queries = min(kBlockQueries, len_q - first_query);
  const BandMask band(params, len_q, len_k);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t first_packed_query = params.query_span(batch).begin + first_query;  // row in the (packed) q

  load_tile_async<Tile, kBlockQueries>(smem_q,
                                       static_cast<const Element*>(params.q) + batch * params.q_strides.batch +
                                           head * params.q_strides.head + first_packed_query * params.q_strides.row,
                                       params.q_strides.row, valid_queries);
  load_tile_async<Tile, kBlockQueries>(smem_dout,
                                       static_cast<const Element*>(params.dout) + batch * params.dout_strides.batch +
                                           head * params.dout_strides.head +
                                           first_packed_query * params.dout_strides.row,
                                       params.dout_strides.row, valid_queries);
  cp_async_commit();

  // This thread's two rows: lse (as a base-2 exponent) and D.
  float row_lse_log2[2], row_d[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row_in_block = warp * 16 + lane / 4 + 8 * half;
    const bool valid = row_in_block < valid_queries;
    const int64_t row_index = params.lse_index(batch, head, valid ? first_query + row_in_block : 0);
    const float lse = valid ? params.lse[row_index] : -INFINITY;
    row_lse_log2[half] = lse == -INFINITY ? INFINITY : lse * kLog2e;  // P = 0 for rows that saw no key
    row_d[half] = valid ? params.softmax_d[row_index] : 0.f;
  }

  // Keys some row of the block sees: the first row's band start to the last row's band end.
  const int key_begin = band.begin(first_query);
  const int key_end = band.end(first_query + valid_queries - 1);
  const int first_key_block = key_begin / kBlockKeys;
  const int num_key_blocks = key_end > key_begin ? (key_end + kBlockKeys - 1) / kBlockKeys : 0;
  const ScoreMod mod(params, batch, head, len_q, len_k);  // unused (and optimised away) without kExtras

  float acc_dq[1][kNTilesD][4] = {};
  const uint32_t q_lane_addr = a_lane_address<Rows>(smem_address(smem_q), warp * 16, 0);        // A of S = Q·Kᵀ
  const uint32_t dout_lane_addr = a_lane_address<Rows>(smem_address(smem_dout), warp * 16, 0);  // A of dP = dO·Vᵀ
  const uint32_t k_as_bt_addr = b_rows_n_lane_address<Rows>(smem_address(smem_k), 0, 0);
  const uint32_t v_as_bt_addr = b_rows_n_lane_address<Rows>(smem_address(smem_v), 0, 0);
  const uint32_t k_as_b_addr = b_rows_k_lane_address<Rows>(smem_address(smem_k), 0, 0);  // B of dQ += dS·K

  // Starts the copies of one key block's K and V into buffer `stage`, as one group.
  auto load_key_block = [&](int key_block, int stage) {
    const int first_key = key_block * kBlockKeys;
    const int64_t first_packed_key = params.key_span(batch).begin + first_key;
    load_tile_async<Tile, kBlockKeys>(smem_k + stage * kKvStageElements,
                                      static_cast<const Element*>(params.k) + batch * params.k_strides.batch +
                                          kv_head * params.k_strides.head + first_packed_key * params.k_strides.row,
                                      params.k_strides.row, len_k - first_key);
    load_tile_async<Tile, kBlockKeys>(smem_v + stage * kKvStageElements,
                                      static_cast<const Element*>(params.v) + batch * params.v_strides.batch +
                                          kv_head * params.v_strides.head + first_packed_key * params.v_strides.row,
                                      params.v_strides.row, len_k - first_key);
    cp_async_commit();
  };
  if (first_key_block < num_key_blocks) load_key_block(first_key_block, 0);

  for (int key_block = first_key_block, stage = 0; key_block < num_key_blocks; ++key_block) {
    const int first_key = key_block * kBlockKeys;
    const bool has_next = key_block + 1 < num_key_blocks;
    cp_async_wait<0>();
    // This block's K and V (and Q, dO the first time) have landed for every thread; every warp is
    // done with the other buffer (the previous block): the next block may load into it.
    __syncthreads();
    if (num_stages == 2 && has_next) load_key_block(key_block + 1, stage ^ 1);
    const uint32_t stage_offset = stage * kKvStageElements * sizeof(Element);

    float acc_s[1][kNTilesK][4] = {};
    gemm_smem<Element, 1, kNTilesK, kHeadDim / 16, kRowsAreMN, Rows, kRowsAreMN, Rows>(acc_s, q_lane_addr,
                                                                                       k_as_bt_addr + stage_offset);
    float acc_ds[1][kNTilesK][4] = {};  // dP, then dS in place
    gemm_smem<Element, 1, kNTilesK, kHeadDim / 16, kRowsAreMN, Rows, kRowsAreMN, Rows>(acc_ds, dout_lane_addr,
                                                                                       v_as_bt_addr + stage_offset);
    const float first_key_of_thread = static_cast<float>(first_key + 2 * (lane % 4));
    // Dropout keep bits: bit 2 * kNTilesK * half + 2 * nj + e for (row of `half`, key nj * 8 + 2 * (lane % 4) + e).
    uint32_t keep_bits = ~0u;
    if constexpr (kExtras) {
      if (params.has_dropout()) {
        static_assert(2 * 2 * kNTilesK <= 32, "one 32-bit keep mask");
        const PhiloxSeedOffset rng = philox_seed_offset(params);
        const uint64_t batch_head = static_cast<uint64_t>(batch) * params.heads_q + head;
        keep_bits = 0;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          keep_bits |= row_keep_bits<kNTilesK>(rng, batch_head, first_query + warp * 16 + lane / 4 + 8 * half,
                                               first_key, params.dropout_threshold)
                       << (2 * kNTilesK * half);
        }
      }
    }
    const float kept_scale = kExtras && params.has_dropout() ? params.dropout_scale : 1.f;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = first_query + warp * 16 + lane / 4 + 8 * half;
      const float row_on_diagonal = mod.row_on_diagonal(row);
#pragma unroll
      for (int nj = 0; nj < kNTilesK; ++nj) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = first_key + nj * 8 + 2 * (lane % 4) + e;
          const int r = 2 * half + e;
          const bool visible = band.sees(row, key);
          const float key_position = first_key_of_thread + static_cast<float>(nj * 8 + e);  // ALiBi
          float prob, grad_factor = 1.f;  // grad_factor: d(modified score) / d(scaled score)
          if constexpr (kExtras) {
            float tanh_value;
            const float modified = mod.raw_score(acc_s[0][nj][r], row_on_diagonal, key_position, tanh_value);
            prob = visible ? exp2f(fmaf(modified, params.scale_log2, -row_lse_log2[half])) : 0.f;
            grad_factor = 1.f - tanh_value * tanh_value;
          } else {
            prob = visible ? exp2f(fmaf(acc_s[0][nj][r], params.scale_log2, -row_lse_log2[half])) : 0.f;
          }
          float dp = acc_ds[0][nj][r];
          if constexpr (kExtras) {  // dropout: dP of a dropped element is 0, of a kept one scaled
            const bool kept = keep_bits >> (2 * kNTilesK * half + 2 * nj + e) & 1u;
            dp = kept ? dp * kept_scale : 0.f;
          }
          acc_ds[0][nj][r] = prob * (dp - row_d[half]) * grad_factor;
        }
      }
    }
    uint32_t ds_frag[1][kBlockKeys / 16][4];
    accumulator_to_a_fragments<Element>(acc_ds, ds_frag);
    gemm_rs_ab<Element, 1, kNTilesD, kBlockKeys / 16, Rows>(acc_dq, ds_frag, k_as_b_addr + stage_offset);

    if (num_stages == 1 && has_next) {
      __syncthreads();  // every warp is done with this block's K and V
      load_key_block(key_block + 1, 0);
    }
    if (num_stages == 2) stage ^= 1;
  }

  Element* dq = static_cast<Element*>(params.dq) + batch * params.dq_strides.batch + head * params.dq_strides.head;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row_in_block = warp * 16 + lane / 4 + 8 * half;
    if (row_in_block >= valid_queries) continue;
    const int64_t row = params.query_span(batch).begin + first_query + row_in_block;  // row in the (packed) dq
#pragma unroll
    for (int nd = 0; nd < kNTilesD; ++nd) {
      *reinterpret_cast<uint32_t*>(dq + row * params.dq_strides.row + nd * 8 + 2 * (lane % 4)) = pack_float2<Element>(
          acc_dq[0][nd][2 * half] * params.softmax_scale, acc_dq[0][nd][2 * half + 1] * params.softmax_scale);
    }
  }
}

}  // namespace flash_ext::sm80
