// Backward of attention on mma.sync (sm80 and newer), by recomputation: nothing of size
// seqlen_q x seqlen_k is stored; P is rebuilt from q, k and the forward's lse.
//
// With S = scale · Q·Kᵀ, P = softmax(S), O = P·V and D_i = rowsum(dO ∘ O)_i:
//   dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P ∘ (dP − D),  dK = scale · dSᵀ·Q,  dQ = scale · dS·K.
//
// Three launches, none with atomics, so the gradients are bit-reproducible:
//   1. preprocess: D for every query row;
//   2. dK/dV: a CTA per (key block, kv head) keeps K and V in shared memory, walks every query
//      block (and every query head of its GQA group) that can see them, and accumulates dK and
//      dV in registers. Its warps own 16 keys each and compute the transposed tiles Sᵀ = K·Qᵀ
//      and dPᵀ = V·dOᵀ, whose accumulators are directly the A operands of dV += Pᵀ·dO and
//      dK += dSᵀ·Q;
//   3. dQ: a CTA per query block recomputes S and dP against the key blocks it sees and
//      accumulates dQ += dS·K in registers.
// Recomputing S and dP in the dQ kernel costs two extra GEMMs (7 instead of FlashAttention-2's
// 5, which accumulates dQ with fp32 atomics from the dK/dV kernel instead).
#pragma once

#include <cstdint>

#include "../common/ptx.cuh"
#include "../common/tile_copy.cuh"
#include "../common/warp_gemm.cuh"
#include "../params.h"
#include "bwd_tile_config.h"

