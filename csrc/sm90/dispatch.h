// Picks the sm90 forward instantiation for params.dtype and params.head_dim, where one exists.
// Host-only; used by csrc/flash_api.cpp.
#pragma once

#include <cstdlib>
#include <cstring>

#include "launch.h"

namespace flash_ext::sm90 {

// FLASH_EXT_DISABLE_SM90=1 sends every call to the sm80 kernels (for comparisons and for testing both
// paths on one Hopper GPU).
inline bool sm90_disabled() {
  const char* value = std::getenv("FLASH_EXT_DISABLE_SM90");
  return value != nullptr && std::strcmp(value, "1") == 0;
}

// Runs the sm90 forward where it takes the call (launch.h); false: the caller runs the sm80 one.
inline bool try_run_attention_fwd(const FwdParams& params, cudaStream_t stream) {
  if (sm90_disabled() || params.head_dim != 128) return false;
  if (params.dtype == DType::kBFloat16) return run_attention_fwd<Elem16::kBFloat16, 128>(params, stream);
  if (params.dtype == DType::kFloat16) return run_attention_fwd<Elem16::kFloat16, 128>(params, stream);
  return false;
}

}  // namespace flash_ext::sm90
