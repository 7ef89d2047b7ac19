// Thin wrappers over the PTX instructions the sm80 kernels are built from. Each is a few
// lines; the fragment-layout facts the kernels rely on are stated where they are used.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <array>
#include <cstdint>
#include <type_traits>

namespace flash_ext {

__device__ __forceinline__ uint32_t smem_address(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// 16-byte global -> shared copy through L2 only (.cg: tiles are reused from shared memory,
// not L1). With `valid` false nothing is read and the 16 bytes are zero-filled, which is how
// ragged tiles past the end of a sequence become zeros.
__device__ __forceinline__ void cp_async_16(uint32_t smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_dst), "l"(gmem_src), "r"(src_bytes));
}

// 4-byte global -> shared copy (per-row floats such as lse); zero-filled when `valid` is false.
// (.cg takes only 16-byte copies, hence .ca.)
__device__ __forceinline__ void cp_async_4(uint32_t smem_dst, const void* gmem_src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_dst), "l"(gmem_src), "r"(src_bytes));
}

// threadIdx.x read anew (S2R) at each use: the compiler otherwise keeps one read live for the whole
// kernel. For values needed once per tile copy in register-capped kernels a re-read costs less than a
// register: the forward at head_dim 64 (168 registers for 3 CTAs per SM) spilled tid / 8 of its copies
// and runs 2-3% faster with the re-read (H200, bf16, 2k / 8k, 2026-11-30). Used where a tile config asks
// for it (kRereadThreadIndex); its effect alone on the backward is not measured.
__device__ __forceinline__ unsigned thread_index_reread() {
  unsigned tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  return tid;
}

// blockIdx.x and gridDim.x read again, as thread_index_reread: for a value derived from them that ptxas
// would otherwise keep live (or spill) across a loop.
__device__ __forceinline__ unsigned block_index_reread() {
  unsigned ctaid;
  asm volatile("mov.u32 %0, %%ctaid.x;" : "=r"(ctaid));
  return ctaid;
}
__device__ __forceinline__ unsigned grid_size_reread() {
  unsigned nctaid;
  asm volatile("mov.u32 %0, %%nctaid.x;" : "=r"(nctaid));
  return nctaid;
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most `kPending` committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// Four 8x8 b16 matrices; lane i supplies the row address of matrix i/8, row i%8. Each lane
// receives, of matrix j, register j = elements (row lane/4, columns 2*(lane%4) and +1).
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&frag)[4], uint32_t smem_src) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(frag[0]), "=r"(frag[1]), "=r"(frag[2]), "=r"(frag[3])
               : "r"(smem_src));
}

// As ldmatrix_x4, each matrix transposed: register j = (column lane/4, rows 2*(lane%4) and +1).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&frag)[4], uint32_t smem_src) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(frag[0]), "=r"(frag[1]), "=r"(frag[2]), "=r"(frag[3])
               : "r"(smem_src));
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The inverse of ldmatrix_x4 (sm90+): lane i supplies the row address of matrix i/8, row i%8, and
// register j of each lane holds, of matrix j, elements (row lane/4, columns 2*(lane%4) and +1) -- the
// layout of an mma accumulator's 16-bit pairs.
__device__ __forceinline__ void stmatrix_x4(uint32_t smem_dst, const std::array<uint32_t, 4>& frag) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(smem_dst), "r"(frag[0]),
               "r"(frag[1]), "r"(frag[2]), "r"(frag[3])
               : "memory");
}
#endif

// Programmatic dependent launch (PDL, sm90+; no-ops on older GPUs, and where a kernel was launched without
// cudaLaunchAttributeProgrammaticStreamSerialization). allow_dependent_launch: this CTA no longer holds back
// the launch of the next kernel in the stream, if that one is a programmatic dependent (it starts once every
// CTA of this grid has done this or exited). wait_for_prerequisite_grid: blocks until the previous kernel in
// the stream has finished and its writes are visible; what a dependent does before it must not read them.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// D (16x8 fp32) += A (16x16, row-major) * B (16x8, column-major), 16-bit inputs.
// Fragments, with g = lane/4, t = lane%4:
//   A: a0 = (row g, cols 2t,2t+1), a1 = (row g+8, same), a2 = (row g, cols 2t+8,+9), a3 = (row g+8, same)
//   B: b0 = (rows 2t,2t+1, col g), b1 = (rows 2t+8,+9, col g)
//   D: d0,d1 = (row g, cols 2t,2t+1), d2,d3 = (row g+8, cols 2t,2t+1)
template <typename Element>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                             uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                                      uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats -> one register of two 16-bit values (round to nearest), `lo` in the low half.
template <typename Element>
__device__ __forceinline__ uint32_t pack_float2(float lo, float hi);

template <>
__device__ __forceinline__ uint32_t pack_float2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

template <>
__device__ __forceinline__ uint32_t pack_float2<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// address[0..3] += x, y, z, w in global memory, without a return value (a reduction in L2).
// sm90 has a 128-bit vector form (red.global.add.v4.f32): one atomic operation instead of four. Written
// as PTX: atomicAdd(float4*) compiles to ATOMG (an atomic that returns the old values: 16 bytes per lane
// back from L2 into 4 registers) in the sm90 dK/dV kernel, though the result is unused. REDG takes the L2
// from 72% to 50% busy at window (1024, 0) and makes the sm90 backward 6-8% faster at head_dim 64 / 128,
// 6-20% at 256 (H200, bf16, 8k, 2026-12-01). `address` is 16-byte aligned.
__device__ __forceinline__ void atomic_add_float4(float* address, float x, float y, float z, float w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(address), "f"(x), "f"(y), "f"(z), "f"(w)
               : "memory");
#else
  atomicAdd(address, x);
  atomicAdd(address + 1, y);
  atomicAdd(address + 2, z);
  atomicAdd(address + 3, w);
#endif
}

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
// Rounded to nearest, as torch's casts.
template <typename Element>
__device__ __forceinline__ Element from_float(float x) {
  if constexpr (std::is_same_v<Element, __nv_bfloat16>) {
    return __float2bfloat16_rn(x);
  } else {
    return __float2half_rn(x);
  }
}

}  // namespace flash_ext
