// Hopper (sm_90a) forward kernel: TMA loads and asynchronous warpgroup MMA (wgmma), one CTA per tile. It takes
// the calls with dropout (its one instantiation); the others take the persistent, warp-specialised
// fwd_persistent_kernel.cuh, which shares its building blocks.
//
// Why a second forward: on mma.sync the tensor pipe and the softmax's MUFU work (exp2, softcap's tanh)
// run one after the other (softcap, one MUFU op per score, costs the sm80 forward +16% time: H200, hd128,
// 8k, 2026-11-30), and mma.sync peaks near 2/3 of the H200's tensor rate. A wgmma runs in the background
// of the warpgroup that issued it, so one warpgroup's softmax overlaps the other's GEMMs.
//
// One CTA computes kBlockM = 128 query rows of one (batch, head) with two warpgroups, each owning 64
// rows (wgmma's M). Per key block of kBlockN keys:
//     S = Q Kᵀ (wgmma, Q and K from shared memory), wait; mask / softcap / ALiBi, online softmax in
//     registers (the m64 accumulator gives each warp the mma.sync layout of 16 rows, so
//     common/online_softmax.cuh and common/score_tile.cuh apply unchanged); P in 16 bits as the
//     register A operand of O += P V (wgmma, V from shared memory), issued and not waited for: it runs
//     while the warpgroup waits for the next K and issues the next S.
//   At head_dim 128 (Tile::kPipelined) the warpgroup also overlaps its own GEMMs with its softmax
//   (FlashAttention-3's intra-warpgroup pipelining): block i's S and block i - 1's P V are issued
//   together, the softmax of block i runs while that P V completes, and O's rescale waits for it.
// K and V of each key block arrive by TMA in one of kStages buffers, each with a "full" mbarrier per
// tile (TMA's transaction bytes). Thread 0 issues Q and the first kStages blocks; after that, a buffer
// is reloaded (with the block kStages further on) by whichever warp is the last of the 8 to finish with
// it (a shared-memory counter per buffer), so no warp waits for another to release a buffer. (A
// producer warp beside the 8 did not launch: registers are allocated per 4 warps, so 9 warps cost 12
// warps' registers, and at 65536 / 384 = 168 per thread ptxas serialised the wgmmas.)
// Shared memory holds every tile in the 128-byte swizzled layout that TMA writes and wgmma reads
// (ptx_sm90.cuh, swizzle128_descriptor): per 64 columns of the head dim one region of rows x 128 B.
//
// Key blocks are visited from the last to the first (for causal the diagonal blocks, which need the
// element-wise mask, come first); only the blocks inside the row block's band are visited. Rows and
// keys past the sequence's end arrive from TMA as zeros; their scores are masked, their rows not stored.
// Variable-length batches: blockIdx.z is the sequence, whose rows start at cu_seqlens (params.h's
// query_span / key_span); TMA then reads the packed tensors as one sequence of total rows, so a tile's
// rows past its sequence's end come from the next sequence (zeros past the last): their scores are
// masked like any key past the end, and such query rows are not stored.
#pragma once

#include <cuda.h>  // CUtensorMap (a type only; no driver calls in device code)

#include <cstdint>

#include "../common/band_mask.cuh"
#include "../common/dropout_bits.cuh"
#include "../common/online_softmax.cuh"
#include "../common/ptx.cuh"
#include "../common/score_mod.cuh"
#include "../common/score_tile.cuh"
#include "../common/smem_rows.cuh"
#include "../common/warp_gemm.cuh"
#include "../params.h"
#include "ptx_sm90.cuh"
#include "wgmma.cuh"

