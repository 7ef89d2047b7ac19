// What the launchers need to know of a CUDA device, queried once per device and cached: the hot path
// makes no attribute queries.
#pragma once

namespace flash_ext {

struct DeviceInfo {
  int major = 0;                // compute capability
  int minor = 0;
  int num_sms = 0;
  int smem_per_sm = 0;          // bytes of shared memory per SM
  int smem_per_block_optin = 0;  // the most one CTA may opt in to
};

// The current device (cudaGetDevice) and its facts. Throws std::runtime_error on a CUDA error.
int current_device();
const DeviceInfo& device_info(int device);
inline const DeviceInfo& current_device_info() { return device_info(current_device()); }

}  // namespace flash_ext
