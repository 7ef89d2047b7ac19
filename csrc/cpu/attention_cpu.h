// The tiled CPU implementation: the executable specification that the GPU kernels are held to.
// Same algorithm (online softmax forward, recompute backward), same params.
#pragma once

#include <cstdint>

#include "../params.h"

namespace flash_ext::cpu {

// Writes p.out and p.lse. Rows that see no key get out = 0 and lse = -inf.
void attention_fwd(const FwdParams& p);

// Writes p.dq, p.dk, p.dv (input dtype). Reads q, k, v, out, lse, dout.
// Computes D = rowsum(dout * out) itself; p.softmax_d is not used.
void attention_bwd(const BwdParams& p);

// Dropout keep flags (1 = kept) of query `row` of stream `batch_head` (batch * heads_q + head)
// for key columns [col_begin, col_end), written to keep[0 .. col_end - col_begin). The mapping is
// common/philox.h's.
void fill_dropout_keep_flags(uint64_t seed, uint64_t offset, uint32_t drop_threshold, uint64_t batch_head,
                             int64_t row, int64_t col_begin, int64_t col_end, uint8_t* keep);

// The whole (batch, heads, seqlen_q, seqlen_k) keep mask, contiguous, for tests
// (flash_ext.testing.dropout_keep_mask). For a variable-length batch, sequence b's mask is the
// top-left (len_q, len_k) corner of mask[b].
void dropout_keep_mask(uint64_t seed, uint64_t offset, uint32_t drop_threshold, int64_t batch, int64_t heads,
                       int64_t seqlen_q, int64_t seqlen_k, uint8_t* mask);

}  // namespace flash_ext::cpu
