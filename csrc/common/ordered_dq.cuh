// The deterministic dQ of the sm90 dK/dV kernel (deterministic = true): dQ is still added into the fp32
// accumulator with atomics, but every accumulator element receives its terms in one fixed order, so the
// fp32 sums, and dq, are bitwise the same on every run.
//
// Order: at each query block, the walks (key blocks of one (batch, kv head)) that see it add their dQ from the
// highest key block down. That is the order in which they arrive when started together: a higher key block's
// walk starts at a later query block (band masks grow with the row), so it reaches any given query block in an
// earlier step (causal or windowed), or in the same step (no mask). The kernel hands out a head's tiles from its
// last key block down too (in groups of heads, BwdWalk::coords_of), so a walk only ever waits for walks taken
// before it, held by CTAs that are running (persistent CTAs are resident together; the per-walk variant takes its
// tile from a counter): no deadlock.
//
// Turns: ints in BwdParams::dq_turns, zeroed by the preprocess. After adding its terms, key block n stores
// n + 1 in the turn; key block n waits until it holds n + 2 (key block n + 1 sees the query block) or 0 (none
// above it does). The set of key blocks that see a query block is contiguous (both ends of the band grow with
// the row), so "n + 1 sees it" decides whether anyone above n does. Who takes turns:
//   - the persistent kernel: one turn per (query head, query block, dQ part), each part's kept by a warp of
//     the producer warpgroup (a turn keeper): it reads the turn, grants it to the 8 consumer warps through an
//     mbarrier, and passes it on once they have all arrived after their atomics of that part. The consumers wait on and arrive at
//     mbarriers only: polling, fences and release stores in the consumer warps themselves cost 22-28% of the
//     backward (H200, hd128 8k, bf16, 2026-12-02: 456 TFLOP/s unordered, 329 with per-warp turns);
//   - the per-walk kernel (softcap / ALiBi / dropout, no spare warp): one turn per warp slice of the
//     accumulator (query head, 8-row group where the warp's 16 rows start, column half), taken by the warp:
//     lane 0 reads it with a relaxed load issued a GEMM earlier and polls only when that read did not match,
//     and passes it one step late, when the warp's atomics have long completed, so that the release does not
//     stall on them.
#pragma once

#include <cstdint>

namespace flash_ext {

// Index in BwdParams::dq_turns of the turn of `head`'s dQ accumulator rows from `accum_row` (8-aligned), column
// half `half`: 2 per 8-row group, as dq_turn_ints (params.h) sizes them.
__device__ __forceinline__ int64_t dq_turn_index(int head, int64_t dq_accum_rows, int64_t accum_row, int half) {
  return (head * dq_accum_rows + accum_row) / 8 * 2 + half;
}

__device__ __forceinline__ int read_dq_turn(const int* turn) {
  int value;
  asm volatile("ld.relaxed.gpu.global.s32 %0, [%1];\n" : "=r"(value) : "l"(turn) : "memory");
  return value;
}

// Waits (every lane of the warp) until *turn == expected; `seen` is lane 0's earlier read_dq_turn. When that
// read matched, the atomics that follow are issued only after it returned (a control dependency through
// __syncwarp), and the previous warp's atomics were performed at L2 before its release made the value visible,
// so ours reach each address after its; otherwise lane 0 polls with acquire loads and backs off. A turn that
// never comes would be a bug in the order's arithmetic: rather than hang, the wait gives up after ~10 seconds
// and the sums lose their order (the tests' bitwise comparisons catch that). Not __trap(): with a trap in the
// loop, ptxas serialises the dK/dV kernel's wgmmas (C7514) and spills ~2 KB (hd128, sm_90a).
__device__ __forceinline__ void wait_for_dq_turn(const int* turn, int expected, int seen) {
  if (threadIdx.x % 32 == 0 && seen != expected) {
    auto load_acquire = [&] {
      int value;
      asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(value) : "l"(turn) : "memory");
      return value;
    };
    uint64_t start = 0, now = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    unsigned sleep_ns = 32;
    while (load_acquire() != expected) {
      __nanosleep(sleep_ns);
      sleep_ns = sleep_ns < 1024 ? 2 * sleep_ns : sleep_ns;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (now - start > 10'000'000'000ull) break;
    }
  }
  __syncwarp();
}

// The turn keeper's (one thread): waits until *turn == expected, with acquire semantics (a fence where the
// early read `seen` matched), so that the grant it then gives (an mbarrier arrival) carries the previous
// CTA's atomics to the consumer warps. Gives up after ~10 seconds as wait_for_dq_turn.
__device__ __forceinline__ void acquire_dq_turn(const int* turn, int expected, int seen) {
  if (seen == expected) {
    asm volatile("fence.acq_rel.gpu;\n" ::: "memory");
    return;
  }
  uint64_t start = 0, now = 0;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
  unsigned sleep_ns = 32;
  for (;;) {
    int value;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(value) : "l"(turn) : "memory");
    if (value == expected) return;
    __nanosleep(sleep_ns);
    sleep_ns = sleep_ns < 512 ? 2 * sleep_ns : sleep_ns;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    if (now - start > 10'000'000'000ull) return;
  }
}

// The turn keeper's (one thread, after an mbarrier wait at which every consumer warp arrived after its
// atomics): the release orders those atomics, which the wait made happen before it, before the store.
__device__ __forceinline__ void release_dq_turn(int* turn, int value) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;\n" ::"l"(turn), "r"(value) : "memory");
}

// Passes the turn (every lane of the warp, after its atomics): __syncwarp orders the lanes' atomics before
// lane 0's release store.
__device__ __forceinline__ void pass_dq_turn(int* turn, int value) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) release_dq_turn(turn, value);
}

}  // namespace flash_ext
