// The CPU forward (attention_fwd in attention_cpu.h), the algorithm of the kernels on tiles (tiles.h): per
// query block, one sweep over the key blocks with an online softmax (running row max and row sum, base-2
// exponentials); the output is normalised once at the end.

#include "attention_cpu.h"
#include "tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace flash_ext::cpu {
namespace {

constexpr float kLn2 = 0.6931471805599453f;

// ---- Forward --------------------------------------------------------------------------------

// Folds one tile of a query row's scores into the row's running softmax state.
//   scores   in: scores in log2 units, -inf where masked; out: exp2(score - row_max), the
//            unnormalised probabilities the caller adds into acc_o.
//   row_max  running max of the row's scores; row_sum: running sum of exp2(score - row_max).
// Returns the factor exp2(old row_max - new row_max) by which the caller must rescale acc_o,
// which so far is relative to the old max.
float online_softmax_update(float* scores, int cols, float& row_max, float& row_sum) {
  float tile_max = kNegInf;
  for (int c = 0; c < cols; ++c) tile_max = std::max(tile_max, scores[c]);
  const float new_max = std::max(row_max, tile_max);
  // While every score the row has seen is masked, new_max is -inf and exp2(score - new_max) would
  // be exp2(-inf + inf) = NaN. Subtracting 0 instead gives exp2(-inf) = 0: the row keeps an
  // empty sum and a zero accumulator until it meets a visible key.
  const float base = new_max == kNegInf ? 0.f : new_max;
  const float rescale = std::exp2(row_max - base);
  float tile_sum = 0.f;
  for (int c = 0; c < cols; ++c) {
    scores[c] = std::exp2(scores[c] - base);
    tile_sum += scores[c];
  }
  row_max = new_max;
  row_sum = row_sum * rescale + tile_sum;
  return rescale;
}

template <typename T>
void attention_fwd_impl(const FwdParams& p) {
  const int head_dim = p.head_dim;
  // p.seqlen_q is the longest sequence's length: tasks past a shorter sequence's end do nothing.
  const int64_t q_blocks = num_blocks(p.seqlen_q, kBlockM);
  const int64_t num_tasks = static_cast<int64_t>(p.batch) * p.heads_q * q_blocks;

  at::parallel_for(0, num_tasks, 1, [&](int64_t task_begin, int64_t task_end) {
    // Per-thread tiles, reused by every task of this chunk.
    std::vector<float> q_tile(kBlockM * head_dim), k_tile(kBlockN * head_dim), v_tile(kBlockN * head_dim);
    std::vector<float> acc_o(kBlockM * head_dim);  // unnormalised output, relative to row_max
    std::vector<float> row_max(kBlockM), row_sum(kBlockM);
    std::vector<float> scores(kBlockN);  // one row of S at a time
    std::vector<uint8_t> keep(kBlockN);  // dropout keep flags of one row of S

    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t q_block = task % q_blocks;
      const int64_t h = task / q_blocks % p.heads_q;
      const Sequence seq = sequence_at(p, task / q_blocks / p.heads_q);
      if (q_block * kBlockM >= seq.q.length) continue;
      const int64_t h_kv = h / p.heads_per_kv();
      const auto q = head_rows(static_cast<const T*>(p.q), p.q_strides, seq.b, h, seq.q);
      const auto k = head_rows(static_cast<const T*>(p.k), p.k_strides, seq.b, h_kv, seq.k);
      const auto v = head_rows(static_cast<const T*>(p.v), p.v_strides, seq.b, h_kv, seq.k);
      const auto out = head_rows(static_cast<T*>(p.out), p.out_strides, seq.b, h, seq.q);
      float* lse = p.lse + p.lse_index(seq.b, h, 0);
      const ScoreFn score(p, seq, h);
      const Dropout dropout(p, seq, h);

      const Block queries = block_at(q_block, kBlockM, seq.q.length);
      load_tile(q, queries, head_dim, q_tile.data());
      std::fill(acc_o.begin(), acc_o.end(), 0.f);
      std::fill(row_max.begin(), row_max.end(), kNegInf);
      std::fill(row_sum.begin(), row_sum.end(), 0.f);

      const IndexRange k_blocks = key_blocks_seen_by(p, seq, queries);
      for (int64_t k_block = k_blocks.begin; k_block < k_blocks.end; ++k_block) {
        const Block keys = block_at(k_block, kBlockN, seq.k.length);
        load_tile(k, keys, head_dim, k_tile.data());
        load_tile(v, keys, head_dim, v_tile.data());

        for (int r = 0; r < queries.size; ++r) {
          const int64_t row = queries.begin + r;
          const float* q_row = &q_tile[r * head_dim];
          float* o_row = &acc_o[r * head_dim];
          const IndexRange cols = visible_columns(p, seq, row, keys);
          std::fill(scores.begin(), scores.begin() + keys.size, kNegInf);
          for (int64_t c = cols.begin; c < cols.end; ++c) {
            scores[c] = score(dot(q_row, &k_tile[c * head_dim], head_dim), row, keys.begin + c).log2;
          }

          // The softmax statistics (row_max, row_sum, hence lse) are of the undropped
          // probabilities; dropout only removes terms from the weighted sum of V.
          const float rescale = online_softmax_update(scores.data(), keys.size, row_max[r], row_sum[r]);
          for (int d = 0; d < head_dim; ++d) o_row[d] *= rescale;
          if (dropout.enabled() && !cols.empty()) {
            dropout.keep_flags(row, {keys.begin + cols.begin, keys.begin + cols.end}, keep.data());
          }
          for (int64_t c = cols.begin; c < cols.end; ++c) {
            if (dropout.enabled() && !keep[c - cols.begin]) continue;
            axpy(scores[c], &v_tile[c * head_dim], o_row, head_dim);
          }
        }
      }

      for (int r = 0; r < queries.size; ++r) {
        // row_sum >= 1 for a row that saw a key (its max term is exp2(0)); 0 for one that saw none;
        // NaN for a row with a NaN score, which then propagates to its output and lse.
        const bool saw_keys = row_sum[r] != 0.f;
        // Kept probabilities are scaled by 1 / (1 - dropout_p) (p.dropout_scale is 1 without dropout).
        const float out_scale = saw_keys ? p.dropout_scale / row_sum[r] : 0.f;
        float* o_row = &acc_o[r * head_dim];
        for (int d = 0; d < head_dim; ++d) o_row[d] *= out_scale;
        // Natural-log lse: log(sum exp(s)) = row_max * ln2 + log(row_sum), with row_max in log2 units.
        lse[queries.begin + r] = saw_keys ? row_max[r] * kLn2 + std::log(row_sum[r]) : kNegInf;
      }
      store_tile(acc_o.data(), 1.f, head_dim, queries, out);
    }
  });
}

}  // namespace

void attention_fwd(const FwdParams& p) {
  if (p.batch == 0 || p.heads_q == 0) return;  // nothing to do; heads_per_kv() would divide by 0
  dispatch_dtype(p.dtype, [&](auto element) { attention_fwd_impl<decltype(element)>(p); });
}

}  // namespace flash_ext::cpu
