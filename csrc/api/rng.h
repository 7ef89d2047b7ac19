// The dropout mask's Philox seed and offset: drawn once per forward call from torch's generator of the
// device (so torch.manual_seed reproduces a run), returned as the forward's rng_state output (int64
// [seed, offset], zeros without dropout), and handed back to the backward, which regenerates the mask.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "../params.h"

namespace flash_ext {

struct RngState {
  uint64_t seed = 0;
  uint64_t offset = 0;
};

// A fresh (seed, offset) from the CPU's default generator.
RngState draw_cpu_rng_state();

// rng_state, the forward's third output, on q's device (a host tensor: the CPU path).
at::Tensor rng_state_tensor(const RngState& rng, const at::Tensor& q);

// An rng_state tensor back to (seed, offset) (a device tensor is copied to the host).
RngState rng_state_values(const at::Tensor& rng_state);

// The backward's rng_state argument on the CPU path: required when dropout is on, ignored otherwise.
RngState read_rng_state(const std::optional<at::Tensor>& rng_state, double dropout_p);

#ifdef FLASH_EXT_WITH_CUDA
// The CUDA forward: seed and offset from torch's CUDA generator of the current device, reserving
// batch * heads_q Philox streams (common/philox.h's mapping). Under CUDA-graph capture the values live on the
// device (they change per replay): the kernels read them there. The forward kernel writes them to rng_state.
void set_cuda_dropout_state(FwdParams& p, at::Tensor& rng_state);

// The CUDA backward reads the forward's rng_state on the device (no device-to-host copy); `on_device`
// keeps the device copy alive for the launch.
void set_cuda_dropout_state_from(BwdParams& p, const std::optional<at::Tensor>& rng_state, const at::Tensor& q,
                                 at::Tensor& on_device);
#endif

}  // namespace flash_ext
