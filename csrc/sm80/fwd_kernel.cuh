// FlashAttention-2-style forward kernel on mma.sync (sm80 and newer).
//
// One CTA computes kBlockM query rows of one (batch, head). Q is loaded to shared memory
// once; K and V tiles of kBlockN keys stream through shared memory with cp.async, each load
// overlapping the other tile's math (V[n] loads during S = Q·K[n]ᵀ and the softmax, K[n-1]
// loads during O += P·V[n]). Scores and probabilities live in registers: P is converted to
// 16 bits in place and used directly as the A operand of the P·V mma.
//
// Key blocks are visited from the last to the first, so for causal the blocks that need an
// element-wise mask (the ragged end of the keys, the blocks crossing the diagonal) come first.
// Only the key blocks inside the row block's band (causal / sliding window) are visited.
//
// Variable-length batches: blockIdx.z is the sequence; its rows start at cu_seqlens (params.h's
// query_span / key_span), and row blocks past its end exit at once. Softcap and ALiBi change each
// score (common/score_mod.cuh) and dropout zeroes probabilities after the row sums took them
// (common/philox.h); kExtras compiles those in, so plain attention does not pay for them.
#pragma once

#include <cstdint>

#include "../common/band_mask.cuh"
#include "../common/dropout_bits.cuh"
#include "../common/online_softmax.cuh"
#include "../common/philox.h"
#include "../common/ptx.cuh"
#include "../common/score_mod.cuh"
#include "../common/score_tile.cuh"
#include "../common/tile_copy.cuh"
#include "../common/warp_gemm.cuh"
#include "../params.h"
#include "fwd_tile_config.h"

