// FLASH_EXT_HOST_DEVICE marks the small helpers that run both on the host (the CPU path, the
// op's checks) and inside the CUDA kernels. Headers that use it stay torch-free.
#pragma once

#if defined(__CUDACC__)
#define FLASH_EXT_HOST_DEVICE __host__ __device__
#else
#define FLASH_EXT_HOST_DEVICE
#endif
