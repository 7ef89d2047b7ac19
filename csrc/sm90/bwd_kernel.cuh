// Hopper (sm_90a) dK/dV kernel of the backward: TMA loads and asynchronous warpgroup MMA (wgmma).
// It replaces the sm80 dK/dV kernel (sm80/bwd_kernels.cuh) where it takes the call; the preprocess
// (D, the zeroed fp32 dQ accumulator, params.row_stats) and the dQ conversion are the sm80 launcher's.
//
// A CTA owns kBlockN = 128 keys of one (batch, kv head), 64 per warpgroup (wgmma's M), keeps K and V in
// shared memory, and walks the query blocks of kBlockM = 64 rows (of every query head of its GQA group)
// that can see its keys. Per query block, each warpgroup:
//   Sᵀ = K Qᵀ and dPᵀ = V dOᵀ (wgmma, all from shared memory: keys x queries, so each warp's 16 key rows
//     are in the mma.sync accumulator layout, as in the sm80 kernel's phase 1), wait;
//   Pᵀ = exp2(Sᵀ scale log2(e) - lse log2(e)) and dSᵀ = Pᵀ ∘ (dPᵀ - D) (with softcap's factor, the
//     band mask) in registers, then in 16 bits as the register A operands of
//   dV += Pᵀ dO and dK += dSᵀ Q (wgmma, B = dO / Q from shared memory), issued and not waited for;
//   dSᵀ stored to shared memory (stmatrix), both warpgroups synchronised, then
//   dQ = dS K for half of the head dim each (A = dS read transposed from the stored dSᵀ, B = K), waited,
//     and added to the fp32 dQ accumulator with 16-byte atomics (common/dq_accum_layout.h).
// Q, dO and the block's lse log2(e) / D arrive by TMA in one of kStages buffers; as in the forward, thread
// 0 issues K, V and the first blocks, and the last of the 8 warps done with a buffer reloads it.
// Shared tiles are in the 128-byte swizzled layout (ptx_sm90.cuh, swizzle128_descriptor).
#pragma once

#include <cuda.h>  // CUtensorMap (a type only)

#include <cstdint>

#include "../common/band_mask.cuh"
#include "../common/dq_accum_layout.h"
#include "../common/ptx.cuh"
#include "../common/score_mod.cuh"
#include "../common/warp_gemm.cuh"
#include "../params.h"
#include "ptx_sm90.cuh"
#include "wgmma.cuh"

namespace flash_ext::sm90 {

// TMA descriptors of q and dout (boxes of 64 columns x kBlockM rows) and of k and v (x kBlockN rows); the
// same 4-D (head_dim, rows, heads, batch) view as the forward's (a variable-length batch: batch 1).
struct BwdTensorMaps {
  CUtensorMap q, dout, k, v;
};

template <int kHeadDim_>
struct BwdSm90Tile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = 128;  // keys per CTA: 64 per warpgroup
  static constexpr int kBlockM = 64;   // queries per step
  // Query-block buffers: block i + 2 loads while block i + 1 computes (a block takes ~2.5 us at hd128,
  // a TMA load ~1 us).
  static constexpr int kStages = 2;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kColumnRegions = kHeadDim / 64;  // 64 16-bit columns = one 128-byte row
  static constexpr int kDqCols = kHeadDim / 2;          // dQ columns per warpgroup
  static constexpr int kKvBytes = kBlockN * kHeadDim * 2;
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;  // a Q or dO tile
  static constexpr int kDsBytes = kBlockN * kBlockM * 2;  // dSᵀ: 128 key rows of 64 queries (128 bytes)
  static constexpr int kStatBytes = kBlockM * 4;          // a block's lse log2(e), or its D
  // K, V, Q[stage], dO[stage], dSᵀ[2], lse[stage], D[stage], the mbarriers (K and V, Q[stage]) and the
  // release counters; +1024 to align the base (the swizzle is computed from absolute addresses).
  static constexpr int kVOffset = kKvBytes;
  static constexpr int kQOffset = 2 * kKvBytes;
  static constexpr int kDoutOffset = kQOffset + kStages * kQBytes;
  static constexpr int kDsOffset = kDoutOffset + kStages * kQBytes;
  static constexpr int kLseOffset = kDsOffset + 2 * kDsBytes;
  static constexpr int kDOffset = kLseOffset + kStages * kStatBytes;
  static constexpr int kBarrierOffset = kDOffset + kStages * kStatBytes;
  static constexpr int kCounterOffset = kBarrierOffset + 8 * (1 + kStages);
  static constexpr int kSmemBytes = kCounterOffset + 4 * kStages + 1024;
  // dQ's B operand (K, MN-major) covers kDqCols columns of one 64-column region: head_dim 128 only.
  static_assert(kHeadDim == 128, "the sm90 backward is written for head_dim 128");
};

