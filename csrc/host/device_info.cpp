#include "device_info.h"

#include <cuda_runtime_api.h>

#include <mutex>
#include <stdexcept>
#include <string>

namespace flash_ext {
namespace {

constexpr int kMaxDevices = 64;

void check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string("flash_ext: ") + what + ": " + cudaGetErrorString(status));
  }
}

DeviceInfo query(int device) {
  DeviceInfo info;
  const auto get = [&](int* value, cudaDeviceAttr attribute) {
    check(cudaDeviceGetAttribute(value, attribute, device), "querying a device attribute");
  };
  get(&info.major, cudaDevAttrComputeCapabilityMajor);
  get(&info.minor, cudaDevAttrComputeCapabilityMinor);
  get(&info.num_sms, cudaDevAttrMultiProcessorCount);
  get(&info.smem_per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor);
  get(&info.smem_per_block_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin);
  return info;
}

}  // namespace

int current_device() {
  int device = 0;
  check(cudaGetDevice(&device), "querying the current device");
  return device;
}

const DeviceInfo& device_info(int device) {
  static DeviceInfo infos[kMaxDevices];
  static std::once_flag once[kMaxDevices];
  if (device < 0 || device >= kMaxDevices) {
    throw std::runtime_error("flash_ext: device index " + std::to_string(device) + " is out of range");
  }
  std::call_once(once[device], [&] { infos[device] = query(device); });
  return infos[device];
}

}  // namespace flash_ext