namespace flash_ext::sm80 {

constexpr float kLog2e = 1.4426950408889634f;

// D[b, h, i] = sum_d dout[b, i, h, d] * out[b, i, h, d] in fp32: one warp per query row.
template <int kHeadDim, typename Element>
__global__ void __launch_bounds__(256) attention_bwd_preprocess_kernel(const __grid_constant__ BwdParams params) {
  constexpr int kElementsPerLoad = 16 / sizeof(Element);
  const int64_t row_id = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;  // head fastest
  const int lane = threadIdx.x % 32;
  if (row_id >= static_cast<int64_t>(params.batch) * params.seqlen_q * params.heads_q) return;
  const int head = row_id % params.heads_q;
  const int row = row_id / params.heads_q % params.seqlen_q;
  const int batch = row_id / params.heads_q / params.seqlen_q;
  const Element* dout = static_cast<const Element*>(params.dout) + batch * params.dout_strides.batch +
                        row * params.dout_strides.row + head * params.dout_strides.head;
  const Element* out = static_cast<const Element*>(params.out) + batch * params.out_strides.batch +
                       row * params.out_strides.row + head * params.out_strides.head;
  float sum = 0.f;
  for (int d = lane * kElementsPerLoad; d < kHeadDim; d += 32 * kElementsPerLoad) {
    const uint4 dout_chunk = *reinterpret_cast<const uint4*>(dout + d);
    const uint4 out_chunk = *reinterpret_cast<const uint4*>(out + d);
    const Element* dout_values = reinterpret_cast<const Element*>(&dout_chunk);
    const Element* out_values = reinterpret_cast<const Element*>(&out_chunk);
#pragma unroll
    for (int e = 0; e < kElementsPerLoad; ++e) sum += to_float(dout_values[e]) * to_float(out_values[e]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffff, sum, offset);
  if (lane == 0) params.softmax_d[(static_cast<int64_t>(batch) * params.heads_q + head) * params.seqlen_q + row] = sum;
}

// Which gradients one launch of the dK/dV kernel produces (head dims > 128 use two launches).
enum class KvGrads { kBoth, kOnlyDv, kOnlyDk };

template <typename Tile, KvGrads kGrads, typename Element>
__global__ void __launch_bounds__(Tile::kThreads) attention_bwd_dkdv_kernel(const __grid_constant__ BwdParams params) {
  constexpr int kHeadDim = Tile::kHeadDim;
  constexpr int kPitch = Tile::kSmemRowPitch;
  constexpr int kBlockKeys = Tile::kBlockKeys;
  constexpr int kBlockQueries = Tile::kBlockQueries;
  constexpr int kNTilesQ = kBlockQueries / 8;  // score-tile columns are queries here
  constexpr int kNTilesD = kHeadDim / 8;
  constexpr bool kDv = kGrads != KvGrads::kOnlyDk;
  constexpr bool kDk = kGrads != KvGrads::kOnlyDv;

  extern __shared__ __align__(16) unsigned char smem_bytes[];
  Element* smem_k = reinterpret_cast<Element*>(smem_bytes);
  Element* smem_v = smem_k + kBlockKeys * kPitch;
  Element* smem_q = smem_v + kBlockKeys * kPitch;
  Element* smem_dout = smem_q + kBlockQueries * kPitch;
  float* smem_lse_log2 = reinterpret_cast<float*>(smem_dout + kBlockQueries * kPitch);  // lse · log2(e)
  float* smem_d = smem_lse_log2 + kBlockQueries;

  const int key_block = blockIdx.x;
  const int kv_head = blockIdx.y;
  const int batch = blockIdx.z;
  const int first_key = key_block * kBlockKeys;
  const int valid_keys = min(kBlockKeys, params.seqlen_k - first_key);
  const int causal_offset = params.seqlen_k - params.seqlen_q;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int warp_first_key = warp * 16;  // within the block

  load_tile_async<Tile, kBlockKeys>(smem_k,
                                    static_cast<const Element*>(params.k) + batch * params.k_strides.batch +
                                        kv_head * params.k_strides.head + first_key * params.k_strides.row,
                                    params.k_strides.row, valid_keys);
  load_tile_async<Tile, kBlockKeys>(smem_v,
                                    static_cast<const Element*>(params.v) + batch * params.v_strides.batch +
                                        kv_head * params.v_strides.head + first_key * params.v_strides.row,
                                    params.v_strides.row, valid_keys);
  cp_async_commit();

  // Causal: query i sees key j iff j <= i + causal_offset, so no query before
  // first_key - causal_offset sees this block.
  const int first_query_block = params.causal ? max(0, first_key - causal_offset) / kBlockQueries : 0;
  const int num_query_blocks = (params.seqlen_q + kBlockQueries - 1) / kBlockQueries;

  float acc_dv[1][kNTilesD][4] = {};
  float acc_dk[1][kNTilesD][4] = {};
  const uint32_t k_lane_addr = a_lane_address<kPitch>(smem_k + warp_first_key * kPitch);  // A of Sᵀ = K·Qᵀ
  const uint32_t v_lane_addr = a_lane_address<kPitch>(smem_v + warp_first_key * kPitch);  // A of dPᵀ = V·dOᵀ
  const uint32_t q_as_bt_addr = b_rows_n_lane_address<kPitch>(smem_q);                    // B of K·Qᵀ
  const uint32_t dout_as_bt_addr = b_rows_n_lane_address<kPitch>(smem_dout);              // B of V·dOᵀ
  const uint32_t dout_as_b_addr = b_rows_k_lane_address<kPitch>(smem_dout);               // B of Pᵀ·dO
  const uint32_t q_as_b_addr = b_rows_k_lane_address<kPitch>(smem_q);                     // B of dSᵀ·Q

  for (int group_member = 0; group_member < params.heads_per_kv(); ++group_member) {
    const int head = kv_head * params.heads_per_kv() + group_member;
    for (int query_block = first_query_block; query_block < num_query_blocks; ++query_block) {
      const int first_query = query_block * kBlockQueries;
      const int valid_queries = min(kBlockQueries, params.seqlen_q - first_query);
      __syncthreads();  // every warp is done with the previous block's Q, dO, lse and D
      load_tile_async<Tile, kBlockQueries>(smem_q,
                                           static_cast<const Element*>(params.q) + batch * params.q_strides.batch +
                                               head * params.q_strides.head + first_query * params.q_strides.row,
                                           params.q_strides.row, valid_queries);
      load_tile_async<Tile, kBlockQueries>(
          smem_dout,
          static_cast<const Element*>(params.dout) + batch * params.dout_strides.batch +
              head * params.dout_strides.head + first_query * params.dout_strides.row,
          params.dout_strides.row, valid_queries);
      cp_async_commit();
      for (int i = threadIdx.x; i < kBlockQueries; i += Tile::kThreads) {
        const int64_t row_index = (static_cast<int64_t>(batch) * params.heads_q + head) * params.seqlen_q + first_query + i;
        const float lse = i < valid_queries ? params.lse[row_index] : -INFINITY;
        // Rows past the end, and rows that saw no key (lse = -inf), get base +inf: their P is 0.
        smem_lse_log2[i] = lse == -INFINITY ? INFINITY : lse * kLog2e;
        smem_d[i] = i < valid_queries ? params.softmax_d[row_index] : 0.f;
      }
      cp_async_wait<0>();
      __syncthreads();

      // Pᵀ for the warp's 16 keys x kBlockQueries queries.
      float acc_pt[1][kNTilesQ][4] = {};
      gemm_smem_abt<Element, 1, kNTilesQ, kHeadDim / 16, kPitch, kPitch>(acc_pt, k_lane_addr, q_as_bt_addr);
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int key = first_key + warp_first_key + lane / 4 + 8 * half;
#pragma unroll
        for (int nj = 0; nj < kNTilesQ; ++nj) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int query_in_block = nj * 8 + 2 * (lane % 4) + e;
            const bool visible = !params.causal || key <= first_query + query_in_block + causal_offset;
            float& score = acc_pt[0][nj][2 * half + e];
            score = visible ? exp2f(fmaf(score, params.scale_log2, -smem_lse_log2[query_in_block])) : 0.f;
          }
        }
      }

      if constexpr (kDv) {
        uint32_t pt_frag[1][kBlockQueries / 16][4];
        accumulator_to_a_fragments<Element>(acc_pt, pt_frag);
        gemm_rs_ab<Element, 1, kNTilesD, kBlockQueries / 16, kPitch>(acc_dv, pt_frag, dout_as_b_addr);
      }
      if constexpr (kDk) {
        float acc_dst[1][kNTilesQ][4] = {};  // dPᵀ, then dSᵀ in place
        gemm_smem_abt<Element, 1, kNTilesQ, kHeadDim / 16, kPitch, kPitch>(acc_dst, v_lane_addr, dout_as_bt_addr);
#pragma unroll
        for (int nj = 0; nj < kNTilesQ; ++nj) {
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            acc_dst[0][nj][r] = acc_pt[0][nj][r] * (acc_dst[0][nj][r] - smem_d[nj * 8 + 2 * (lane % 4) + r % 2]);
          }
        }
        uint32_t dst_frag[1][kBlockQueries / 16][4];
        accumulator_to_a_fragments<Element>(acc_dst, dst_frag);
        gemm_rs_ab<Element, 1, kNTilesD, kBlockQueries / 16, kPitch>(acc_dk, dst_frag, q_as_b_addr);
      }
    }
  }

  // Each thread writes rows lane/4 and lane/4 + 8 of its warp's 16 keys, two columns per tile.
  Element* dk = static_cast<Element*>(params.dk) + batch * params.dk_strides.batch + kv_head * params.dk_strides.head;
  Element* dv = static_cast<Element*>(params.dv) + batch * params.dv_strides.batch + kv_head * params.dv_strides.head;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key_in_block = warp_first_key + lane / 4 + 8 * half;
    if (key_in_block >= valid_keys) continue;
    const int64_t key = first_key + key_in_block;
