// The sm80 backward of attention on mma.sync (sm80 and newer), by recomputation: nothing of size
// seqlen_q x seqlen_k is stored; P is rebuilt from q, k and the forward's lse.
//
// With S = scale · Q·Kᵀ, P = softmax(S), O = P·V and D_i = rowsum(dO ∘ O)_i:
//   dV = Pᵀ·dO,  dP = dO·Vᵀ,  dS = P ∘ (dP − D),  dK = scale · dSᵀ·Q,  dQ = scale · dS·K.
//
// Launches (bwd_launch_template.cuh), each kernel in a header of its own:
//   1. preprocess (bwd_preprocess_kernel.cuh): D for every query row; it also zeroes the fp32 dQ
//      accumulator;
//   2. dK/dV (bwd_dkdv_kernel.cuh): a CTA per (key block, kv head) keeps K and V in shared memory, walks
//      every query block (and every query head of its GQA group) that can see them, and accumulates dK
//      and dV in registers. Per query block it computes the transposed tiles Sᵀ = K·Qᵀ and
//      dPᵀ = V·dOᵀ, puts Pᵀ and dSᵀ in shared memory, and from there dV += Pᵀ·dO, dK += dSᵀ·Q
//      and, with deterministic = false, dQ += dS·K, added into an fp32 buffer with atomics
//      (FlashAttention-2's 5 GEMMs; warp tiles in bwd_tile_config.h); the split tail walks' dK / dV
//      are rounded by a conversion kernel (bwd_convert_kernels.cuh);
//   3. deterministic = false: dQ = scale · buffer, rounded (the dQ conversion kernel,
//      bwd_convert_kernels.cuh);
//      deterministic = true: a dQ kernel per query block (bwd_dq_kernel.cuh) recomputes S and dP against
//      the key blocks it sees and accumulates dQ in registers: 7 GEMMs instead of 5, no atomics, so the
//      gradients are bit-reproducible.
// This header holds what more than one of those kernels uses.
#pragma once

namespace flash_ext::sm80 {

constexpr float kLog2e = 1.4426950408889634f;

}  // namespace flash_ext::sm80
