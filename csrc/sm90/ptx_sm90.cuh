// Thin wrappers over the Hopper (sm_90a) PTX the sm90 kernels use: mbarriers, TMA tile loads,
// wgmma fences / commits / waits and the shared-memory matrix descriptors. Compiled only into the
// sm_90a code of a translation unit (the same file also compiles for sm_80, where the sm90 kernels
// are empty).
#pragma once

#include <cstdint>

namespace flash_ext::sm90 {

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

// ---- mbarriers (64-bit shared-memory barriers with a phase bit and a transaction count) ----

__device__ __forceinline__ void mbarrier_init(uint32_t bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(arrivals) : "memory");
}

// Makes the initialisations visible to the async proxy (TMA) before any thread uses the barriers.
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also announces `bytes` of TMA data the phase must wait for.
__device__ __forceinline__ void mbarrier_arrive_expect_bytes(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes) : "memory");
}

// Blocks until the barrier's phase with parity `parity` has completed.
__device__ __forceinline__ void mbarrier_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
        "selp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}

// One arrival (no transaction bytes): a consumer's release of a buffer to the producer.
__device__ __forceinline__ void mbarrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(bar) : "memory");
}

// ---- register reallocation between warpgroups (setmaxnreg) ----

// The warpgroup gives up registers down to kRegisters per thread (the producer of a warp-specialised kernel).
template <int kRegisters>
__device__ __forceinline__ void release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}
// The warpgroup takes registers up to kRegisters per thread from those released (the consumers).
template <int kRegisters>
__device__ __forceinline__ void claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// ---- TMA ----

// A box of a 4-D tensor (coordinates innermost first: column, row, head, batch) into shared memory,
// completing `bar`'s transaction bytes. Elements outside the tensor arrive as zeros.
__device__ __forceinline__ void tma_load_4d(uint32_t smem_dst, const void* tensor_map, uint32_t bar, int col, int row,
                                            int head, int batch) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4, %5, %6}], "
      "[%2];\n" ::"r"(smem_dst),
      "l"(tensor_map), "r"(bar), "r"(col), "r"(row), "r"(head), "r"(batch)
      : "memory");
}

// A box of a 4-D tensor from shared memory (in the layout tma_load_4d gives) to global memory, in this
// thread's current bulk group; elements outside the tensor are not written. The shared memory may be
// written again once bulk_commit_and_wait_reads() returned.
__device__ __forceinline__ void tma_store_4d(const void* tensor_map, uint32_t smem_src, int col, int row, int head,
                                             int batch) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.tile.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n" ::"l"(
                   tensor_map), "r"(smem_src), "r"(col), "r"(row), "r"(head), "r"(batch)
               : "memory");
}
// Closes this thread's current bulk group, then waits until every group it issued has read its source.
__device__ __forceinline__ void bulk_commit_and_wait_reads() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
  asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

// Asks the TMA unit to bring the same box into L2 only: no shared memory, no barrier, nothing to wait for.
__device__ __forceinline__ void tma_prefetch_l2_4d(const void* tensor_map, int col, int row, int head, int batch) {
  asm volatile("cp.async.bulk.prefetch.tensor.4d.L2.global.tile [%0, {%1, %2, %3, %4}];\n" ::"l"(tensor_map), "r"(col),
               "r"(row), "r"(head), "r"(batch)
               : "memory");
}

// The number of SM identifiers of the device (PTX %nsmid: at least the number of SMs).
__device__ __forceinline__ uint32_t num_sm_ids() {
  uint32_t n;
  asm("mov.u32 %0, %%nsmid;\n" : "=r"(n));
  return n;
}

// A contiguous copy of `bytes` (a multiple of 16; both addresses 16-byte aligned) into shared memory,
// completing `bar`'s transaction bytes.
__device__ __forceinline__ void bulk_load(uint32_t smem_dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(smem_dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}

// Makes this thread's ordinary shared-memory stores visible to the async proxy (a wgmma reading them
// from shared memory) once the threads have synchronised.
__device__ __forceinline__ void fence_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }

__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(tensor_map) : "memory");
}

// ---- wgmma ----

// Orders this warp's register writes (accumulators, A fragments) before the wgmma that follows.
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most kPending committed wgmma groups of this warp are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// Keeps the compiler from moving reads or writes of the registers of an accumulator tile across a
// point (between issuing a wgmma that writes them and waiting for it).
template <int kRows, int kCols>
__device__ __forceinline__ void register_fence(float (&tile)[kRows][kCols]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
#pragma unroll
    for (int j = 0; j < kCols; ++j) asm volatile("" : "+f"(tile[i][j])::"memory");
  }
}
// The same for A fragments read by a wgmma in flight: kept in their registers until the wait.
template <int kRows, int kCols>
__device__ __forceinline__ void register_fence(uint32_t (&tile)[kRows][kCols]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
#pragma unroll
    for (int j = 0; j < kCols; ++j) asm volatile("" : "+r"(tile[i][j])::"memory");
  }
}

// Named barrier over `threads` threads (a multiple of 32); id 0 is __syncthreads's.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Counts one warp's release of a buffer (`counter`, in shared memory: how many of the kWarps warps are done
// with it) and returns true in lane 0 of the last of them, with the counter reset: that warp reloads the
// buffer, so no warp waits for a producer. Call from every lane.
template <int kWarps>
__device__ __forceinline__ bool last_warp_to_release(int* counter) {
  if (threadIdx.x % 32 != 0) return false;
  __threadfence_block();
  if (atomicAdd(counter, 1) != kWarps - 1) return false;
  *counter = 0;
  __threadfence_block();
  return true;
}

// Arrives at a named barrier without waiting (the threads that wait for it call named_barrier_sync with the
// same total count).
__device__ __forceinline__ void named_barrier_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

#endif  // sm_90a

// Shared-memory matrix descriptor of a wgmma operand in the 128-byte swizzled layout, the one TMA
// writes with CU_TENSOR_MAP_SWIZZLE_128B: rows of 64 16-bit elements (128 bytes), the 16-byte chunk c
// of row r stored at chunk c ^ (r % 8), groups of 8 rows 1024 bytes apart; every such region starts at
// a multiple of 1024 bytes.
//   K-major operand (Q, K in S = Q Kᵀ): `start` at row 0 of the operand and the k-step's 32-byte column
//     offset within the 128-byte row; the leading offset is unused; the stride is 8 rows (1024 B).
//   MN-major operand (V in O = P V): `start` at the k-step's first key row; the leading offset is the
//     distance between 64-column regions of the head dim; the stride is 8 rows of keys (1024 B).
__host__ __device__ constexpr uint64_t swizzle128_descriptor(uint32_t start, uint32_t leading_bytes) {
  return (uint64_t{(start & 0x3FFFF) >> 4}) | (uint64_t{(leading_bytes >> 4) & 0x3FFF} << 16) |
         (uint64_t{1024 >> 4} << 32) | (uint64_t{1} << 62);
}

// The descriptor of an operand `bytes` further on (within the same 256 KB of shared memory: the address
// field does not carry into the next).
__host__ __device__ constexpr uint64_t descriptor_plus(uint64_t descriptor, uint32_t bytes) {
  return descriptor + (bytes >> 4);
}

#if defined(__CUDA_ARCH__)
// The value, opaque to the compiler (which then cannot hoist what is derived from it out of a loop).
__device__ __forceinline__ uint64_t opaque_u64(uint64_t value) {
  asm volatile("mov.b64 %0, %0;" : "+l"(value));
  return value;
}
#endif

}  // namespace flash_ext::sm90
