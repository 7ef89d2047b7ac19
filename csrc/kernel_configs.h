// The one list of the CUDA kernels' instantiations: which head dims each kernel family is compiled
// for. scripts/generate_instantiations.py reads these lines to write csrc/instantiations/, dispatch.cpp
// expands them into its switches, and flash_ext.kernel_path asks dispatch.cpp. Adding a head dim here
// (then rerunning the generator) is the whole change outside the tile configs.
//
// Each list is an X-macro: FLASH_EXT_..._HEAD_DIMS(X) expands to X(32) X(64) ...
#pragma once

// The sm80 (mma.sync) kernels, forward and backward: every multiple of 32 up to 256; other head dims
// are zero-padded up to the next of these.
#define FLASH_EXT_SM80_HEAD_DIMS(X) X(32) X(64) X(96) X(128) X(160) X(192) X(224) X(256)
// The sm90 (wgmma + TMA) forward kernel's head dims; others take the sm80 forward on Hopper too.
#define FLASH_EXT_SM90_FWD_HEAD_DIMS(X) X(64) X(128) X(256)
// The sm90 dK/dV kernel's head dims (the backward's preprocess and dQ steps are the sm80 ones).
#define FLASH_EXT_SM90_BWD_HEAD_DIMS(X) X(64) X(128) X(256)
// The decode kernel's head dims (flash_ext.attention_with_kvcache on CUDA); others take the varlen kernels.
#define FLASH_EXT_DECODE_HEAD_DIMS(X) X(64) X(128) X(256)

namespace flash_ext {

// The 16-bit element types the CUDA kernels are compiled for.
enum class Elem16 { kFloat16, kBFloat16 };

namespace kernel_configs {

#define FLASH_EXT_HEAD_DIM_MATCHES(d) || head_dim == d
constexpr bool sm80_has(int head_dim) { return false FLASH_EXT_SM80_HEAD_DIMS(FLASH_EXT_HEAD_DIM_MATCHES); }
constexpr bool sm90_has_fwd(int head_dim) { return false FLASH_EXT_SM90_FWD_HEAD_DIMS(FLASH_EXT_HEAD_DIM_MATCHES); }
constexpr bool sm90_has_bwd(int head_dim) { return false FLASH_EXT_SM90_BWD_HEAD_DIMS(FLASH_EXT_HEAD_DIM_MATCHES); }
constexpr bool decode_has(int head_dim) { return false FLASH_EXT_DECODE_HEAD_DIMS(FLASH_EXT_HEAD_DIM_MATCHES); }
#undef FLASH_EXT_HEAD_DIM_MATCHES

// The head dim the CUDA kernels run a call of `head_dim` at (the smallest sm80 head dim >= it), or 0
// when there is none. Zero columns add nothing to q·k; the padded output columns are sliced off.
constexpr int padded_head_dim(int head_dim) {
  int padded = 0;
#define FLASH_EXT_FIRST_AT_LEAST(d) padded = (padded == 0 && head_dim <= d) ? d : padded;
  FLASH_EXT_SM80_HEAD_DIMS(FLASH_EXT_FIRST_AT_LEAST)
#undef FLASH_EXT_FIRST_AT_LEAST
  return padded;
}

static_assert(padded_head_dim(1) == 32 && padded_head_dim(59) == 64 && padded_head_dim(256) == 256 &&
              padded_head_dim(257) == 0);

}  // namespace kernel_configs
}  // namespace flash_ext
