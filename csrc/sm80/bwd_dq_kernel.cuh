// The sm80 backward's deterministic dQ kernel: a CTA per query block recomputes S and dP against the key
// blocks it sees and accumulates dQ in registers, without atomics, so that dQ is bit-reproducible
// (deterministic = true; otherwise the dK/dV kernel adds dQ into an fp32 buffer).
#pragma once

#include <cstdint>

#include "../common/band_mask.cuh"
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
