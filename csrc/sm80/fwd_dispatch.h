// Picks the sm80 forward instantiation for params.dtype and params.head_dim. Host-only; used
// by csrc/flash_api.cpp (kept apart from launch_fwd.h so that a kernel translation unit does
// not instantiate, through this switch, every other head dim).
#pragma once

#include <stdexcept>
#include <string>
#include <type_traits>

#include "launch_fwd.h"

namespace flash_ext::sm80 {

// params.head_dim must already be one of 32, 64, ..., 256 (the API pads others).
inline void run_attention_fwd_dispatch(const FwdParams& params, cudaStream_t stream) {
  auto for_dtype = [&](auto elem) {
    constexpr Elem16 kElem = decltype(elem)::value;
    switch (params.head_dim) {
      case 32: return run_attention_fwd<kElem, 32>(params, stream);
      case 64: return run_attention_fwd<kElem, 64>(params, stream);
      case 96: return run_attention_fwd<kElem, 96>(params, stream);
      case 128: return run_attention_fwd<kElem, 128>(params, stream);
      case 160: return run_attention_fwd<kElem, 160>(params, stream);
      case 192: return run_attention_fwd<kElem, 192>(params, stream);
      case 224: return run_attention_fwd<kElem, 224>(params, stream);
      case 256: return run_attention_fwd<kElem, 256>(params, stream);
      default: throw std::invalid_argument("flash_ext: no sm80 forward kernel for head_dim " + std::to_string(params.head_dim));
    }
  };
  if (params.dtype == DType::kBFloat16) {
    for_dtype(std::integral_constant<Elem16, Elem16::kBFloat16>{});
  } else if (params.dtype == DType::kFloat16) {
    for_dtype(std::integral_constant<Elem16, Elem16::kFloat16>{});
  } else {
    throw std::invalid_argument("flash_ext: the CUDA kernels take float16 or bfloat16");
  }
}

}  // namespace flash_ext::sm80
