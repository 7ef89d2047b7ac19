// Picks the sm90 forward instantiation for params.dtype and params.head_dim, where one exists.
// Host-only; used by csrc/flash_api.cpp.
#pragma once

#include <type_traits>

#include "launch.h"

namespace flash_ext::sm90 {

// Runs the sm90 forward where it takes the call (launch.h); false: the caller runs the sm80 one.
inline bool try_run_attention_fwd(const FwdParams& params, cudaStream_t stream) {
  if (sm90_disabled()) return false;
  auto for_dtype = [&](auto elem) {
    constexpr Elem16 kElem = decltype(elem)::value;
    switch (params.head_dim) {
      case 64: return run_attention_fwd<kElem, 64>(params, stream);
      case 128: return run_attention_fwd<kElem, 128>(params, stream);
      case 256: return run_attention_fwd<kElem, 256>(params, stream);
      default: return false;  // other head dims: the sm80 kernels
    }
  };
  if (params.dtype == DType::kBFloat16) return for_dtype(std::integral_constant<Elem16, Elem16::kBFloat16>{});
  if (params.dtype == DType::kFloat16) return for_dtype(std::integral_constant<Elem16, Elem16::kFloat16>{});
  return false;
}

}  // namespace flash_ext::sm90