// kExtras: softcap and ALiBi (common/score_mod.cuh). Dropout calls run the sm80 kernel.
template <typename Element, int kHeadDim, bool kExtras>
__global__ void __launch_bounds__(BwdSm90Tile<kHeadDim>::kThreads, 1)
    attention_bwd_dkdv_sm90_kernel(const __grid_constant__ BwdParams params, const __grid_constant__ BwdTensorMaps maps) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tile = BwdSm90Tile<kHeadDim>;
  constexpr int kBlockM = Tile::kBlockM;
  constexpr int kBlockN = Tile::kBlockN;
  constexpr int kStages = Tile::kStages;
  constexpr int kNTilesS = kBlockM / 8;         // a warpgroup's Sᵀ: 64 keys x kBlockM queries
  constexpr int kNTilesGrad = kHeadDim / 8;     // dK, dV: 64 keys x head_dim
  constexpr int kNTilesDq = Tile::kDqCols / 8;  // dQ: kBlockM queries x kDqCols

  extern __shared__ unsigned char smem_raw[];
  const uint32_t smem_base = (smem_address(smem_raw) + 1023) & ~1023u;
  unsigned char* smem = smem_raw + (smem_base - smem_address(smem_raw));
  const uint32_t smem_k = smem_base;
  const uint32_t smem_v = smem_base + Tile::kVOffset;
  auto smem_q = [&](int stage) { return smem_base + Tile::kQOffset + stage * Tile::kQBytes; };
  auto smem_dout = [&](int stage) { return smem_base + Tile::kDoutOffset + stage * Tile::kQBytes; };
  auto smem_ds = [&](int buffer) { return smem_base + Tile::kDsOffset + buffer * Tile::kDsBytes; };
  const float* stat_lse = reinterpret_cast<const float*>(smem + Tile::kLseOffset);  // [stage][kBlockM]
  const float* stat_d = reinterpret_cast<const float*>(smem + Tile::kDOffset);
  const uint32_t bar_kv_full = smem_base + Tile::kBarrierOffset;
  auto bar_q_full = [&](int stage) { return bar_kv_full + 8 * (1 + stage); };
  int* release_count = reinterpret_cast<int*>(smem + Tile::kCounterOffset);

  const int key_block = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z;
  const SequenceSpan q_span = params.query_span(batch);
  const SequenceSpan k_span = params.key_span(batch);
  const int len_q = static_cast<int>(q_span.length);
  const int len_k = static_cast<int>(k_span.length);
  const int first_key = key_block * kBlockN;
  if (first_key >= len_k) return;  // variable-length batch: past this sequence's keys
  const int valid_keys = min(kBlockN, len_k - first_key);
  const BandMask band(params, len_q, len_k);
  const int tma_batch = params.is_varlen() ? 0 : batch;

  // The walk: (query head of the GQA group, query block) pairs, head-major, over the query blocks holding a
  // row that sees a key of this block.
  const int row_begin = min(len_q, band.first_row_seeing(first_key));
  const int64_t rows_seeing_end = band.end_row_seeing(first_key + valid_keys);
  const int row_end = rows_seeing_end < len_q ? static_cast<int>(rows_seeing_end) : len_q;
  const int first_query_block = row_begin / kBlockM;
  const int blocks_per_head = row_end > row_begin ? (row_end + kBlockM - 1) / kBlockM - first_query_block : 0;
  const int num_steps = params.heads_per_kv() * blocks_per_head;
  auto step_head = [&](int i) { return kv_head * params.heads_per_kv() + i / blocks_per_head; };
  auto step_first_query = [&](int i) { return (first_query_block + i % blocks_per_head) * kBlockM; };
  // Row 0 of this sequence in the dQ accumulator's and row_stats' numbering (DqAccumLayout).
  const int64_t sequence_accum_row =
      DqAccumLayout::first_row(params.is_varlen() ? q_span.begin : int64_t{batch} * params.seqlen_q, batch);

  // Q, dO, lse log2(e) and D of the i-th step into buffer i % kStages (one thread).
  auto load_query_block = [&](int i) {
    const int stage = i % kStages;
    const int head = step_head(i);
    const int first_query = step_first_query(i);
    const int row = static_cast<int>(q_span.begin) + first_query;  // TMA row of the (packed) tensor
    mbarrier_arrive_expect_bytes(bar_q_full(stage), 2 * Tile::kQBytes + 2 * Tile::kStatBytes);
    for (int c = 0; c < Tile::kColumnRegions; ++c) {
      tma_load_4d(smem_q(stage) + c * kBlockM * 128, &maps.q, bar_q_full(stage), c * 64, row, head, tma_batch);
      tma_load_4d(smem_dout(stage) + c * kBlockM * 128, &maps.dout, bar_q_full(stage), c * 64, row, head, tma_batch);
    }
    const float* stats = params.row_stats + head * params.dq_accum_rows + sequence_accum_row + first_query;
    bulk_load(smem_base + Tile::kLseOffset + stage * Tile::kStatBytes, stats, Tile::kStatBytes, bar_q_full(stage));
    bulk_load(smem_base + Tile::kDOffset + stage * Tile::kStatBytes, stats + params.heads_q * params.dq_accum_rows,
              Tile::kStatBytes, bar_q_full(stage));
  };
  if (threadIdx.x == 0) {
    mbarrier_init(bar_kv_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(bar_q_full(s), 1);
      release_count[s] = 0;
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  // No TMA is issued for an empty walk (a CTA must not exit with copies into its shared memory in flight).
  if (threadIdx.x == 0 && num_steps > 0) {
    prefetch_tensor_map(&maps.q);
    prefetch_tensor_map(&maps.dout);
    const int key_row = static_cast<int>(k_span.begin) + first_key;
    mbarrier_arrive_expect_bytes(bar_kv_full, 2 * Tile::kKvBytes);
    for (int c = 0; c < Tile::kColumnRegions; ++c) {
      tma_load_4d(smem_k + c * kBlockN * 128, &maps.k, bar_kv_full, c * 64, key_row, kv_head, tma_batch);
      tma_load_4d(smem_v + c * kBlockN * 128, &maps.v, bar_kv_full, c * 64, key_row, kv_head, tma_batch);
    }
    for (int i = 0; i < min(num_steps, kStages); ++i) load_query_block(i);
  }

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int group = warp / 4;  // warpgroup: keys 64 group .. + 63 of the block
  const int warp_in_group = warp % 4;
  // Called by each warp once its wgmmas reading step i's buffer completed: the last of the 8 reloads it.
  auto release_query_block = [&](int i) {
    if (lane == 0) {
      const int stage = i % kStages;
      __threadfence_block();
      if (atomicAdd(&release_count[stage], 1) == Tile::kWarps - 1) {
        release_count[stage] = 0;
        __threadfence_block();
        if (i + kStages < num_steps) load_query_block(i + kStages);
      }
    }
  };

  // Operand descriptors (k-step t):
  //   Sᵀ = K Qᵀ, dPᵀ = V dOᵀ: A = the warpgroup's 64 rows of K / V, B = Q / dO, both K-major over the head
  //     dim: region t / 4, 32 bytes per step inside it.
  //   dV += Pᵀ dO, dK += dSᵀ Q: B = dO / Q MN-major, queries 16t .. 16t + 15, regions kBlockM rows apart.
  //   dQ = dS K: A = dS, MN-major (the stored dSᵀ: keys 16t .. + 15 of 128-byte query rows); B = the
  //     warpgroup's 64-column region of K, MN-major, keys 16t .. + 15.
  auto kv_scores_descriptor = [&](uint32_t tile, int t) {
    return swizzle128_descriptor(tile + (t / 4) * kBlockN * 128 + group * 64 * 128 + (t % 4) * 32, 16);
  };
  auto query_scores_descriptor = [&](uint32_t tile, int t) {
    return swizzle128_descriptor(tile + (t / 4) * kBlockM * 128 + (t % 4) * 32, 16);
  };
  auto query_grad_descriptor = [&](uint32_t tile, int t) {
    return swizzle128_descriptor(tile + t * 16 * 128, kBlockM * 128);
  };
  using MmaS = Wgmma<Element, kBlockM>;
  using MmaGrad = Wgmma<Element, kHeadDim>;
  using MmaDq = Wgmma<Element, Tile::kDqCols>;

  // This thread's score elements: keys thread_key + 8 half (of the sequence), queries
  // thread_query + 8 j + e (of the block).
  const int warp_first_key = first_key + 64 * group + 16 * warp_in_group;
  const int thread_key = warp_first_key + lane / 4;
  const int thread_query = 2 * (lane % 4);
  // stmatrix of dSᵀ: lane l addresses row l % 8 of matrix l / 8 = (keys + 8 (l / 8 % 2), queries + 8 (l / 16)).
  const int ds_store_row = 64 * group + 16 * warp_in_group + lane % 8 + 8 * (lane / 8 % 2);
  // dQ atomics: this warp adds rows 16 warp_in_group .. + 15 of the block, columns group kDqCols .. of the head.
  const DqAccumLayout dq_layout{params.dq_accum_rows, kHeadDim};
  constexpr int kRowGroupStride = DqAccumLayout::row_group_stride(kHeadDim);
  static_assert(kBlockM <= DqAccumLayout::kOverhangRows, "blocks past the last sequence stay in the buffer");

  float acc_dk[kNTilesGrad][4] = {};
  float acc_dv[kNTilesGrad][4] = {};
  if (num_steps > 0) mbarrier_wait(bar_kv_full, 0);

  for (int i = 0; i < num_steps; ++i) {
    const int stage = i % kStages;
    const int head = step_head(i);
    const int first_query = step_first_query(i);
    const int valid_queries = min(kBlockM, len_q - first_query);
    mbarrier_wait(bar_q_full(stage), (i / kStages) & 1);

    float acc_s[1][kNTilesS][4];   // Sᵀ, then Pᵀ in place
    float acc_dp[1][kNTilesS][4];  // dPᵀ, then dSᵀ in place
    wgmma_fence();
#pragma unroll
    for (int t = 0; t < kHeadDim / 16; ++t) {
      MmaS::template ss<0>(acc_s[0], kv_scores_descriptor(smem_k, t), query_scores_descriptor(smem_q(stage), t), t);
    }
#pragma unroll
    for (int t = 0; t < kHeadDim / 16; ++t) {
      MmaS::template ss<0>(acc_dp[0], kv_scores_descriptor(smem_v, t), query_scores_descriptor(smem_dout(stage), t), t);
    }
    wgmma_commit();
    wgmma_wait<0>();
    register_fence(acc_s[0]);
    register_fence(acc_dp[0]);

    // Pᵀ and dSᵀ. A warp's block needs the element-wise mask unless every query row is valid and sees
    // every one of the warp's 16 keys (band rows grow monotonically: the corners decide; band.end clamps
    // at len_k). Masked entries get P = dS = 0 by selects (their lse / D may be padding).
    const float* lse = stat_lse + stage * kBlockM;
    const float* d = stat_d + stage * kBlockM;
    const bool warp_unmasked = valid_queries == kBlockM && band.begin(first_query + kBlockM - 1) <= warp_first_key &&
                               band.end(first_query) >= warp_first_key + 16;
    const ScoreMod head_mod(params, batch, head, len_q, len_k);  // unused without kExtras
    const float first_query_on_diagonal = head_mod.row_on_diagonal(first_query + thread_query);
    auto scores_to_gradients = [&](auto masked) {
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
              score = head_mod.raw_score(score, first_query_on_diagonal + static_cast<float>(8 * j + e),
                                         static_cast<float>(key), tanh_value);
              grad_factor = 1.f - tanh_value * tanh_value;
            }
            float p = exp2f(fmaf(score, params.scale_log2, -lse[query]));
            float ds = p * grad_factor * (acc_dp[0][j][r] - d[query]);
            if constexpr (decltype(masked)::value) {
              const bool visible = query >= lo && query <= hi;
              p = visible ? p : 0.f;
              ds = visible ? ds : 0.f;
            }
            acc_s[0][j][r] = p;
            acc_dp[0][j][r] = ds;
          }
        }
      }
    };
    if (warp_unmasked) {
      scores_to_gradients(std::false_type{});
    } else {
      scores_to_gradients(std::true_type{});
    }
    uint32_t p_frag[1][kNTilesS / 2][4];
    uint32_t ds_frag[1][kNTilesS / 2][4];
    accumulator_to_a_fragments<Element>(acc_s, p_frag);
    accumulator_to_a_fragments<Element>(acc_dp, ds_frag);

    // dV += Pᵀ dO, dK += dSᵀ Q: issued, completed at the dQ wait below.
    wgmma_fence();
