// Picks the sm80 instantiation for params.dtype and params.head_dim. Host-only; used by
// csrc/flash_api.cpp (kept apart from launch.h so that a kernel translation unit does not
// instantiate, through this switch, every other head dim).
#pragma once

#include <stdexcept>
#include <string>
#include <type_traits>

#include "launch.h"

namespace flash_ext::sm80 {

// Calls fn(elem, head_dim) with both as std::integral_constant. params.head_dim must already be
// one of 32, 64, ..., 256 (the API pads others).
template <typename Fn>
void dispatch_dtype_head_dim(const FwdParams& params, Fn&& fn) {
  auto for_dtype = [&](auto elem) {
    switch (params.head_dim) {
      case 32: return fn(elem, std::integral_constant<int, 32>{});
      case 64: return fn(elem, std::integral_constant<int, 64>{});
      case 96: return fn(elem, std::integral_constant<int, 96>{});
      case 128: return fn(elem, std::integral_constant<int, 128>{});
      case 160: return fn(elem, std::integral_constant<int, 160>{});
      case 192: return fn(elem, std::integral_constant<int, 192>{});
      case 224: return fn(elem, std::integral_constant<int, 224>{});
      case 256: return fn(elem, std::integral_constant<int, 256>{});
      default: throw std::invalid_argument("flash_ext: no sm80 kernel for head_dim " + std::to_string(params.head_dim));
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

inline void run_attention_fwd_dispatch(const FwdParams& params, cudaStream_t stream) {
  dispatch_dtype_head_dim(params, [&](auto elem, auto head_dim) {
    run_attention_fwd<decltype(elem)::value, decltype(head_dim)::value>(params, stream);
  });
}

inline void run_attention_bwd_dispatch(const BwdParams& params, cudaStream_t stream) {
  dispatch_dtype_head_dim(params, [&](auto elem, auto head_dim) {
    run_attention_bwd<decltype(elem)::value, decltype(head_dim)::value>(params, stream);
  });
}

}  // namespace flash_ext::sm80