namespace flash_ext::sm80 {

template <typename Config, typename Element, bool kExtras>
__global__ void __launch_bounds__(Config::kThreads, kExtras ? 1 : Config::kMinCtasPerSm)
    attention_fwd_kernel(const __grid_constant__ FwdParams params) {
  constexpr int kHeadDim = Config::kHeadDim;
  constexpr int kBlockM = Config::kBlockM;
  constexpr int kBlockN = Config::kBlockN;
  constexpr int kMTiles = Config::kMTiles;
  using Rows = typename Config::Rows;
  constexpr int kNTilesS = kBlockN / 8;   // mma n-tiles across one score block
  constexpr int kNTilesO = kHeadDim / 8;  // mma n-tiles across the output's head dim
  constexpr int kChunksPerRow = kHeadDim * sizeof(Element) / 16;
  // K / V copies of whole tiles by tile_copy.cuh's unrolled path: in the softcap / ALiBi / dropout
  // variant at head_dim 128 only (H200, bf16, 16k tokens, 8k, 2026-11-30): softcap 3.52 -> 3.30 ms, ALiBi
  // flat; plain hd128 (2k / 8k) +0.6 / +0.2%, causal +3.8 / +1.4%, but beside the warp skip below ptxas
  // spills 88 / 80 B there, and the skip alone gains as much without spills; hd256 -2.8 / -3.3%, causal
  // -1.9 / -3.7%; at hd64 ptxas spills 48 / 36 B with it.
  constexpr bool kWholeKvTiles = kHeadDim == 128 && kExtras;

  // The tile copies re-read the thread index where Config says so (hd <= 64, register-capped) and, with
  // 32-row warps (hd96 / 128), in the softcap / ALiBi / dropout variant, where ptxas spills the thread
  // index otherwise (8-24 B; CUDA 13.0, sm_90a). Not in plain attention at hd96 / 128: -1% at hd128 (H200,
  // bf16, 2k-16k, 2026-11-30), and it spills nothing without.
  using CopyTile = std::conditional_t<kExtras && Config::kRowsPerWarp == 32, RereadThreadIndex<Config>, Config>;

  extern __shared__ __align__(128) unsigned char smem_bytes[];  // 128: the swizzled layout XORs address bits
  Element* smem_q = reinterpret_cast<Element*>(smem_bytes);
  Element* smem_k = smem_q + kBlockM * Rows::kRowElements;
  Element* smem_v = smem_k + kBlockN * Rows::kRowElements;

  // Heaviest query blocks (causal: the last ones) are launched first for a better tail.
  if constexpr (kExtras) publish_rng_state(params);
  const int m_block = gridDim.x - 1 - blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int kv_head = head / params.heads_per_kv();
  const SequenceSpan q_span = params.query_span(batch);
  const SequenceSpan k_span = params.key_span(batch);
  const int len_q = static_cast<int>(q_span.length);
  const int len_k = static_cast<int>(k_span.length);
  const int first_row = m_block * kBlockM;
  // The loop and the epilogue take first_row from here. For sm_80, plain attention forms it again from
  // the special registers: kept, ptxas (CUDA 13.0) spilled it in the hd128 kernel (8 / 48 B); re-read,
  // the softcap / ALiBi / dropout variant spilled 4 B instead. sm_90a spills neither way.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  constexpr bool kRereadFirstRow = !kExtras;
#else
  constexpr bool kRereadFirstRow = false;
#endif
  auto first_row_now = [&] {
    return kRereadFirstRow ? static_cast<int>(grid_size_reread() - 1 - block_index_reread()) * kBlockM : first_row;
  };
  if (first_row >= len_q) return;  // variable-length batch: past this sequence's end
  const int valid_rows = min(kBlockM, len_q - first_row);
  const BandMask band(params, len_q, len_k);

  const Element* q = static_cast<const Element*>(params.q) + batch * params.q_strides.batch +
                     head * params.q_strides.head + (q_span.begin + first_row) * params.q_strides.row;
  // K/V tile pointers are recomputed per tile from params (constant memory) rather than kept
  // in registers across the loop.
  auto k_tile = [&](int block) {
    return static_cast<const Element*>(params.k) + batch * params.k_strides.batch + kv_head * params.k_strides.head +
           (params.key_span(batch).begin + block * kBlockN) * params.k_strides.row;
  };
  auto v_tile = [&](int block) {
    return static_cast<const Element*>(params.v) + batch * params.v_strides.batch + kv_head * params.v_strides.head +
           (params.key_span(batch).begin + block * kBlockN) * params.v_strides.row;
  };
  // Output pointers are formed where they are used: kept live across the main loop they cost
  // registers that hd128 does not have.
  auto out_block = [&] {
    return static_cast<Element*>(params.out) + batch * params.out_strides.batch + head * params.out_strides.head +
           (params.query_span(batch).begin + first_row_now()) * params.out_strides.row;
  };
  auto lse_block = [&] { return params.lse + params.lse_index(batch, head, first_row_now()); };

  // Keys some row of this block sees: from the first row's band start to the last row's band end.
  const int key_begin = band.begin(first_row);
  const int key_end = band.end(first_row + valid_rows - 1);
  const int first_key_block = key_begin / kBlockN;
  const int num_key_blocks = key_end > key_begin ? (key_end + kBlockN - 1) / kBlockN : 0;

  if (num_key_blocks == 0) {  // every row of the block sees no key: output 0, lse -inf
    Element* out = out_block();
    float* lse = lse_block();
    for (int i = threadIdx.x; i < valid_rows * kChunksPerRow; i += Config::kThreads) {
      const int row = i / kChunksPerRow, col = i % kChunksPerRow * (16 / sizeof(Element));
      *reinterpret_cast<uint4*>(out + row * params.out_strides.row + col) = make_uint4(0, 0, 0, 0);
    }
    for (int row = threadIdx.x; row < valid_rows; row += Config::kThreads) lse[row] = -INFINITY;
    return;
  }

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int warp_first_row = warp * Config::kRowsPerWarp;  // within the block

  // Key-block schedule. A block needs the element-wise mask unless every row of the block sees all of
  // its keys: it must end within the first row's band end (which is within the keys) and start at or
  // after the last row's band start. The unmasked blocks are therefore one run [lo_unmasked,
  // hi_unmasked); the masked ones are the right edge above it (the ragged end, the diagonal) and the
  // left edge below it (a window's start). The masked blocks go first, right edge from the bottom up
  // (its top block, the one some warps skip -- below -- comes after the first), then left edge from
  // its top down; then the unmasked run from the top down. The softmax does not depend on the order,
  // and one masked and one unmasked loop keep the kernel at four copies of the block body: a fifth (a
  // separate loop for the left edge) cost hd64 64 registers and a CTA per SM.
  const int last_row = first_row + valid_rows - 1;
  const int hi_unmasked = max(first_key_block, min(num_key_blocks, band.end(first_row) / kBlockN));
  const int lo_unmasked = min(hi_unmasked, max(first_key_block, (band.begin(last_row) + kBlockN - 1) / kBlockN));
  const int num_right_masked = num_key_blocks - hi_unmasked;
  const int num_masked = num_right_masked + (lo_unmasked - first_key_block);
  const int num_blocks = num_key_blocks - first_key_block;
  auto scheduled_block = [&](int i) {  // the i-th block visited; -1 past the end
    if (i >= num_blocks) return -1;
    if (i < num_right_masked) return hi_unmasked + i;
    if (i < num_masked) return lo_unmasked - 1 - (i - num_right_masked);
    return hi_unmasked - 1 - (i - num_masked);
  };

  load_tile_async<CopyTile, kBlockM>(smem_q, q, params.q_strides.row, valid_rows);
  int key_block = scheduled_block(0);
  int next_key_block = scheduled_block(1);
  load_tile_async<CopyTile, kBlockN, kWholeKvTiles>(smem_k, k_tile(key_block), params.k_strides.row,
                                                  len_k - key_block * kBlockN);
  cp_async_commit();

  float acc_o[kMTiles][kNTilesO][4] = {};
  OnlineSoftmax<kMTiles> softmax;

  // ldmatrix lane addresses, kept across the loop, except that the register-capped kernel (hd <= 64, 3 CTAs
  // per SM) forms Q's and K's per key block from a re-read thread index (ptx.cuh). Kept, a part of them
  // spills there (8 / 4 B; CUDA 13.0, sm_90a); V's per block too, or only Q's or K's, spill 12-60 B. At
  // hd64 (H200, bf16, 2k / 8k / 16k, 2026-11-30): +0.6 / +2.0 / +0.8% (causal -0.5 / -0.4 / 0%) over
  // keeping them; all three per block -0.3 to -2%. Per block in the softcap / ALiBi / dropout variant,
  // hd128 spills 40 B.
  constexpr bool kQkLaneAddressesPerBlock = !kExtras && Config::kMinCtasPerSm > 1;
  const uint32_t q_lane_addr_kept = a_lane_address<Rows>(smem_address(smem_q), warp_first_row, 0);
  const uint32_t k_lane_addr_kept = b_rows_n_lane_address<Rows>(smem_address(smem_k), 0, 0);
  const uint32_t v_lane_addr = b_rows_k_lane_address<Rows>(smem_address(smem_v), 0, 0);

  // Softcap / ALiBi constants, formed once (a slope load and two divisions), not per key block.
  const ScoreMod mod(params, batch, head, len_q, len_k);  // unused (and optimised away) without kExtras

  // V[key_block] has landed; every warp is done reading K, so the next K may load. Where: with 16-row
  // warps (head_dim > 128), right after S = Q·Kᵀ, so that the next K has the softmax and P·V to land in
  // (FlashAttention-2's order); with 32-row warps after the softmax, where the score tile is already in
  // 16-bit fragments (issued earlier, the copy's addresses beside the fp32 score tile made ptxas spill
  // 20-204 bytes at head_dim 64 / 128).
  constexpr bool kEarlyNextK = Config::kRowsPerWarp == 16;
  auto wait_v_then_load_next_k = [&] {
    cp_async_wait<0>();
    __syncthreads();
    if (next_key_block >= 0) {
      load_tile_async<CopyTile, kBlockN, kWholeKvTiles>(smem_k, k_tile(next_key_block), params.k_strides.row,
                                                      len_k - next_key_block * kBlockN);
    }
    cp_async_commit();
  };

  // K[key_block] (and Q, first time) has landed; every warp is done reading V of the previous step.
  auto wait_k_then_load_v = [&] {
    cp_async_wait<0>();
    __syncthreads();
    load_tile_async<CopyTile, kBlockN, kWholeKvTiles>(smem_v, v_tile(key_block), params.v_strides.row,
                                                    len_k - key_block * kBlockN);
    cp_async_commit();
  };

  auto process_key_block = [&](auto is_first, auto needs_mask) {
    wait_k_then_load_v();

    const int lane_now = kQkLaneAddressesPerBlock ? thread_index_reread() % 32 : 0;
    const uint32_t q_lane_addr = kQkLaneAddressesPerBlock
                                     ? a_lane_address<Rows>(smem_address(smem_q), warp_first_row, 0, lane_now)
                                     : q_lane_addr_kept;
    const uint32_t k_lane_addr = kQkLaneAddressesPerBlock
                                     ? b_rows_n_lane_address<Rows>(smem_address(smem_k), 0, 0, lane_now)
                                     : k_lane_addr_kept;

    // S = Q · Kᵀ for this warp's rows.
    float acc_s[kMTiles][kNTilesS][4] = {};
    gemm_smem<Element, kMTiles, kNTilesS, kHeadDim / 16, kRowsAreMN, Rows, kRowsAreMN, Rows>(acc_s, q_lane_addr,
                                                                                             k_lane_addr);
    if constexpr (kEarlyNextK) wait_v_then_load_next_k();

    if constexpr (kExtras) {
      if (mod.active()) modify_scores(acc_s, first_row_now() + warp_first_row, key_block * kBlockN, mod);
    }
    if constexpr (decltype(needs_mask)::value) {
      mask_scores(acc_s, first_row_now() + warp_first_row, key_block * kBlockN, band);
    }
    // The scale of this variant's score units (params.h: fwd_score_scale).
    softmax.template update<decltype(is_first)::value>(acc_s, acc_o,
                                                       kExtras ? params.fwd_score_scale_log2 : params.scale_log2);

    uint32_t p_frag[kMTiles][kBlockN / 16][4];  // P in 16 bits, as A fragments of P · V
    accumulator_to_a_fragments<Element>(acc_s, p_frag);
    if constexpr (kExtras) {
      if (params.has_dropout()) {
        drop_probabilities(p_frag, first_row_now() + warp_first_row, key_block * kBlockN, params);
      }
    }

    if constexpr (!kEarlyNextK) wait_v_then_load_next_k();

    // O += P · V.
    gemm_rs_ab<Element, kMTiles, kNTilesO, kBlockN / 16, Rows>(acc_o, p_frag, v_lane_addr);
  };

  // A masked block may lie wholly outside this warp's rows' bands (with 32-row warps: half the warps
  // at the diagonal block above the block's middle row, and at a window's left edge). The warp then
  // skips its math and keeps only its share of the copies and the barriers. The softmax needs no
  // first-block call: its state starts at max -inf, sum 0, and a later block's update is exact from
  // there. Only with 32-row warps (with 16-row warps only a window's left edge has such blocks, and
  // hd256 runs 1-2% slower with the branch), and not in the register-capped kernel (hd64, 3 CTAs per
  // SM) nor in the softcap / ALiBi / dropout variant: with the branch ptxas spills 152 B (hd64) and
  // 440 B (hd128 extras) there (CUDA 13.0, sm_90a). At hd128 (H200, bf16, 16k tokens, 2k / 8k, 2026-11-30):
  // +1.9 / +1.1%, causal +2.3 / +1.5%; window (1024, 0) at 16k 0.473 -> 0.457 ms.
  constexpr bool kSkipMissedBlocks = !kExtras && Config::kMinCtasPerSm == 1 && Config::kRowsPerWarp == 32;
  auto warp_misses_block = [&] {
    const int warp_row = first_row_now() + warp_first_row;
    return band.misses(warp_row, warp_row + Config::kRowsPerWarp - 1, key_block * kBlockN,
                       key_block * kBlockN + kBlockN - 1);
  };
  auto skip_key_block = [&] {
    wait_k_then_load_v();
    wait_v_then_load_next_k();
  };

  using True = std::true_type;
  using False = std::false_type;
  if (num_masked > 0) {
    process_key_block(True{}, True{});
  } else {
    process_key_block(True{}, False{});
  }
  int i = 1;
  for (; i < num_masked; ++i) {
    key_block = next_key_block;
    next_key_block = scheduled_block(i + 1);
    if (kSkipMissedBlocks && warp_misses_block()) {
      skip_key_block();
    } else {
      process_key_block(False{}, True{});
    }
  }
  for (; i < num_blocks; ++i) {  // the unmasked run, from the top down
    key_block = next_key_block;
    next_key_block = i + 1 < num_blocks ? key_block - 1 : -1;
    process_key_block(False{}, False{});
  }

  float row_lse[2 * kMTiles];
  softmax.finalize(acc_o, kExtras ? params.fwd_score_scale : params.softmax_scale, row_lse);
  if constexpr (kExtras) {
    if (params.has_dropout()) {  // kept probabilities count 1 / (1 - p)
#pragma unroll
      for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
        for (int nd = 0; nd < kNTilesO; ++nd) {
#pragma unroll
          for (int r = 0; r < 4; ++r) acc_o[mi][nd][r] *= params.dropout_scale;
        }
      }
    }
  }

