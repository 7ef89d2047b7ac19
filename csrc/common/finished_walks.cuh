// The handshake that lets the dQ conversion overlap the sm90 dK/dV kernel.
//
// Why: the dK/dV kernel runs one CTA per SM, and its last wave is often partial, while the conversion
// (dq_accum -> dq, 201 MB at hd128, 16k x 16 heads) takes ~51 us after it. A sequence's dQ rows of one head
// are final once every walk of that (batch, kv head) has added its dQ; the walks run key block fastest, then
// kv head, then batch, so all but the last few heads are final well before the last wave ends. Measured
// (H200, hd128, 16 heads, GPU time per backward, 2026-12-01): window (1024, 1024) at 16k -1.2%; window
// (1024, 0) nothing (its last key blocks have short walks, so its last wave leaves no SM idle); full 8 x 2k
// -2.3% in one run, nothing in another.
//
// How: each walk of the dK/dV kernel (a key block of one (batch, kv head)) adds 1 to
// BwdParams::dkdv_finished[kFinishedCounterStride * (batch * heads_kv + kv_head)] with release semantics after
// its dQ additions (not after its dK / dV stores, which the conversion does not read: a release after them
// would make every walk wait for them, ~0.5% of a window (1024, 0) backward: H200, 2026-12-01); the conversion is
// launched as a programmatic dependent (PDL) of the dK/dV kernel, so its CTAs start on the SMs that the kernel's persistent CTAs leave
// as they run out of walks, and each warp waits (acquire) until its sequence's counter holds that sequence's
// walk count. PDL lets the dependent start only once every dK/dV CTA has started and passed its own wait for
// the preprocess, which zeroes the counters (griddepcontrol.launch_dependents after griddepcontrol.wait in
// each), so the walks it waits for belong to resident CTAs (the wait cannot deadlock) and the counts it
// reads are this call's. Without PDL (an older driver, or the launch attribute ignored) the conversion
// starts after the kernel and finds the counts complete.
#pragma once

#include <cstdint>

namespace flash_ext {

// Counts a walk as finished (the calling thread: one per CTA and walk). Call it after a CTA barrier that every
// thread reached after its dQ additions of the walk: the release orders the whole CTA's earlier writes, which
// the barrier made happen before it, before the increment (the calling thread waits until they are performed);
// writes after the barrier (dK / dV, which the conversion does not read) are not waited for.
__device__ __forceinline__ void count_finished_walk(int* counter) {
  asm volatile("red.release.gpu.global.add.s32 [%0], 1;\n" ::"l"(counter) : "memory");
}

// Waits (called by every lane of a warp) until *counter >= expected; then each lane has read the counter
// with acquire semantics, so that its later loads see what the counted CTAs wrote. Lane 0 polls, with
// exponential backoff from 0.5 to 8 us, so that thousands of waiting warps do not keep one L2 slice busy
// under the dK/dV kernel's traffic. A counter that never gets there would be a bug in the launcher's
// arithmetic; rather than hang the process, the wait traps after ~10 seconds.
__device__ __forceinline__ void wait_for_finished_walks(const int* counter, int expected) {
  auto load_acquire = [&] {
    int value;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(value) : "l"(counter) : "memory");
    return value;
  };
  if (threadIdx.x % 32 == 0 && load_acquire() < expected) {
    uint64_t start = 0, now = 0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    unsigned sleep_ns = 500;
    do {
      __nanosleep(sleep_ns);
      sleep_ns = sleep_ns < 8000 ? 2 * sleep_ns : sleep_ns;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
      if (now - start > 10'000'000'000ull) __trap();
    } while (load_acquire() < expected);
  }
  __syncwarp();
  (void)load_acquire();  // every lane's own acquire (the count is complete now)
}

// The dK/dV walks of one (batch, kv head) that are counted: those whose first key lies in the
// sequence, i.e. ceil(len_k / keys_per_walk), at most the launched grid's key blocks (clamped, so that
// lengths the grid does not cover cannot make the wait endless).
__device__ __forceinline__ int counted_walks(int64_t len_k, int keys_per_walk, int key_blocks_launched) {
  if (len_k <= 0) return 0;
  const int64_t blocks = (len_k + keys_per_walk - 1) / keys_per_walk;
  return blocks < key_blocks_launched ? static_cast<int>(blocks) : key_blocks_launched;
}

}  // namespace flash_ext
