// The CPU backward (attention_bwd in attention_cpu.h), the algorithm of the kernels on tiles (tiles.h): it
// recomputes the probabilities P from the saved lse instead of storing them, in two passes so that every
// output row has exactly one writer (race-free, deterministic, no atomics): pass 1 owns the dK/dV rows of a
// key block, pass 2 the dQ rows of a query block. The price is computing Q.K^T and dO.V^T twice.

#include "attention_cpu.h"
#include "tiles.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace flash_ext::cpu {
namespace {

// ---- Backward -------------------------------------------------------------------------------

// The query blocks with a row that sees some key of `keys`; the others are skipped.
IndexRange query_blocks_seeing(const FwdParams& p, const Sequence& seq, Block keys) {
  const IndexRange rows = p.rows_seeing(keys.begin, keys.begin + keys.size, seq.q.length, seq.k.length);
  if (rows.empty()) return {0, 0};
  return {rows.begin / kBlockM, num_blocks(rows.end, kBlockM)};
}

// Float copies of one block of query rows of one head, with the per-row values the backward
// needs. Buffers are sized for a full block and reused from task to task.
struct QueryTile {
  explicit QueryTile(int head_dim)
      : q(kBlockM * head_dim), dout(kBlockM * head_dim), lse_log2(kBlockM), softmax_d(kBlockM) {}
  Block rows{0, 0};
  std::vector<float> q, dout;   // rows.size x head_dim
  std::vector<float> lse_log2;  // lse * log2(e); -inf for rows that saw no key in the forward
  std::vector<float> softmax_d; // D = rowsum(dout * out)
};

// Float copies of one block of key rows of one kv head.
struct KeyTile {
  explicit KeyTile(int head_dim) : k(kBlockN * head_dim), v(kBlockN * head_dim) {}
  Block rows{0, 0};
  std::vector<float> k, v;  // rows.size x head_dim
};

// Number of elements of the lse (and D) array: (batch, heads_q, seqlen_q) dense,
// (heads_q, total_q) varlen, where lse_head_stride is total_q.
int64_t lse_elements(const FwdParams& p) {
  return p.is_varlen() ? p.heads_q * p.lse_head_stride : p.batch * p.lse_batch_stride;
}

// D_i = sum_d dout[i, d] * out[i, d] for every query row, laid out like lse. It is the
// softmax-Jacobian term of dS = P * (dP - D), needed by both passes, and only O(seqlen) in size.
// With dropout it still holds: out = (P * Z) V with Z the scaled keep mask, so
// sum_j P_ij * (Z_ij * dout_i . v_j) = dout_i . out_i.
template <typename T>
std::vector<float> compute_softmax_d(const BwdParams& p) {
  std::vector<float> softmax_d(static_cast<size_t>(lse_elements(p)));
  const int64_t num_heads = static_cast<int64_t>(p.batch) * p.heads_q;
  at::parallel_for(0, num_heads, 1, [&](int64_t bh_begin, int64_t bh_end) {
    for (int64_t bh = bh_begin; bh < bh_end; ++bh) {
      const Sequence seq = sequence_at(p, bh / p.heads_q);
      const int64_t h = bh % p.heads_q;
      const auto dout = head_rows(static_cast<const T*>(p.dout), p.dout_strides, seq.b, h, seq.q);
      const auto out = head_rows(static_cast<const T*>(p.out), p.out_strides, seq.b, h, seq.q);
      for (int64_t i = 0; i < seq.q.length; ++i) {
        const T* dout_row = dout.row(i);
        const T* out_row = out.row(i);
        float sum = 0.f;
        for (int d = 0; d < p.head_dim; ++d) {
          sum += static_cast<float>(dout_row[d]) * static_cast<float>(out_row[d]);
        }
        softmax_d[p.lse_index(seq.b, h, i)] = sum;
      }
    }
  });
  return softmax_d;
}

template <typename T>
void load_query_tile(const BwdParams& p, const Sequence& seq, int64_t h, int64_t q_block,
                     const std::vector<float>& softmax_d, QueryTile& tile) {
  tile.rows = block_at(q_block, kBlockM, seq.q.length);
  const auto q = head_rows(static_cast<const T*>(p.q), p.q_strides, seq.b, h, seq.q);
  const auto dout = head_rows(static_cast<const T*>(p.dout), p.dout_strides, seq.b, h, seq.q);
  load_tile(q, tile.rows, p.head_dim, tile.q.data());
  load_tile(dout, tile.rows, p.head_dim, tile.dout.data());
  for (int r = 0; r < tile.rows.size; ++r) {
    const int64_t idx = p.lse_index(seq.b, h, tile.rows.begin + r);
    tile.lse_log2[r] = p.lse[idx] * kLog2e;
    tile.softmax_d[r] = softmax_d[idx];
  }
}

template <typename T>
void load_key_tile(const BwdParams& p, const Sequence& seq, int64_t h_kv, int64_t k_block, KeyTile& tile) {
  tile.rows = block_at(k_block, kBlockN, seq.k.length);
  const auto k = head_rows(static_cast<const T*>(p.k), p.k_strides, seq.b, h_kv, seq.k);
  const auto v = head_rows(static_cast<const T*>(p.v), p.v_strides, seq.b, h_kv, seq.k);
  load_tile(k, tile.rows, p.head_dim, tile.k.data());
  load_tile(v, tile.rows, p.head_dim, tile.v.data());
}

// Everything recompute_row needs about one (sequence, head) besides the tiles.
struct HeadContext {
  HeadContext(const FwdParams& p, const Sequence& seq, int64_t h) : seq(seq), score(p, seq, h), dropout(p, seq, h) {}
  Sequence seq;
  ScoreFn score;
  Dropout dropout;
};

// For query row r of `queries` against `keys`, recomputes, for the columns c the row sees:
//   P_rc   = exp2(score_rc - lse_r * log2(e))   (the forward's normalised, undropped softmax)
//   Z_rc   = keep_rc / (1 - dropout_p)          (1 without dropout)
//   probs[c]   = P_rc * Z_rc                    (what multiplied V in the forward: dV += probs^T dO)
//   dscores[c] = P_rc * (Z_rc * dO_r . v_c - D_r) * ds/d(scale * q.k)
// (the last factor is the softcap's 1 - tanh^2, or 1), and returns those columns. The other
// columns of the block are masked: their P and dS are 0 and are not written.
IndexRange recompute_row(const FwdParams& p, const HeadContext& head, const QueryTile& queries, int r,
                         const KeyTile& keys, uint8_t* keep, float* probs, float* dscores) {
  const float lse_log2 = queries.lse_log2[r];
  // A row that saw no key has P = 0 everywhere; lse = -inf would make the exponent NaN.
  if (lse_log2 == kNegInf) return {0, 0};
  const int head_dim = p.head_dim;
  const int64_t row = queries.rows.begin + r;
  const float* q_row = &queries.q[r * head_dim];
  const float* dout_row = &queries.dout[r * head_dim];
  const IndexRange cols = visible_columns(p, head.seq, row, keys.rows);
  if (head.dropout.enabled() && !cols.empty()) {
    head.dropout.keep_flags(row, {keys.rows.begin + cols.begin, keys.rows.begin + cols.end}, keep);
  }
  for (int64_t c = cols.begin; c < cols.end; ++c) {
    const ScoreFn::Score s = head.score(dot(q_row, &keys.k[c * head_dim], head_dim), row, keys.rows.begin + c);
    const float prob = std::exp2(s.log2 - lse_log2);
    float dprob = dot(dout_row, &keys.v[c * head_dim], head_dim);
    float kept = 1.f;  // Z_rc
    if (head.dropout.enabled()) kept = keep[c - cols.begin] ? head.dropout.scale() : 0.f;
    dprob *= kept;
    probs[c] = prob * kept;
    dscores[c] = prob * (dprob - queries.softmax_d[r]) * s.derivative;
  }
  return cols;
}

// Per-thread scratch of both backward passes: one query row's recomputed P and dS against a key tile,
// and the dropout keep flags they need.
struct RowScratch {
  std::vector<float> probs = std::vector<float>(kBlockN);
  std::vector<float> dscores = std::vector<float>(kBlockN);
  std::vector<uint8_t> keep = std::vector<uint8_t>(kBlockN);