#pragma unroll
    for (int nd = 0; nd < kNTilesD; ++nd) {
      const int col = nd * 8 + 2 * (lane % 4);
      if constexpr (kDv) {
        *reinterpret_cast<uint32_t*>(dv + key * params.dv_strides.row + col) =
            pack_float2<Element>(acc_dv[0][nd][2 * half], acc_dv[0][nd][2 * half + 1]);
      }
      if constexpr (kDk) {
        *reinterpret_cast<uint32_t*>(dk + key * params.dk_strides.row + col) =
            pack_float2<Element>(acc_dk[0][nd][2 * half] * params.softmax_scale,
                                 acc_dk[0][nd][2 * half + 1] * params.softmax_scale);
      }
    }
  }
}

template <typename Tile, typename Element>
__global__ void __launch_bounds__(Tile::kThreads) attention_bwd_dq_kernel(const __grid_constant__ BwdParams params) {
  constexpr int kHeadDim = Tile::kHeadDim;
  constexpr int kPitch = Tile::kSmemRowPitch;
  constexpr int kBlockKeys = Tile::kDqBlockKeys;
  constexpr int kBlockQueries = Tile::kBlockQueries;
  constexpr int kNTilesK = kBlockKeys / 8;  // score-tile columns are keys here
  constexpr int kNTilesD = kHeadDim / 8;

  extern __shared__ __align__(16) unsigned char smem_bytes[];
  Element* smem_q = reinterpret_cast<Element*>(smem_bytes);
  Element* smem_dout = smem_q + kBlockQueries * kPitch;
  Element* smem_k = smem_dout + kBlockQueries * kPitch;
  Element* smem_v = smem_k + kBlockKeys * kPitch;

  const int query_block = blockIdx.x;
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int kv_head = head / params.heads_per_kv();
  const int first_query = query_block * kBlockQueries;
  const int valid_queries = min(kBlockQueries, params.seqlen_q - first_query);
  const int causal_offset = params.seqlen_k - params.seqlen_q;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;

  load_tile_async<Tile, kBlockQueries>(smem_q,
                                       static_cast<const Element*>(params.q) + batch * params.q_strides.batch +
                                           head * params.q_strides.head + first_query * params.q_strides.row,
                                       params.q_strides.row, valid_queries);
  load_tile_async<Tile, kBlockQueries>(smem_dout,
                                       static_cast<const Element*>(params.dout) + batch * params.dout_strides.batch +
                                           head * params.dout_strides.head + first_query * params.dout_strides.row,
                                       params.dout_strides.row, valid_queries);
  cp_async_commit();

  // This thread's two rows: lse (as a base-2 exponent) and D.
  float row_lse_log2[2], row_d[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row_in_block = warp * 16 + lane / 4 + 8 * half;
    const int64_t row_index =
        (static_cast<int64_t>(batch) * params.heads_q + head) * params.seqlen_q + first_query + row_in_block;
    const bool valid = row_in_block < valid_queries;
    const float lse = valid ? params.lse[row_index] : -INFINITY;
    row_lse_log2[half] = lse == -INFINITY ? INFINITY : lse * kLog2e;  // P = 0 for rows that saw no key
    row_d[half] = valid ? params.softmax_d[row_index] : 0.f;
  }

  int key_end = params.seqlen_k;
  if (params.causal) key_end = min(key_end, first_query + kBlockQueries + causal_offset);
  const int num_key_blocks = key_end > 0 ? (key_end + kBlockKeys - 1) / kBlockKeys : 0;

  float acc_dq[1][kNTilesD][4] = {};
  const uint32_t q_lane_addr = a_lane_address<kPitch>(smem_q + warp * 16 * kPitch);        // A of S = Q·Kᵀ
  const uint32_t dout_lane_addr = a_lane_address<kPitch>(smem_dout + warp * 16 * kPitch);  // A of dP = dO·Vᵀ
  const uint32_t k_as_bt_addr = b_rows_n_lane_address<kPitch>(smem_k);
  const uint32_t v_as_bt_addr = b_rows_n_lane_address<kPitch>(smem_v);
  const uint32_t k_as_b_addr = b_rows_k_lane_address<kPitch>(smem_k);  // B of dQ += dS·K

  for (int key_block = 0; key_block < num_key_blocks; ++key_block) {
    const int first_key = key_block * kBlockKeys;
    __syncthreads();  // every warp is done with the previous K and V
    load_tile_async<Tile, kBlockKeys>(smem_k,
                                      static_cast<const Element*>(params.k) + batch * params.k_strides.batch +
                                          kv_head * params.k_strides.head + first_key * params.k_strides.row,
                                      params.k_strides.row, params.seqlen_k - first_key);
    load_tile_async<Tile, kBlockKeys>(smem_v,
                                      static_cast<const Element*>(params.v) + batch * params.v_strides.batch +
                                          kv_head * params.v_strides.head + first_key * params.v_strides.row,
                                      params.v_strides.row, params.seqlen_k - first_key);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();

    float acc_s[1][kNTilesK][4] = {};
    gemm_smem_abt<Element, 1, kNTilesK, kHeadDim / 16, kPitch, kPitch>(acc_s, q_lane_addr, k_as_bt_addr);
    float acc_ds[1][kNTilesK][4] = {};  // dP, then dS in place
    gemm_smem_abt<Element, 1, kNTilesK, kHeadDim / 16, kPitch, kPitch>(acc_ds, dout_lane_addr, v_as_bt_addr);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int row = first_query + warp * 16 + lane / 4 + 8 * half;
      const int key_limit = params.causal ? min(params.seqlen_k, row + causal_offset + 1) : params.seqlen_k;
#pragma unroll
      for (int nj = 0; nj < kNTilesK; ++nj) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = first_key + nj * 8 + 2 * (lane % 4) + e;
          const int r = 2 * half + e;
          const float prob = key < key_limit ? exp2f(fmaf(acc_s[0][nj][r], params.scale_log2, -row_lse_log2[half])) : 0.f;
          acc_ds[0][nj][r] = prob * (acc_ds[0][nj][r] - row_d[half]);
        }
      }
    }
    uint32_t ds_frag[1][kBlockKeys / 16][4];
    accumulator_to_a_fragments<Element>(acc_ds, ds_frag);
    gemm_rs_ab<Element, 1, kNTilesD, kBlockKeys / 16, kPitch>(acc_dq, ds_frag, k_as_b_addr);
  }

  Element* dq = static_cast<Element*>(params.dq) + batch * params.dq_strides.batch + head * params.dq_strides.head;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row_in_block = warp * 16 + lane / 4 + 8 * half;
    if (row_in_block >= valid_queries) continue;
    const int64_t row = first_query + row_in_block;
#pragma unroll
    for (int nd = 0; nd < kNTilesD; ++nd) {
      *reinterpret_cast<uint32_t*>(dq + row * params.dq_strides.row + nd * 8 + 2 * (lane % 4)) =
          pack_float2<Element>(acc_dq[0][nd][2 * half] * params.softmax_scale,
                               acc_dq[0][nd][2 * half + 1] * params.softmax_scale);
    }
  }
}

}  // namespace flash_ext::sm80
