// Host code shared by the sm90 launchers: TMA descriptors (cuTensorMapEncodeTiled through the runtime)
// and the checks that decide whether an sm90 kernel can take a call.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <cstdint>
#include <mutex>
#include <type_traits>

#include "../common/launch.cuh"
#include "../params.h"

namespace flash_ext::sm90 {

// cuTensorMapEncodeTiled from the driver, found through the runtime (no link against libcuda).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  static std::once_flag once;
  std::call_once(once, [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &status) ==
            cudaSuccess &&
        status == cudaDriverEntryPointSuccess) {
      encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
    }
  });
  return encode;
}

// Whether TMA can describe a (batch, seqlen, heads, head_dim) tensor with these strides (elements):
// a 16-byte aligned base and 16-byte multiples as strides. Dimensions of size 1 may have any stride
// in torch; they get a harmless one.
inline bool tma_compatible(const void* base, const TensorStrides& strides) {
  const auto aligned = [](int64_t bytes) { return bytes % 16 == 0 && bytes > 0 && bytes < (int64_t{1} << 40); };
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && aligned(strides.row * 2) && aligned(strides.head * 2) &&
         aligned(strides.batch * 2);
}

inline TensorStrides with_unit_dims_filled(TensorStrides strides, int64_t seqlen, int64_t heads, int64_t batch,
                                           int64_t head_dim) {
  if (seqlen == 1) strides.row = head_dim;
  if (heads == 1) strides.head = strides.row * seqlen;
  if (batch == 1) strides.batch = strides.head * heads;
  return strides;
}

// Boxes of 64 columns x kRows rows of one (head, batch), 128-byte swizzle, zeros outside the tensor.
template <typename Element, int kRows>
bool encode_tensor_map(CUtensorMap* map, const void* base, const TensorStrides& strides, int64_t seqlen, int64_t heads,
                       int64_t batch, int64_t head_dim) {
  const auto encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t dims[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(seqlen),
                              static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t byte_strides[3] = {static_cast<cuuint64_t>(strides.row * 2), static_cast<cuuint64_t>(strides.head * 2),
                                      static_cast<cuuint64_t>(strides.batch * 2)};
  const cuuint32_t box[4] = {64, kRows, 1, 1};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type = std::is_same_v<Element, __nv_bfloat16> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
                                                                          : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return encode(map, type, 4, const_cast<void*>(base), dims, byte_strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// Whether kKernel has sm_90a machine code in this build (a build for 80 only has none; PTX JIT would
// not give the arch-specific wgmma / setmaxnreg code). Asked once per kernel.
template <auto kKernel>
bool has_sm90_code() {
  static const bool has_code = [] {
    cudaFuncAttributes attributes{};
    return cudaFuncGetAttributes(&attributes, kKernel) == cudaSuccess && attributes.binaryVersion == 90;
  }();
  return has_code;
}

// The three instantiations of an sm90 kernel (plain; score modifiers; dropout, with score modifiers compiled
// in) and the one a call takes.
template <auto Plain, auto ScoreMods, auto Dropout>
struct Sm90Variants {
  static constexpr auto kPlain = Plain;
  static constexpr auto kScoreMods = ScoreMods;
  static constexpr auto kDropout = Dropout;
  static auto for_call(const FwdParams& params) {
    return params.has_dropout() ? kDropout : params.has_score_mods() ? kScoreMods : kPlain;
  }
  static bool has_code(const FwdParams& params) {
    return params.has_dropout()      ? has_sm90_code<Dropout>()
           : params.has_score_mods() ? has_sm90_code<ScoreMods>()
                                     : has_sm90_code<Plain>();
  }
};

// Whether the current device is compute capability 9.0 (the sm_90a code runs nowhere else).
inline bool device_is_sm90() {
  const DeviceInfo& device = current_device_info();
  return device.major == 9 && device.minor == 0;
}

}  // namespace flash_ext::sm90
