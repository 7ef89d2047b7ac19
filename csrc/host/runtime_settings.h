// Process-wide switches of the CUDA path, read from the environment once when the library loads and
// settable at run time (torch.ops.flash_ext.set_sm90_enabled / set_poison_scratch, wrapped by
// flash_ext.testing): the hot path never calls getenv.
//   FLASH_EXT_DISABLE_SM90=1          every call takes the sm80 kernels, also on Hopper (to compare the two
//                                     families, or to test the sm80 kernels on an H100/H200)
//   FLASH_EXT_DEBUG_POISON_SCRATCH=1  the backward's fp32 dQ accumulator is filled with NaN before use, so
//                                     that a row the preprocess kernel fails to zero shows in dq (tests)
#pragma once

#include <atomic>

namespace flash_ext {

struct RuntimeSettings {
  std::atomic<bool> sm90_enabled;
  std::atomic<bool> poison_scratch;
};

// The settings, initialised from the environment when the library loads.
RuntimeSettings& runtime_settings();

}  // namespace flash_ext
