// The deterministic dQ of the sm90 dK/dV kernel (deterministic = true): dQ is still added into the fp32
// accumulator with atomics, but every accumulator element receives its terms in one fixed order, so the
// fp32 sums, and dq, are bitwise the same on every run.
//
// Order: at each query block, the walks (key blocks of one (batch, kv head)) that see it add their dQ from the
// highest key block down. That is the order in which they arrive when started together: a higher key block's
// walk starts at a later query block (band masks grow with the row), so it reaches any given query block in an
// earlier step (causal or windowed), or in the same step (no mask). The kernel hands out a head's tiles from its
// last key block down too, so a walk only ever waits for walks taken before it, held by CTAs that are running
// (persistent CTAs are resident together; the per-walk variant takes its tile from a counter): no deadlock.
//
// Turns: one int per warp slice of the accumulator (query head, 8-row group where a warp's 16 rows start,
// column half: BwdParams::dq_turns), zeroed by the preprocess. After adding its terms, the warp of key block n
// stores n + 1 there; the warp of key block n waits until it holds n + 2 (key block n + 1 sees the query
// block) or 0 (none above it does). The set of key blocks that see a query block is contiguous (both ends of
// the band grow with the row), so "n + 1 sees it" decides whether anyone above n does.
//
// Costs kept off the critical path: lane 0 reads its turn with a relaxed load issued a step's GEMM earlier
// and only polls when that read did not match; the turn is passed (release: the warp's atomics performed
// first) one step later, when those atomics have long completed, so the release does not stall on them.
#pragma once

#include <cstdint>

namespace flash_ext {

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

// Passes the turn (every lane of the warp, after its atomics): __syncwarp orders the lanes' atomics before
// lane 0's release store.
__device__ __forceinline__ void pass_dq_turn(int* turn, int value) {
  __syncwarp();
  if (threadIdx.x % 32 == 0) asm volatile("st.release.gpu.global.s32 [%0], %1;\n" ::"l"(turn), "r"(value) : "memory");
}

}  // namespace flash_ext