#pragma unroll
    for (int t = 0; t < kBlockM / 16; ++t) {
      MmaGrad::template rs<1>(acc_dv, p_frag[0][t], query_grad_descriptor(smem_dout(stage), t), 1);
    }
#pragma unroll
    for (int t = 0; t < kBlockM / 16; ++t) {
      MmaGrad::template rs<1>(acc_dk, ds_frag[0][t], query_grad_descriptor(smem_q(stage), t), 1);
    }
    wgmma_commit();

    // dSᵀ to shared memory (buffer i % 2: the other warpgroup may still read the previous step's), one
    // stmatrix per 16 keys x 16 queries: the A fragment of k-step jj is that block's four 8 x 8 matrices.
    const uint32_t ds_tile = smem_ds(i % 2);
#pragma unroll
    for (int jj = 0; jj < kNTilesS / 2; ++jj) {
      const int chunk = 2 * jj + lane / 16;  // 16-byte chunk of the 128-byte row
      stmatrix_x4(ds_tile + ds_store_row * 128 + ((chunk ^ (ds_store_row % 8)) * 16),
                  {ds_frag[0][jj][0], ds_frag[0][jj][1], ds_frag[0][jj][2], ds_frag[0][jj][3]});
    }
    fence_async_shared();
    named_barrier_sync(1, Tile::kThreads);  // all 128 rows of dSᵀ stored

    // dQ (kBlockM queries x the warpgroup's kDqCols columns) = dS K over the block's 128 keys.
    float acc_dq[kNTilesDq][4];
    wgmma_fence();