namespace flash_ext::sm90 {

// The TMA descriptors of q, k, v: 4-D (head_dim, rows, heads, batch) tensors (a variable-length batch:
// all its rows, batch 1), boxes of 64 columns by kBlockM (q) or kBlockN (k, v) rows, 128-byte swizzle
// (built in fwd_launch_template.cuh).
struct FwdTensorMaps {
  CUtensorMap q, k, v;
};

template <int kHeadDim_>
struct FwdSm90Tile {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 128;  // 2 warpgroups x 64 rows
  // Registers per thread: the O accumulator holds head_dim / 2 floats, the score tile kBlockN / 2; at
  // head_dim 256 (128 for O) the score tile gets 64 keys.
  static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;
  // Three buffers: a buffer is released once both warpgroups finished its block (its P V done), and its
  // reload then has two blocks' time to land. Shared memory at hd128: 32 + 3 x 64 KB = 224 KB; at hd256
  // only two fit (64 + 2 x 64 KB).
  static constexpr int kStages = kHeadDim <= 128 ? 3 : 2;
  // Intra-warpgroup pipelining (the next S and the previous P V issued before the softmax) at head_dim 128
  // only. Against the plain loop (H200, bf16, 8k, 2026-11-30): hd128 +5.9% / causal +4.5%, softcap 2.35 ->
  // 2.13 ms, ALiBi 2.24 -> 2.14 ms; hd64 -2.4 / -3.5%; hd256 -22 / -14% (with 2 buffers block i + 1's K
  // goes into block i - 1's buffer, free only once that block's P V completed: every S waits for its load).
  static constexpr bool kPipelined = kHeadDim == 128;
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kColumnRegions = kHeadDim / 64;       // 64 16-bit columns = one 128-byte row
  static constexpr int kQBytes = kBlockM * kHeadDim * 2;
  static constexpr int kKvBytes = kBlockN * kHeadDim * 2;  // one K or V tile
  // Q, then K[stage], then V[stage], then the mbarriers (q, k[stage], v[stage]) and the release
  // counters (one int per stage); +1024 to align the base (the swizzle repeats every 1024 bytes and is
  // computed from absolute shared addresses).
  static constexpr int kBarrierOffset = kQBytes + 2 * kStages * kKvBytes;
  static constexpr int kCounterOffset = kBarrierOffset + 8 * (1 + 2 * kStages);
  static constexpr int kSmemBytes = kCounterOffset + 4 * kStages + 1024;
  static_assert(kHeadDim % 64 == 0, "whole 128-byte rows");
};

// S = Q Kᵀ for one warpgroup's 64 query rows once K has arrived (`k_full`'s phase `parity`): q_rows is the
// warpgroup's first Q row in a kBlockM-row tile, k_tile a kBlockN-row K tile, both swizzled (k-step t covers
// head-dim columns 16t .. 16t + 15: region t / 4, 32 bytes per step inside it). Issued and committed, not
// waited for. The descriptors are opaque per call (opaque_u64: otherwise ptxas keeps every k-step's 64-bit
// descriptor of every buffer live across the loop). Shared by both sm90 forward kernels.
template <typename Element, int kBlockM, int kBlockN, int kHeadDim>
__device__ __forceinline__ void issue_qk_gemm(float (&acc_s)[kBlockN / 8][4], uint32_t q_rows, uint32_t k_tile,
                                              uint32_t k_full, uint32_t parity) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  auto step_offset = [](int rows, int t) { return static_cast<uint32_t>((t / 4) * rows * 128 + (t % 4) * 32); };
  const uint64_t q_desc = opaque_u64(swizzle128_descriptor(q_rows, 16));
  const uint64_t k_desc = opaque_u64(swizzle128_descriptor(k_tile, 16));
  mbarrier_wait(k_full, parity);
  wgmma_fence();
#pragma unroll
  for (int t = 0; t < kHeadDim / 16; ++t) {
    Wgmma<Element, kBlockN>::template ss<0>(acc_s, descriptor_plus(q_desc, step_offset(kBlockM, t)),
                                            descriptor_plus(k_desc, step_offset(kBlockN, t)), t);
  }
  wgmma_commit();
#endif
}

