#include "rng.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/empty.h>

#include <mutex>

#ifdef FLASH_EXT_WITH_CUDA
// ATen/cuda/CUDAGeneratorImpl.h (the CUDA Philox generator) does not pull in the cuSPARSE / cuBLAS headers
// that ATen/cuda/CUDAContext.h would, which a plain CUDA toolkit install may lack.
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

#include "../error_message.h"

namespace flash_ext {

RngState draw_cpu_rng_state() {
  auto* generator =
      at::get_generator_or_default<at::CPUGeneratorImpl>(std::nullopt, at::detail::getDefaultCPUGenerator());
  std::lock_guard<std::mutex> lock(generator->mutex_);
  // The CPU generator (mt19937) has no Philox offset of its own: a fresh seed per call, offset 0.
  return {generator->random64(), 0};
}

at::Tensor rng_state_tensor(const RngState& rng, const at::Tensor& q) {
  at::Tensor state = at::empty({2}, q.options().dtype(at::kLong));
  state.data_ptr<int64_t>()[0] = static_cast<int64_t>(rng.seed);  // the seed's 64 bits reinterpreted
  state.data_ptr<int64_t>()[1] = static_cast<int64_t>(rng.offset);
  return state;
}

namespace {

void check_rng_state(const at::Tensor& rng_state) {
  FLASH_EXT_CHECK(rng_state.scalar_type() == at::kLong && rng_state.numel() == 2,
                  "flash_ext: rng_state must be int64 [seed, offset] (2 elements), got ", rng_state.scalar_type(),
                  " of shape ", rng_state.sizes());
}

const at::Tensor& required_rng_state(const std::optional<at::Tensor>& rng_state) {
  FLASH_EXT_CHECK(rng_state.has_value(),
                  "flash_ext: the backward with dropout_p > 0 needs rng_state, the forward's third output");
  check_rng_state(*rng_state);
  return *rng_state;
}

}  // namespace

RngState rng_state_values(const at::Tensor& rng_state) {
  check_rng_state(rng_state);
  const at::Tensor state = rng_state.cpu().contiguous();
  return {static_cast<uint64_t>(state.data_ptr<int64_t>()[0]), static_cast<uint64_t>(state.data_ptr<int64_t>()[1])};
}

RngState read_rng_state(const std::optional<at::Tensor>& rng_state, double dropout_p) {
  if (dropout_p == 0) return {};
  return rng_state_values(required_rng_state(rng_state));
}

#ifdef FLASH_EXT_WITH_CUDA
void set_cuda_dropout_state(FwdParams& p, at::Tensor& rng_state) {
  auto* generator = at::get_generator_or_default<at::CUDAGeneratorImpl>(std::nullopt,
                                                                       at::cuda::detail::getDefaultCUDAGenerator());
  // philox_cuda_state reserves `increment` offsets per call, a multiple of 4 as the generator requires.
  const uint64_t increment = (static_cast<uint64_t>(p.batch) * p.heads_q + 3) / 4 * 4;
  at::PhiloxCudaState state;
  {
    std::lock_guard<std::mutex> lock(generator->mutex_);
    state = generator->philox_cuda_state(increment);
  }
  if (state.captured_) {
    p.philox_seed_ptr = state.seed_.ptr;
    p.philox_offset_ptr = state.offset_.ptr;
    p.philox_offset_intragraph = state.offset_intragraph_;
  } else {
    p.philox_seed = state.seed_.val;
    p.philox_offset = state.offset_.val;
  }
  p.rng_state_out = rng_state.data_ptr<int64_t>();
}

void set_cuda_dropout_state_from(BwdParams& p, const std::optional<at::Tensor>& rng_state, const at::Tensor& q,
                                 at::Tensor& on_device) {
  on_device = required_rng_state(rng_state).to(q.device()).contiguous();
  p.philox_seed_ptr = on_device.data_ptr<int64_t>();
  p.philox_offset_ptr = p.philox_seed_ptr + 1;
  p.philox_offset_intragraph = 0;
}
#endif

}  // namespace flash_ext
