// Timelines of the decode kernels, for developers: in a build with FLASH_EXT_DECODE_TRACE defined (setup.py
// defines it when the environment has FLASH_EXT_DECODE_TRACE=1), each warp of the decode kernel writes the
// %globaltimer (ns) at fixed points of its work, and each combine CTA at its own, into the buffer whose address
// the environment variable FLASH_EXT_DECODE_TRACE_PTR holds when the call is made (ops_kvcache_cuda.cpp);
// scripts/decode_trace.py reads them. In every other build the stamps are empty and the buffer is never set.
//
// Layout (64-bit words): the decode kernel's warp w of CTA c (c = linear block index, x fastest) writes word
// (c * kWarps + w) * kTraceSlots + slot, its warp 0 also the SM id at slot kTraceSmSlot; the combine kernel's
// CTA r writes word kTraceCombineBase + r * 4 + slot (slots 0: entry, 1: its wait done, 2: end).
#pragma once

#include <cstdint>

#include "decode_params.h"

namespace flash_ext::decode {

constexpr int kTraceSlots = 32;
constexpr int64_t kTraceCombineBase = int64_t{1} << 20;
enum TraceSlot : int {
  kTraceEntry = 0,         // the CTA started
  kTraceCopiesIssued = 1,  // its first slices' copies issued (before the length is known: dense caches)
  kTraceLengthRead = 2,    // the sequence's length read and the split's keys known
  kTraceQLanded = 3,       // the Q tile in shared memory, the CTA synchronised
  kTraceStepLanded = 4,    // + 2 * step (steps 0-7): the step's copies landed
  kTraceStepScored = 5,    // + 2 * step: its scores and softmax done
  kTraceLoopDone = 20,     // the last step's P·V done
  kTraceRowsShared = 21,   // the warps' rows and lse in shared memory, the CTA synchronised
  kTraceWritten = 22,      // out (or the split's partial rows) written
  kTraceSmSlot = 31,       // warp 0: the SM id
};

__device__ __forceinline__ void trace_stamp(const DecodeParams& p, int slot) {
#ifdef FLASH_EXT_DECODE_TRACE
  if (p.trace == nullptr || threadIdx.x % 32 != 0 || slot >= kTraceSlots) return;
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(now));
  const int64_t cta = (int64_t{blockIdx.z} * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const int64_t word = (cta * (blockDim.x / 32) + threadIdx.x / 32) * kTraceSlots + slot;
  p.trace[word] = now;
  if (slot == kTraceEntry && threadIdx.x == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;\n" : "=r"(sm));
    p.trace[cta * (blockDim.x / 32) * kTraceSlots + kTraceSmSlot] = sm;
  }
#endif
}

__device__ __forceinline__ void trace_combine_stamp(const DecodeParams& p, int slot) {
#ifdef FLASH_EXT_DECODE_TRACE
  if (p.trace == nullptr || threadIdx.x != 0) return;
  unsigned long long now;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(now));
  p.trace[kTraceCombineBase + int64_t{blockIdx.x} * 4 + slot] = now;
#endif
}

}  // namespace flash_ext::decode