// Dropout, with softcap and ALiBi (common/score_mod.cuh) compiled in. Dropout has its own kernel: its Philox
// rounds beside the in-flight accumulators made ptxas serialise the wgmmas of a whole kernel (CUDA 13.0,
// C7511), and in the persistent kernel they cost dropout 1.7% (docs/design.md §7).
template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(FwdSm90Tile<kHeadDim>::kThreads, 1)
    attention_fwd_sm90_kernel(const __grid_constant__ FwdParams params, const __grid_constant__ FwdTensorMaps maps) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tile = FwdSm90Tile<kHeadDim>;
  constexpr int kBlockM = Tile::kBlockM;
  constexpr int kBlockN = Tile::kBlockN;
  constexpr int kStages = Tile::kStages;
  constexpr bool kPipelined = Tile::kPipelined;
  constexpr int kNTilesS = kBlockN / 8;
  constexpr int kNTilesO = kHeadDim / 8;
  constexpr int kChunksPerRow = kHeadDim / 8;  // 16-byte chunks

  extern __shared__ unsigned char smem_raw[];
  const uint32_t smem_base = (smem_address(smem_raw) + 1023) & ~1023u;
  unsigned char* smem = smem_raw + (smem_base - smem_address(smem_raw));
  const uint32_t smem_q = smem_base;
  auto smem_k = [&](int stage) { return smem_base + Tile::kQBytes + stage * Tile::kKvBytes; };
  auto smem_v = [&](int stage) { return smem_base + Tile::kQBytes + (kStages + stage) * Tile::kKvBytes; };
  const uint32_t bar_q_full = smem_base + Tile::kBarrierOffset;
  auto bar_k_full = [&](int stage) { return bar_q_full + 8 * (1 + stage); };
  auto bar_v_full = [&](int stage) { return bar_q_full + 8 * (1 + kStages + stage); };
  int* release_count = reinterpret_cast<int*>(smem + Tile::kCounterOffset);  // per stage: warps done with it

  publish_rng_state(params);

  const int m_block = gridDim.x - 1 - blockIdx.x;  // heaviest (causal: last) row blocks first
  const int head = blockIdx.y;
  const int batch = blockIdx.z;
  const int kv_head = head / params.heads_per_kv();
  const SequenceSpan q_span = params.query_span(batch);
  const SequenceSpan k_span = params.key_span(batch);
  const int len_q = static_cast<int>(q_span.length);
  const int len_k = static_cast<int>(k_span.length);
  const int first_row = m_block * kBlockM;
  if (first_row >= len_q) return;  // variable-length batch: past this sequence's end
  // TMA coordinates: rows of the (packed) tensor, batch 0 in a variable-length batch.
  const int tma_batch = params.is_varlen() ? 0 : batch;
  const int q_row0 = static_cast<int>(q_span.begin) + first_row;
  const int k_row0 = static_cast<int>(k_span.begin);
  const int valid_rows = min(kBlockM, len_q - first_row);
  const BandMask band(params, len_q, len_k);

  Element* out = static_cast<Element*>(params.out) + batch * params.out_strides.batch +
                 head * params.out_strides.head + (q_span.begin + first_row) * params.out_strides.row;
  float* lse = params.lse + params.lse_index(batch, head, first_row);

  const int key_begin = band.begin(first_row);
  const int key_end = band.end(first_row + valid_rows - 1);
  const int first_key_block = key_begin / kBlockN;
  const int num_key_blocks = key_end > key_begin ? (key_end + kBlockN - 1) / kBlockN : 0;
  if (num_key_blocks == 0) {  // every row of the block sees no key: output 0, lse -inf
    for (int i = threadIdx.x; i < valid_rows * kChunksPerRow; i += Tile::kThreads) {
      const int row = i / kChunksPerRow, col = i % kChunksPerRow * 8;
      *reinterpret_cast<uint4*>(out + row * params.out_strides.row + col) = make_uint4(0, 0, 0, 0);
    }
    for (int row = threadIdx.x; row < valid_rows; row += Tile::kThreads) lse[row] = -INFINITY;
    return;
  }
  // Blocks are visited from num_key_blocks - 1 down to first_key_block. Block b needs the element-wise
  // mask unless every row of the block sees all of its keys: b < hi_unmasked (within the first row's
  // band end, hence within the keys) and b >= lo_unmasked (at or after the last row's band start).
  const int last_row = first_row + valid_rows - 1;
  const int hi_unmasked = max(first_key_block, min(num_key_blocks, band.end(first_row) / kBlockN));
  const int lo_unmasked = min(hi_unmasked, max(first_key_block, (band.begin(last_row) + kBlockN - 1) / kBlockN));
  const int num_blocks = num_key_blocks - first_key_block;

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  // K and V of the i-th visited block into buffer i % kStages.
  auto load_key_block = [&](int i) {
    const int stage = i % kStages;
    const int key_row = k_row0 + (num_key_blocks - 1 - i) * kBlockN;
    mbarrier_arrive_expect_bytes(bar_k_full(stage), Tile::kKvBytes);
    for (int c = 0; c < Tile::kColumnRegions; ++c) {
      tma_load_4d(smem_k(stage) + c * kBlockN * 128, &maps.k, bar_k_full(stage), c * 64, key_row, kv_head, tma_batch);
    }
    mbarrier_arrive_expect_bytes(bar_v_full(stage), Tile::kKvBytes);
    for (int c = 0; c < Tile::kColumnRegions; ++c) {
      tma_load_4d(smem_v(stage) + c * kBlockN * 128, &maps.v, bar_v_full(stage), c * 64, key_row, kv_head, tma_batch);
    }
  };
  // With one CTA per SM the hardware starts CTAs in launch order as SMs free up, so the CTA launched
  // num_sm_ids() after this one starts about when this one ends. Its Q (read by no other CTA: a DRAM miss
  // otherwise) and its first K / V block go into L2 now. (A narrow window pays a CTA start per ~9 key blocks.)
  // H200, bf16, 16k tokens, 2026-11-30, two runs: 2k forward hd64 +6%, hd128 +3-5%; 8k and windows within
  // +-1.5% (a start still takes ~3100 cycles to Q's arrival); hd256 -0.5 to -1.6% (its tiles are twice the
  // bytes), so not there. Not for variable-length batches, where the tile's rows would need a read of
  // cu_seqlens first.
  auto prefetch_next_wave_tile = [&]() {
    const uint32_t next = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z) + num_sm_ids();
    const uint32_t next_z = next / (gridDim.x * gridDim.y);
    if (next_z >= gridDim.z) return;
    const int next_head = static_cast<int>(next / gridDim.x % gridDim.y);
    const int next_first_row = static_cast<int>(gridDim.x - 1 - next % gridDim.x) * kBlockM;
    const int next_last_row = min(next_first_row + kBlockM, len_q) - 1;
    for (int c = 0; c < Tile::kColumnRegions; ++c) {
      tma_prefetch_l2_4d(&maps.q, c * 64, next_first_row, next_head, next_z);
    }
    const int next_key_end = band.end(next_last_row);
    if (next_key_end <= band.begin(next_first_row)) return;
    const int key_row = (next_key_end - 1) / kBlockN * kBlockN;  // its first visited block
    const int next_kv_head = next_head / params.heads_per_kv();
    for (int c = 0; c < Tile::kColumnRegions; ++c) {
      tma_prefetch_l2_4d(&maps.k, c * 64, key_row, next_kv_head, next_z);
      tma_prefetch_l2_4d(&maps.v, c * 64, key_row, next_kv_head, next_z);
    }
  };
  if (threadIdx.x == 0) {
    mbarrier_init(bar_q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(bar_k_full(s), 1);
      mbarrier_init(bar_v_full(s), 1);
      release_count[s] = 0;
    }
    mbarrier_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    prefetch_tensor_map(&maps.q);
    prefetch_tensor_map(&maps.k);
    prefetch_tensor_map(&maps.v);
    mbarrier_arrive_expect_bytes(bar_q_full, Tile::kQBytes);
    for (int c = 0; c < Tile::kColumnRegions; ++c) {
      tma_load_4d(smem_q + c * kBlockM * 128, &maps.q, bar_q_full, c * 64, q_row0, head, tma_batch);
    }
    for (int i = 0; i < min(num_blocks, kStages); ++i) load_key_block(i);
    if (kHeadDim <= 128 && !params.is_varlen()) prefetch_next_wave_tile();
  }
  // Called by each warp once the wgmmas that read block i's buffers completed: the last of the 8 warps
  // reloads the buffer with block i + kStages.
  auto release_key_block = [&](int i) {
    if (last_warp_to_release<Tile::kWarps>(&release_count[i % kStages]) && i + kStages < num_blocks) {
      load_key_block(i + kStages);
    }
  };

  const int group = warp / 4;  // warpgroup: rows 64 * group .. + 63
  const int warp_first_row = 64 * group + 16 * (warp % 4);  // within the block
  using Mma = Wgmma<Element, kBlockN>;
  using MmaO = Wgmma<Element, kHeadDim>;

  const ScoreMod mod(params, batch, head, len_q, len_k);
  float acc_o[1][kNTilesO][4] = {};  // the warp's 16 rows of O (mma.sync layout, as acc_s)
  OnlineSoftmax<1> softmax;

  mbarrier_wait(bar_q_full, 0);

  if constexpr (kPipelined) {
    // Operand descriptors: a tile's base descriptor, formed per key block (opaque_u64, as in issue_qk_gemm),
    // plus the k-step's byte offset. O += P V k-step t covers keys 16t .. 16t + 15; V is MN-major, its
    // 64-column regions kBlockN rows apart.
    // S = Q K_iᵀ of the i-th visited block into acc_s: issued and committed, not waited for.
    auto issue_scores = [&](int i, float (&acc_s)[1][kNTilesS][4]) {
      const int stage = i % kStages;
      issue_qk_gemm<Element, kBlockM, kBlockN, kHeadDim>(acc_s[0], smem_q + group * 64 * 128, smem_k(stage),
                                                         bar_k_full(stage), (i / kStages) & 1);
    };
    // O += P V_i: issued and committed, not waited for.
    auto issue_pv = [&](int i, const uint32_t (&p_frag)[1][kBlockN / 16][4]) {
      const int stage = i % kStages;
      const uint64_t v_desc = opaque_u64(swizzle128_descriptor(smem_v(stage), kBlockN * 128));
      mbarrier_wait(bar_v_full(stage), (i / kStages) & 1);
      wgmma_fence();
#pragma unroll
      for (int t = 0; t < kBlockN / 16; ++t) {
        MmaO::template rs<1>(acc_o[0], p_frag[0][t], descriptor_plus(v_desc, t * 16 * 128), 1);
      }
      wgmma_commit();
    };
    // Block i's completed scores -> P (16 bits) in p_frag; the online softmax's rescale of O is left to the
    // caller (o_factor; returns whether any row of the warp needs it), since O may still be accumulating.
    // (Block 0 takes this path too: its rows' bases start at -inf, so their factors are 0, on a zero O.)
    // A runtime flag for the mask: with the flags as template arguments of a generic lambda here, nvcc 13.0's
    // cicc crashed (segmentation fault).
    const float score_scale_log2 = params.fwd_score_scale_log2;
    auto scores_to_p = [&](int i, float (&acc_s)[1][kNTilesS][4], uint32_t (&p_frag)[1][kBlockN / 16][4],
                           float (&o_factor)[2]) {
      const int key_block = num_key_blocks - 1 - i;
      float row_offset[2] = {};  // ALiBi's row terms (score_tile.cuh)
      if (mod.active()) modify_scores(acc_s, first_row + warp_first_row, key_block * kBlockN, mod, row_offset);
      if (key_block >= hi_unmasked || key_block < lo_unmasked) {
        mask_scores(acc_s, first_row + warp_first_row, key_block * kBlockN, band);
      }
      const bool rescale = softmax.template raise_bases<false>(acc_s, score_scale_log2, row_offset, o_factor);
      softmax.exponentiate(acc_s, score_scale_log2, row_offset);
      accumulator_to_a_fragments<Element>(acc_s, p_frag);
      if (params.has_dropout()) drop_probabilities(p_frag, first_row + warp_first_row, key_block * kBlockN, params);
      return rescale;
    };

    // The warpgroup's own GEMMs overlap its softmax (FlashAttention-3's intra-warpgroup pipelining): while
    // block i's scores are exponentiated, block i's S has completed but block i - 1's P V still runs,
    // and the next S is issued before that P V. Block 0 first, alone.
    float acc_s[1][kNTilesS][4];
    uint32_t p_frag[1][kBlockN / 16][4];
    float o_factor[2];
    issue_scores(0, acc_s);
    wgmma_wait<0>();
    register_fence(acc_s[0]);
    scores_to_p(0, acc_s, p_frag, o_factor);
    // One pipelined step: block i's S, block i - 1's P V (from p_prev); block i's P into p_next. Two P
    // buffers alternate (a copy between them made ptxas serialise the wgmmas: C7513, a non-wgmma
    // instruction defining a wgmma input inside the pipeline stage).
    uint32_t p_other[1][kBlockN / 16][4];
    auto step = [&](int i, const uint32_t (&p_prev)[1][kBlockN / 16][4], uint32_t (&p_next)[1][kBlockN / 16][4]) {
      issue_scores(i, acc_s);
      issue_pv(i - 1, p_prev);
      wgmma_wait<1>();  // S of block i (P V of block i - 1 may still run)
      register_fence(acc_s[0]);
      const bool rescale = scores_to_p(i, acc_s, p_next, o_factor);
      wgmma_wait<0>();  // P V of block i - 1
      register_fence(acc_o[0]);
      release_key_block(i - 1);  // its K and V are no longer read by this warp
      if (rescale) softmax.rescale(acc_o, o_factor);
    };
    int i = 1;
    for (; i + 1 < num_blocks; i += 2) {
      step(i, p_frag, p_other);
      step(i + 1, p_other, p_frag);
    }
    if (i < num_blocks) {
      step(i, p_frag, p_other);
      issue_pv(num_blocks - 1, p_other);
    } else {
      issue_pv(num_blocks - 1, p_frag);
    }
  } else {
    // The plain loop (head_dim 64 and 256): per block S, wait, softmax, P V issued; the descriptors formed
    // per k-step.
    // S = Q Kᵀ k-step t covers head-dim columns 16t .. 16t + 15: region t / 4, 32 bytes per step inside it.
    auto q_descriptor = [&](int t) {
      return swizzle128_descriptor(smem_q + (t / 4) * kBlockM * 128 + group * 64 * 128 + (t % 4) * 32, 16);
    };
    auto k_descriptor = [&](int stage, int t) {
      return swizzle128_descriptor(smem_k(stage) + (t / 4) * kBlockN * 128 + (t % 4) * 32, 16);
    };
    // O += P V k-step t covers keys 16t .. 16t + 15; V is MN-major, its 64-column regions kBlockN rows apart.
    auto v_descriptor = [&](int stage, int t) {
      return swizzle128_descriptor(smem_v(stage) + t * 16 * 128, kBlockN * 128);
    };

    auto process_key_block = [&](int i, auto is_first, auto needs_mask) {
      const int stage = i % kStages;
      const uint32_t parity = (i / kStages) & 1;
      const int key_block = num_key_blocks - 1 - i;

      float acc_s[1][kNTilesS][4];
      mbarrier_wait(bar_k_full(stage), parity);
      wgmma_fence();
#pragma unroll
      for (int t = 0; t < kHeadDim / 16; ++t) Mma::template ss<0>(acc_s[0], q_descriptor(t), k_descriptor(stage, t), t);
      wgmma_commit();
      wgmma_wait<0>();  // this S, and the previous block's P V
      register_fence(acc_s[0]);
      register_fence(acc_o[0]);
      // The previous block's buffers are no longer read by this warp.
      if (!decltype(is_first)::value) release_key_block(i - 1);

      float row_offset[2] = {};  // ALiBi's row terms (score_tile.cuh)
      if (mod.active()) modify_scores(acc_s, first_row + warp_first_row, key_block * kBlockN, mod, row_offset);
      if constexpr (decltype(needs_mask)::value) {
        mask_scores(acc_s, first_row + warp_first_row, key_block * kBlockN, band);
      }
      softmax.template update<decltype(is_first)::value>(acc_s, acc_o, params.fwd_score_scale_log2, row_offset);
      uint32_t p_frag[1][kBlockN / 16][4];
      accumulator_to_a_fragments<Element>(acc_s, p_frag);
      if (params.has_dropout()) drop_probabilities(p_frag, first_row + warp_first_row, key_block * kBlockN, params);

      mbarrier_wait(bar_v_full(stage), parity);
      wgmma_fence();
#pragma unroll
      for (int t = 0; t < kBlockN / 16; ++t) MmaO::template rs<1>(acc_o[0], p_frag[0][t], v_descriptor(stage, t), 1);
      wgmma_commit();
    };

    using True = std::true_type;
    using False = std::false_type;
    auto needs_mask = [&](int i) {
      const int key_block = num_key_blocks - 1 - i;
      return key_block >= hi_unmasked || key_block < lo_unmasked;
    };
    if (needs_mask(0)) {
      process_key_block(0, True{}, True{});
    } else {
      process_key_block(0, True{}, False{});
    }
    for (int i = 1; i < num_blocks; ++i) {
      if (needs_mask(i)) {
        process_key_block(i, False{}, True{});
      } else {
        process_key_block(i, False{}, False{});
      }
    }
  }
  wgmma_wait<0>();
  register_fence(acc_o[0]);

  float row_lse[2];
  softmax.finalize(acc_o, params.fwd_score_scale, row_lse);
  if (params.has_dropout()) {  // kept probabilities count 1 / (1 - p)
#pragma unroll
    for (int j = 0; j < kNTilesO; ++j) {
#pragma unroll
      for (int r = 0; r < 4; ++r) acc_o[0][j][r] *= params.dropout_scale;
    }
  }

  // Epilogue: the warpgroup writes its 64 rows of O (16-bit) over its own rows of the Q tile (its last
  // S = Q Kᵀ completed; the other warpgroup reads only its own rows), then copies them out in 16-byte
  // chunks.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = warp_first_row + lane / 4 + 8 * half;
#pragma unroll
    for (int j = 0; j < kNTilesO; ++j) {
      *reinterpret_cast<uint32_t*>(smem + swizzled_offset(kBlockM, row, j * 8 + 2 * (lane % 4))) =
          pack_float2<Element>(acc_o[0][j][2 * half], acc_o[0][j][2 * half + 1]);
    }
    if (lane % 4 == 0 && row < valid_rows) lse[row] = row_lse[half];
  }
  named_barrier_sync(1 + group, 128);
  const int thread_in_group = threadIdx.x % 128;
  for (int chunk_id = thread_in_group; chunk_id < 64 * kChunksPerRow; chunk_id += 128) {
    const int row = 64 * group + chunk_id / kChunksPerRow;
    const int col = chunk_id % kChunksPerRow * 8;
    if (row < valid_rows) {
      *reinterpret_cast<uint4*>(out + row * params.out_strides.row + col) =
          *reinterpret_cast<const uint4*>(smem + swizzled_offset(kBlockM, row, col));
    }
  }
#endif  // sm_90a
}

}  // namespace flash_ext::sm90