  IndexRange recompute(const BwdParams& p, const HeadContext& head, const QueryTile& queries, int r,
                       const KeyTile& keys) {
    return recompute_row(p, head, queries, r, keys, keep.data(), probs.data(), dscores.data());
  }
};

// Pass 1: one task per (sequence, kv head, key block) owns those dK and dV rows. It sums
// dV += P^T . dO and dK += dS^T . Q over every query head of its GQA group and every query
// block that sees the key block, then writes dk = softmax_scale * dK and dv once.
template <typename T>
void compute_dk_dv(const BwdParams& p, const std::vector<float>& softmax_d) {
  const int head_dim = p.head_dim;
  const int64_t k_blocks = num_blocks(p.seqlen_k, kBlockN);  // of the longest sequence
  const int64_t num_tasks = static_cast<int64_t>(p.batch) * p.heads_kv * k_blocks;

  at::parallel_for(0, num_tasks, 1, [&](int64_t task_begin, int64_t task_end) {
    QueryTile queries(head_dim);
    KeyTile keys(head_dim);
    RowScratch row;
    std::vector<float> acc_dk(kBlockN * head_dim), acc_dv(kBlockN * head_dim);

    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t k_block = task % k_blocks;
      const int64_t h_kv = task / k_blocks % p.heads_kv;
      const Sequence seq = sequence_at(p, task / k_blocks / p.heads_kv);
      if (k_block * kBlockN >= seq.k.length) continue;
      load_key_tile<T>(p, seq, h_kv, k_block, keys);
      std::fill(acc_dk.begin(), acc_dk.end(), 0.f);
      std::fill(acc_dv.begin(), acc_dv.end(), 0.f);

      const IndexRange q_blocks = query_blocks_seeing(p, seq, keys.rows);
      const int64_t first_h = h_kv * p.heads_per_kv();
      for (int64_t h = first_h; h < first_h + p.heads_per_kv(); ++h) {
        const HeadContext head(p, seq, h);
        for (int64_t q_block = q_blocks.begin; q_block < q_blocks.end; ++q_block) {
          load_query_tile<T>(p, seq, h, q_block, softmax_d, queries);
          for (int r = 0; r < queries.rows.size; ++r) {
            const IndexRange cols = row.recompute(p, head, queries, r, keys);
            for (int64_t c = cols.begin; c < cols.end; ++c) {
              axpy(row.probs[c], &queries.dout[r * head_dim], &acc_dv[c * head_dim], head_dim);
              axpy(row.dscores[c], &queries.q[r * head_dim], &acc_dk[c * head_dim], head_dim);
            }
          }
        }
      }
      store_tile(acc_dk.data(), p.softmax_scale, head_dim, keys.rows,
                 head_rows(static_cast<T*>(p.dk), p.dk_strides, seq.b, h_kv, seq.k));
      store_tile(acc_dv.data(), 1.f, head_dim, keys.rows,
                 head_rows(static_cast<T*>(p.dv), p.dv_strides, seq.b, h_kv, seq.k));
    }
  });
}

