// Does compute-sanitizer racecheck follow a producer / consumer handoff through named barriers? The persistent
// sm90 forward hands each tile index from its producer warp to 8 consumer warps through a shared-memory slot
// this way (csrc/sm90/fwd_persistent_kernel.cuh); racecheck flags it only where tiles follow each other with
// no work between them. This kernel is that handoff alone: the producer warp's lane 0 writes slot c % 2, the
// warp arrives at "written"; the consumers wait there, read the slot and arrive at "read"; the producer waits
// at "read" before writing the slot again. Each consumer iteration spins `work_ns` (0: back to back).
//
//   nvcc -arch=sm_90a -o /tmp/probe scripts/racecheck_handoff_probe.cu
//   compute-sanitizer --tool racecheck /tmp/probe 0      # back to back
//   compute-sanitizer --tool racecheck /tmp/probe 2000   # 2 us of work per tile
#include <cstdio>
#include <cstdlib>

namespace {

constexpr int kSlots = 2;
constexpr int kConsumerWarps = 8;
constexpr int kHandoffThreads = 32 * (kConsumerWarps + 1);
constexpr int kWrittenBarrier = 1;              // + the slot
constexpr int kReadBarrier = 1 + kSlots;        // + the slot

__device__ __forceinline__ void bar_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

__global__ void __launch_bounds__(32 * (4 + kConsumerWarps), 1) handoff(int* sums, int num_tiles, unsigned work_ns) {
  __shared__ volatile int slot[kSlots];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < 4) {
    if (warp != 0) return;
    int c = 0;
    for (;; ++c) {
      const int s = c % kSlots;
      __syncwarp();
      if (c >= kSlots) bar_sync(kReadBarrier + s, kHandoffThreads);
      if (lane == 0) slot[s] = c < num_tiles ? c : -1;
      __syncwarp();
      bar_arrive(kWrittenBarrier + s, kHandoffThreads);
      if (c >= num_tiles) break;
    }
    for (int d = c - kSlots + 1 < 0 ? 0 : c - kSlots + 1; d <= c; ++d) bar_sync(kReadBarrier + d % kSlots, kHandoffThreads);
    return;
  }
  int sum = 0;
  for (int c = 0;; ++c) {
    const int s = c % kSlots;
    __syncwarp();
    bar_sync(kWrittenBarrier + s, kHandoffThreads);
    const int tile = slot[s];
    __syncwarp();
    bar_arrive(kReadBarrier + s, kHandoffThreads);
    if (tile < 0) break;
    if (work_ns) __nanosleep(work_ns);
    sum += tile;
  }
  if (threadIdx.x == 128) sums[blockIdx.x] = sum;
}

}  // namespace

int main(int argc, char** argv) {
  const unsigned work_ns = argc > 1 ? static_cast<unsigned>(atoi(argv[1])) : 0;
  constexpr int kBlocks = 4, kTiles = 64;
  int* sums = nullptr;
  cudaMalloc(&sums, kBlocks * sizeof(int));
  handoff<<<kBlocks, 32 * (4 + kConsumerWarps)>>>(sums, kTiles, work_ns);
  int host[kBlocks];
  cudaMemcpy(host, sums, sizeof(host), cudaMemcpyDeviceToHost);
  const cudaError_t err = cudaGetLastError();
  const int expected = kTiles * (kTiles - 1) / 2;
  bool ok = err == cudaSuccess;
  for (int b = 0; b < kBlocks; ++b) ok = ok && host[b] == expected;
  printf("handoff probe (work %u ns): %s (%s)\n", work_ns, ok ? "sums ok" : "WRONG SUMS", cudaGetErrorString(err));
  return ok ? 0 : 1;
}
