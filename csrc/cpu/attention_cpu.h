// The tiled CPU implementation: the executable specification that the GPU kernels are
// held to. Same algorithm (online softmax forward, recompute backward), same params.
#pragma once

#include "../params.h"

namespace flash_ext::cpu {

// Writes p.out and p.lse. Rows that see no key get out = 0 and lse = -inf.
void attention_fwd(const FwdParams& p);

// Writes p.dq, p.dk, p.dv (input dtype). Reads q, k, v, out, lse, dout.
// Computes D = rowsum(dout * out) itself; p.softmax_d is not used.
void attention_bwd(const BwdParams& p);

}  // namespace flash_ext::cpu
