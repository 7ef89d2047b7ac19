// The CPU path: the tiled implementation of csrc/cpu/ (the executable specification) on host tensors,
// float32 as well as float16 / bfloat16.
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstdint>

#include "../common/philox.h"
#include "../cpu/attention_cpu.h"
#include "../error_message.h"
#include "checks.h"
#include "ops.h"
#include "packed_keys.h"
#include "params_from_tensors.h"
#include "rng.h"

namespace flash_ext {
namespace {

// lse: (batch, heads_q, seqlen_q) dense, (heads_q, total_q) varlen.
at::Tensor empty_lse(const at::Tensor& q, const VarlenArgs& varlen) {
  const auto options = q.options().dtype(at::kFloat);
  return varlen.is_varlen() ? at::empty({q.size(1), q.size(0)}, options)
                            : at::empty({q.size(0), q.size(2), q.size(1)}, options);
}

}  // namespace

FwdResult attention_fwd_cpu(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                            const AttentionOptions& options, const VarlenArgs& varlen) {
  if (varlen.is_varlen()) check_varlen_values_on_host(q_in, k_in, varlen);
  const at::Tensor q = usable_layout(q_in), k = usable_layout(k_in), v = usable_layout(v_in);
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = empty_lse(q, varlen);
  // Every call with dropout draws from the generator once, whatever the shapes.
  const RngState rng = options.dropout_p > 0 ? draw_cpu_rng_state() : RngState{};
  at::Tensor rng_state = rng_state_tensor(rng, q);
  if (out.numel() == 0) return {out, lse, rng_state};
  cpu::attention_fwd(make_fwd_params(q, k, v, out, lse, options, varlen, rng));
  return {out, lse, rng_state};
}

FwdResult varlen_paged_fwd_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const AttentionOptions& options, const VarlenArgs& varlen, const PagedArgs& paged) {
  check_varlen_paged_values_on_host(q, k, varlen, paged);
  const PackedKeys packed = pack_varlen_keys(k, v, varlen, paged, /*exact=*/true);
  return attention_fwd_cpu(q, packed.k, packed.v, options,
                           {varlen.cu_seqlens_q, packed.cu_seqlens_k, varlen.max_seqlen_q, varlen.max_seqlen_k});
}

BwdResult attention_bwd_cpu(const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
                            const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse,
                            const AttentionOptions& options, bool deterministic,
                            const std::optional<at::Tensor>& rng_state, const VarlenArgs& varlen) {
  if (varlen.is_varlen()) check_varlen_values_on_host(q_in, k_in, varlen);
  const RngState rng = read_rng_state(rng_state, options.dropout_p);
  const at::Tensor q = usable_layout(q_in), k = usable_layout(k_in), v = usable_layout(v_in);
  const at::Tensor dout = usable_layout(dout_in), out = usable_layout(out_in), lse_c = lse.contiguous();
  // Zeros, not empty: with seqlen_q == 0 (or seqlen_k == 0) the gradients are exactly zero.
  at::Tensor dq = at::zeros(q.sizes(), q.options());
  at::Tensor dk = at::zeros(k.sizes(), k.options());
  at::Tensor dv = at::zeros(v.sizes(), v.options());
  if (q.numel() == 0 || k.numel() == 0) return {dq, dk, dv};
  // The CPU backward is always deterministic (two passes, no shared accumulators).
  const FwdParams fwd = make_fwd_params(q, k, v, out, lse_c, options, varlen, rng);
  cpu::attention_bwd(make_bwd_params(fwd, dout, dq, dk, dv, deterministic));
  return {dq, dk, dv};
}

at::Tensor dropout_keep_mask_cpu(const at::Tensor& rng_state, int64_t batch, int64_t heads, int64_t seqlen_q,
                                 int64_t seqlen_k, double dropout_p) {
  FLASH_EXT_CHECK(batch >= 0 && heads >= 0 && seqlen_q >= 0 && seqlen_k >= 0,
                  "flash_ext: dropout_keep_mask sizes must be >= 0, got ", batch, ", ", heads, ", ", seqlen_q, ", ",
                  seqlen_k);
  FLASH_EXT_CHECK(dropout_p >= 0 && dropout_p < 1, "flash_ext: dropout_p must be in [0, 1), got ", dropout_p);
  const RngState rng = rng_state_values(rng_state);
  at::Tensor mask = at::empty({batch, heads, seqlen_q, seqlen_k}, rng_state.options().dtype(at::kBool));
  static_assert(sizeof(bool) == sizeof(uint8_t));
  cpu::dropout_keep_mask(rng.seed, rng.offset, dropout_drop_threshold(dropout_p), batch, heads, seqlen_q, seqlen_k,
                         reinterpret_cast<uint8_t*>(mask.data_ptr<bool>()));
  return mask;
}

}  // namespace flash_ext