  // Epilogue: the warp writes its rows of O (16-bit) into its own rows of the Q tile (no other
  // warp reads them), then the CTA copies the tile out in 16-byte rows.
  unsigned char* smem_o = smem_bytes;  // the Q tile, in its layout
  Element* out = out_block();
  float* lse = lse_block();
#pragma unroll
  for (int mi = 0; mi < kMTiles; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = warp_first_row + mi * 16 + lane / 4 + 8 * half;
#pragma unroll
      for (int nd = 0; nd < kNTilesO; ++nd) {
        *reinterpret_cast<uint32_t*>(smem_o + Rows::offset(row, nd * 8 + 2 * (lane % 4))) =
            pack_float2<Element>(acc_o[mi][nd][2 * half], acc_o[mi][nd][2 * half + 1]);
      }
      if (lane % 4 == 0 && row < valid_rows) lse[row] = row_lse[2 * mi + half];
    }
  }
  __syncthreads();
  for (int chunk_id = threadIdx.x; chunk_id < kBlockM * kChunksPerRow; chunk_id += Config::kThreads) {
    const int row = chunk_id / kChunksPerRow;
    const int col = chunk_id % kChunksPerRow * (16 / sizeof(Element));
    if (row < valid_rows) {
      *reinterpret_cast<uint4*>(out + row * params.out_strides.row + col) =
          *reinterpret_cast<const uint4*>(smem_o + Rows::offset(row, col));
    }
  }
}

}  // namespace flash_ext::sm80
