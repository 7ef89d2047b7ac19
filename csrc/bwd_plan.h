// The CUDA backward's plan: every decision of a backward call made once, before any scratch is
// allocated or kernel launched (dispatch.cpp, plan_attention_bwd). The op (api/ops_cuda.cpp) allocates
// the scratch buffers the plan sizes; the launchers read the plan and re-derive nothing.
//
// A backward is three steps:
//   1. preprocess (sm80 kernel): D = rowsum(dO ∘ O) per query row, row_stats, and zeroing the dQ
//      accumulator and the counters that follow it;
//   2. dK / dV: the sm90 warp-specialised persistent kernel, or the sm80 kernel (plain, or the "extras"
//      instantiation for softcap / ALiBi / dropout), each adding dQ into the fp32 accumulator with atomics
//      (deterministic: the sm90 kernel in a fixed order, common/ordered_dq.cuh; the sm80 kernel not at all);
//      the sm80 kernel's tail walks may be split (TailSplit);
//   3. dQ: the accumulator scaled and rounded (overlapping the sm90 kernel's last wave as its programmatic
//      dependent), or, deterministic after the sm80 kernel, the sm80 dQ kernel recomputing S and dP per
//      query block.
#pragma once

#include <cstdint>

#include "params.h"

namespace flash_ext {

enum class DkDvKernel { kSm80, kSm90 };

struct BwdPlan {
  DkDvKernel dkdv = DkDvKernel::kSm80;
  // dQ summed with atomics into the fp32 accumulator (deterministic = false, or true on the sm90 kernel, which
  // orders them), else the dQ kernel.
  bool dq_by_atomics = false;
  // The sm80 dK/dV kernel's split tail walks (pieces > 1: split); only for the plain sm80 kernel.
  TailSplit tail_split;

  // Scratch, in elements (0: not allocated). dq_accum holds dq_accum_floats fp32 values followed by
  // counter_ints int32 counters (the sm90 kernel's finished walks per (batch, kv head) and its tile
  // counter, one per 128-byte line), so that the preprocess kernel zeroes both in one pass.
  int64_t softmax_d_floats = 0;  // D, in lse's layout
  int64_t dq_accum_rows = 0;     // rows per head of the accumulator (DqAccumLayout::rows_for)
  int64_t dq_accum_floats = 0;
  int64_t counter_ints = 0;
  int64_t dq_turn_ints = 0;  // deterministic on the sm90 kernel: its dQ turns (after the counters, zeroed with them)
  int64_t row_stats_floats = 0;  // [2][heads_q][dq_accum_rows]
  int64_t dkv_accum_floats = 0;  // the split tail walks' fp32 dK and dV sums

  // The accumulator, the counters and the turns: one allocation, which the preprocess zeroes whole.
  int64_t dq_scratch_elements() const { return dq_accum_floats + counter_ints + dq_turn_ints; }
};

}  // namespace flash_ext
