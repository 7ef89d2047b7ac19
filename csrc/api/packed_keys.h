// Keys and values stored other than as a packed variable-length batch (pages read through a block table,
// rows of a dense cache, or spans of a packed batch of which each sequence uses a prefix), and their gather
// into a packed batch for the varlen forward. Torch ops on the storage's device only: no index value is read
// on the host (no device-to-host sync, so a CUDA call stays graph-capturable). The one gather of the CUDA
// kvcache_fwd fallback (ops_kvcache_cuda.cpp) and of varlen_paged_fwd on both devices.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <utility>

#include "options.h"

namespace flash_ext {

// Where each sequence's keys are in a storage tensor: pages (num_blocks, page_size, heads, head_dim) through
// block_table, or rows (rows, seqlen, heads, head_dim), one per sequence. int64 tensors on the storage's device.
struct KeyStorage {
  at::Tensor block_table;  // (batch, max_blocks); paged when defined
  at::Tensor rows;         // (batch,): the row of each sequence, when not paged
  int64_t page_size = 0;   // the storage's size(1), when paged
};

// The storage indices of positions `pos` of sequences `seq` (int64 tensors of one shape): (page, slot) when
// paged, (row, position) otherwise.
std::pair<at::Tensor, at::Tensor> locate(const KeyStorage& storage, const at::Tensor& seq, const at::Tensor& pos);

struct PackedKeys {
  at::Tensor k, v;          // (rows, heads, head_dim)
  at::Tensor cu_seqlens_k;  // int32 (batch + 1,): 0, then the running sums of the lengths
};

// Sequence b's keys are positions start[b] .. start[b] + length[b] - 1 of its storage (start, length: int64
// (batch,) on the storage's device), packed one sequence after another into `rows` rows: at least the sum of
// the lengths (a caller that cannot read the lengths sizes it by a bound). Rows past the last sequence's end
// are zero, never a stale page: a kernel may read a whole tile past a sequence's end (the sm90 forward's TMA
// does, masking the scores), and 0 · NaN would still be NaN.
PackedKeys pack_keys(const at::Tensor& k_storage, const at::Tensor& v_storage, const KeyStorage& storage,
                     const at::Tensor& start, const at::Tensor& length, int64_t rows);

// The keys of a varlen_paged_fwd call (PagedArgs), packed: pages of the pools k, v through block_table, or
// spans cu_seqlens_k[b] .. of the packed k, v; each sequence's first seqused_k[b] keys when seqused_k is given,
// else its cu_seqlens_k[b + 1] - cu_seqlens_k[b]. exact: exactly the used keys, their count read on the host
// (host tensors, whose values the caller checked). Otherwise no value is read on the host: each count is
// clamped to max_seqlen_k and to what the sequence's storage holds (max_blocks * page_size, or its span of k),
// which in-contract counts already are, and the batch has batch * that bound rows (at most total_k without
// block_table); an out-of-contract count then gives wrong output (as a wrong cu_seqlens does), and the packed
// batch is never shorter than its cu_seqlens_k says (without block_table: given a valid cu_seqlens_k).
PackedKeys pack_varlen_keys(const at::Tensor& k, const at::Tensor& v, const VarlenArgs& varlen,
                            const PagedArgs& paged, bool exact);

// Each sequence's key count as pack_varlen_keys(exact=false) takes it (clamped on the device), int32: for
// a forward that reads the pages in place instead.
at::Tensor varlen_key_counts(const at::Tensor& k, const VarlenArgs& varlen, const PagedArgs& paged);

// The rows of the packed batch of pack_varlen_keys(exact=false): batch * min(max_seqlen_k, max_blocks *
// page_size) with block_table, min(total_k, batch * max_seqlen_k) without.
int64_t varlen_keys_bound(const at::Tensor& k, const VarlenArgs& varlen, const PagedArgs& paged);

}  // namespace flash_ext
