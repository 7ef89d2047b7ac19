#include "packed_keys.h"

#include <ATen/TensorIndexing.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/floor_divide.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/logical_not.h>
#include <ATen/ops/minimum.h>
#include <ATen/ops/remainder.h>
#include <ATen/ops/searchsorted.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>

#include <algorithm>

namespace flash_ext {

std::pair<at::Tensor, at::Tensor> locate(const KeyStorage& storage, const at::Tensor& seq, const at::Tensor& pos) {
  if (storage.block_table.defined()) {
    return {storage.block_table.index({seq, at::floor_divide(pos, storage.page_size)}),
            at::remainder(pos, storage.page_size)};
  }
  return {storage.rows.index({seq}), pos};
}

namespace {

// storage[first[i], second[i]] for each i: (n, heads, head_dim). A contiguous storage is gathered as rows of a
// (pages * page_size, heads * head_dim) view by index_select, a row copy per index; two-tensor advanced indexing
// (the general case) moves each element on its own.
at::Tensor gather(const at::Tensor& storage, const at::Tensor& first, const at::Tensor& second) {
  if (!storage.is_contiguous()) return storage.index({first, second});
  const int64_t heads = storage.size(2), head_dim = storage.size(3);
  return storage.view({-1, heads * head_dim})
      .index_select(0, first * storage.size(1) + second)
      .view({first.size(0), heads, head_dim});
}

}  // namespace

PackedKeys pack_keys(const at::Tensor& k_storage, const at::Tensor& v_storage, const KeyStorage& storage,
                     const at::Tensor& start, const at::Tensor& length, int64_t rows) {
  const int64_t batch = length.size(0);
  const auto longs = length.options().dtype(at::kLong);
  const at::Tensor cu_seqlens_k = at::cat({at::zeros({1}, longs), at::cumsum(length, 0)});
  // An empty storage holds no key to read (a sequence that claims some is the caller's error).
  if (batch == 0 || k_storage.size(0) == 0 || k_storage.size(1) == 0) rows = 0;
  if (rows == 0) {
    const auto empty = [&](const at::Tensor& s) { return at::empty({0, s.size(-2), s.size(-1)}, s.options()); };
    return {empty(k_storage), empty(v_storage), cu_seqlens_k.to(at::kInt)};
  }
  // Row p is key p - cu_seqlens_k[b] of the sequence b whose span holds p; rows past the last sequence's end
  // read storage[0][0] (a valid address whatever the index values), then are zeroed.
  const at::Tensor packed = at::arange(rows, longs);
  const at::Tensor sequence =
      at::clamp(at::searchsorted(cu_seqlens_k.narrow(0, 1, batch), packed, /*out_int32=*/false, /*right=*/true), 0,
                batch - 1);
  const at::Tensor valid = packed < cu_seqlens_k.narrow(0, batch, 1);
  const at::Tensor position = at::where(valid, start.index({sequence}) + packed - cu_seqlens_k.index({sequence}), 0);
  auto [first, second] = locate(storage, sequence, position);
  first = at::where(valid, first, 0);
  second = at::where(valid, second, 0);
  const at::Tensor past_end = at::logical_not(valid).view({rows, 1, 1});
  at::Tensor k_packed = gather(k_storage, first, second), v_packed = gather(v_storage, first, second);
  k_packed.masked_fill_(past_end, 0);
  v_packed.masked_fill_(past_end, 0);
  return {k_packed, v_packed, cu_seqlens_k.to(at::kInt)};
}

// The most keys one sequence may use: max_seqlen_k, and with block_table what a row of it holds.
static int64_t keys_per_sequence_bound(const at::Tensor& k, const VarlenArgs& varlen, const PagedArgs& paged) {
  if (!paged.block_table.has_value()) return varlen.max_seqlen_k;
  return std::min(varlen.max_seqlen_k, paged.block_table->size(1) * k.size(1));
}

int64_t varlen_keys_bound(const at::Tensor& k, const VarlenArgs& varlen, const PagedArgs& paged) {
  const int64_t batch = varlen.cu_seqlens_k->size(0) - 1;
  const int64_t rows = batch * keys_per_sequence_bound(k, varlen, paged);
  return paged.block_table.has_value() ? rows : std::min(rows, k.size(0));
}

// Each sequence's key count (int64): seqused_k[b], or its span of cu_seqlens_k; `clamped` as pack_varlen_keys
// describes.
static at::Tensor key_counts(const at::Tensor& k, const VarlenArgs& varlen, const PagedArgs& paged, bool clamped) {
  const int64_t batch = varlen.cu_seqlens_k->size(0) - 1;
  const at::Tensor cu = varlen.cu_seqlens_k->to(at::kLong);
  const at::Tensor spans = cu.narrow(0, 1, batch) - cu.narrow(0, 0, batch);
  at::Tensor length = paged.seqused_k.has_value() ? paged.seqused_k->to(at::kLong) : spans;
  if (!clamped) return length;
  if (!paged.block_table.has_value() && paged.seqused_k.has_value()) length = at::minimum(length, spans);
  return at::clamp(length, 0, keys_per_sequence_bound(k, varlen, paged));
}

at::Tensor varlen_key_counts(const at::Tensor& k, const VarlenArgs& varlen, const PagedArgs& paged) {
  return key_counts(k, varlen, paged, /*clamped=*/true).to(at::kInt);
}

PackedKeys pack_varlen_keys(const at::Tensor& k, const at::Tensor& v, const VarlenArgs& varlen,
                            const PagedArgs& paged, bool exact) {
  const int64_t batch = varlen.cu_seqlens_k->size(0) - 1;
  const at::Tensor cu = varlen.cu_seqlens_k->to(at::kLong);
  const at::Tensor length = key_counts(k, varlen, paged, /*clamped=*/!exact);
  const int64_t rows = exact ? length.sum().item<int64_t>() : varlen_keys_bound(k, varlen, paged);
  if (paged.block_table.has_value()) {
    const KeyStorage storage{paged.block_table->to(at::kLong), at::Tensor(), k.size(1)};
    return pack_keys(k, v, storage, at::zeros({batch}, cu.options()), length, rows);
  }
  // A packed k is one storage row (1, total_k, heads, head_dim), sequence b's keys starting at cu_seqlens_k[b].
  const KeyStorage storage{at::Tensor(), at::zeros({batch}, cu.options()), 0};
  return pack_keys(k.unsqueeze(0), v.unsqueeze(0), storage, cu.narrow(0, 0, batch), length, rows);
}

}  // namespace flash_ext