// Pass 2: one task per (sequence, query head, query block) owns those dQ rows. It sums
// dQ += dS . K over the key blocks the query block sees and writes dq = softmax_scale * dQ.
template <typename T>
void compute_dq(const BwdParams& p, const std::vector<float>& softmax_d) {
  const int head_dim = p.head_dim;
  const int64_t q_blocks = num_blocks(p.seqlen_q, kBlockM);  // of the longest sequence
  const int64_t num_tasks = static_cast<int64_t>(p.batch) * p.heads_q * q_blocks;

  at::parallel_for(0, num_tasks, 1, [&](int64_t task_begin, int64_t task_end) {
    QueryTile queries(head_dim);
    KeyTile keys(head_dim);
    RowScratch row;
    std::vector<float> acc_dq(kBlockM * head_dim);

    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t q_block = task % q_blocks;
      const int64_t h = task / q_blocks % p.heads_q;
      const Sequence seq = sequence_at(p, task / q_blocks / p.heads_q);
      if (q_block * kBlockM >= seq.q.length) continue;
      const int64_t h_kv = h / p.heads_per_kv();
      const HeadContext head(p, seq, h);
      load_query_tile<T>(p, seq, h, q_block, softmax_d, queries);
      std::fill(acc_dq.begin(), acc_dq.end(), 0.f);

      const IndexRange k_blocks = key_blocks_seen_by(p, seq, queries.rows);
      for (int64_t k_block = k_blocks.begin; k_block < k_blocks.end; ++k_block) {
        load_key_tile<T>(p, seq, h_kv, k_block, keys);
        for (int r = 0; r < queries.rows.size; ++r) {
          const IndexRange cols = row.recompute(p, head, queries, r, keys);
          for (int64_t c = cols.begin; c < cols.end; ++c) {
            axpy(row.dscores[c], &keys.k[c * head_dim], &acc_dq[r * head_dim], head_dim);
          }
        }
      }
      store_tile(acc_dq.data(), p.softmax_scale, head_dim, queries.rows,
                 head_rows(static_cast<T*>(p.dq), p.dq_strides, seq.b, h, seq.q));
    }
  });
}

template <typename T>
void attention_bwd_impl(const BwdParams& p) {
  const std::vector<float> softmax_d = compute_softmax_d<T>(p);
  compute_dk_dv<T>(p, softmax_d);
  compute_dq<T>(p, softmax_d);
}

}  // namespace

void attention_bwd(const BwdParams& p) {
  if (p.batch == 0 || p.heads_q == 0) return;
  dispatch_dtype(p.dtype, [&](auto element) { attention_bwd_impl<decltype(element)>(p); });
}

}  // namespace flash_ext::cpu