#pragma unroll
    for (int t = 0; t < kBlockN / 16; ++t) {
      MmaDq::template ss<1, 1>(acc_dq, swizzle128_descriptor(ds_tile + t * 16 * 128, kBlockN * 128),
                               swizzle128_descriptor(smem_k + group * kBlockN * 128 + t * 16 * 128, kBlockN * 128), t);
    }
    wgmma_commit();
    wgmma_wait<0>();  // dQ, and this step's dK / dV
    register_fence(acc_dq);
    register_fence(acc_dk);
    register_fence(acc_dv);
    release_query_block(i);

    // Rows past the sequence's end (dS = 0) are added too: DqAccumLayout says where they land.
    const int64_t accum_row = sequence_accum_row + first_query + 16 * warp_in_group;
    float* dq_accum_lane = params.dq_accum + dq_layout.tile_offset(accum_row, head, group * Tile::kDqCols) + 4 * lane;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
#pragma unroll
      for (int pair = 0; pair < kNTilesDq / 2; ++pair) {
        atomic_add_float4(dq_accum_lane + half * kRowGroupStride + pair * DqAccumLayout::kTileFloats,
                          acc_dq[2 * pair][2 * half], acc_dq[2 * pair][2 * half + 1], acc_dq[2 * pair + 1][2 * half],
                          acc_dq[2 * pair + 1][2 * half + 1]);
      }
    }
  }

  // dK = scale dSᵀ Q and dV: each thread writes keys thread_key (+ 8) and two columns per n-tile.
  Element* dk = static_cast<Element*>(params.dk) + batch * params.dk_strides.batch + kv_head * params.dk_strides.head;
  Element* dv = static_cast<Element*>(params.dv) + batch * params.dv_strides.batch + kv_head * params.dv_strides.head;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key_in_sequence = thread_key + 8 * half;
    if (key_in_sequence >= len_k) continue;
    const int64_t key = k_span.begin + key_in_sequence;  // row in the (packed) dk and dv
#pragma unroll
    for (int j = 0; j < kNTilesGrad; ++j) {
      const int col = 8 * j + 2 * (lane % 4);
      *reinterpret_cast<uint32_t*>(dv + key * params.dv_strides.row + col) =
          pack_float2<Element>(acc_dv[j][2 * half], acc_dv[j][2 * half + 1]);
      *reinterpret_cast<uint32_t*>(dk + key * params.dk_strides.row + col) =
          pack_float2<Element>(acc_dk[j][2 * half] * params.softmax_scale, acc_dk[j][2 * half + 1] * params.softmax_scale);
    }
  }
#endif  // sm_90a
}

}  // namespace flash_ext::sm90
