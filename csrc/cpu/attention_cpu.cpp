// Tiled CPU FlashAttention: the executable specification the GPU kernels are held to.
//
// Same algorithm as the kernels, on tiles of kBlockM query rows x kBlockN key rows:
//   forward   per query block, one sweep over the key blocks with an online softmax (running
//             row max and row sum, base-2 exponentials); the output is normalised once at the end.
//   backward  recomputes the probabilities P from the saved lse instead of storing them, in two
//             passes so that every output row has exactly one writer (race-free, deterministic,
//             no atomics): pass 1 owns the dK/dV rows of a key block, pass 2 the dQ rows of a
//             query block. The price is computing Q.K^T and dO.V^T twice.
// All arithmetic is fp32: inputs are widened when a tile is loaded, outputs rounded when stored.
//
// Features (see params.h for their definitions):
//   variable-length batches  each task works inside one sequence: rows are offset by the sequence's
//                            start in the packed tensors and masks use the sequence's own lengths.
//   sliding window / causal  only the key tiles that intersect a query tile's band are visited (and
//                            only the query tiles that see a key tile in the backward), so the cost
//                            grows with the window, not with seqlen_q * seqlen_k.
//   softcap, ALiBi           applied to each score (ScoreFn); the backward multiplies dS by the
//                            softcap's derivative 1 - tanh^2.
//   dropout                  keep decisions come from common/philox.h, regenerated in the backward.

#include "attention_cpu.h"

#include "../common/philox.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace flash_ext::cpu {
namespace {

constexpr int kBlockM = 64;  // query rows per tile
constexpr int kBlockN = 64;  // key rows per tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- Tensor access -------------------------------------------------------------------------

// The rows of one head of one sequence: a (batch, head) slice of a (batch, seqlen, heads, head_dim)
// tensor, or of a packed (total, heads, head_dim) one starting at the sequence's first row.
template <typename T>
struct HeadRows {
  T* base;             // element (row 0 of the sequence, dim 0)
  int64_t row_stride;  // elements from one row to the next
  T* row(int64_t r) const { return base + r * row_stride; }
};

template <typename T>
HeadRows<T> head_rows(T* data, const TensorStrides& strides, int64_t b, int64_t h, const SequenceSpan& span) {
  return {data + b * strides.batch + h * strides.head + span.begin * strides.row, strides.row};
}

// Sequence b of the batch: its query rows and key rows.
struct Sequence {
  int64_t b;
  SequenceSpan q, k;
};

Sequence sequence_at(const FwdParams& p, int64_t b) { return {b, p.query_span(b), p.key_span(b)}; }

// A run of consecutive rows of a sequence.
struct Block {
  int64_t begin;
  int size;
};

int64_t num_blocks(int64_t len, int block_size) { return (len + block_size - 1) / block_size; }

// Block `index` of a sequence of length `len` cut into blocks of `block_size` (the last may be short).
Block block_at(int64_t index, int block_size, int64_t len) {
  const int64_t begin = index * block_size;
  return {begin, static_cast<int>(std::min<int64_t>(block_size, len - begin))};
}

// Widens the block's rows into a dense float tile (block.size x head_dim).
template <typename T>
void load_tile(HeadRows<const T> src, Block block, int head_dim, float* tile) {
  for (int r = 0; r < block.size; ++r) {
    const T* row = src.row(block.begin + r);
    float* dst = tile + static_cast<int64_t>(r) * head_dim;
    for (int d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(row[d]);
  }
}

// Stores scale * tile into the block's rows, rounded to T.
template <typename T>
void store_tile(const float* tile, float scale, int head_dim, Block block, HeadRows<T> dst) {
  for (int r = 0; r < block.size; ++r) {
    const float* src = tile + static_cast<int64_t>(r) * head_dim;
    T* row = dst.row(block.begin + r);
    for (int d = 0; d < head_dim; ++d) row[d] = static_cast<T>(src[d] * scale);
  }
}

// ---- Vector kernels over head_dim (contiguous, so the compiler vectorises them) -------------

// fp32 dot product. Without -ffast-math the compiler may not reorder a single running sum, so
// eight independent partial sums give it lanes to vectorise.
float dot(const float* a, const float* b, int n) {
  constexpr int kLanes = 8;
  float partial[kLanes] = {};
  int d = 0;
  for (; d + kLanes <= n; d += kLanes) {
    for (int lane = 0; lane < kLanes; ++lane) partial[lane] += a[d + lane] * b[d + lane];
  }
  float sum = 0.f;
  for (; d < n; ++d) sum += a[d] * b[d];
  for (int lane = 0; lane < kLanes; ++lane) sum += partial[lane];
  return sum;
}

// y += alpha * x
void axpy(float alpha, const float* x, float* y, int n) {
  for (int d = 0; d < n; ++d) y[d] += alpha * x[d];
}

// ---- Masking: the band of keys each query sees ----------------------------------------------

// The columns of `keys` (block-local, [0, keys.size)) that query `row` of `seq` sees.
IndexRange visible_columns(const FwdParams& p, const Sequence& seq, int64_t row, Block keys) {
  const IndexRange visible = p.visible_keys(row, seq.q.length, seq.k.length);
  return {std::clamp<int64_t>(visible.begin - keys.begin, 0, keys.size),
          std::clamp<int64_t>(visible.end - keys.begin, 0, keys.size)};
}

// The key blocks that hold every key some row of `queries` sees; blocks outside are skipped.
// Both ends of a row's band grow with the row, so the first row bounds the start and the last
// row the end.
IndexRange key_blocks_seen_by(const FwdParams& p, const Sequence& seq, Block queries) {
  const int64_t first_key = p.visible_keys(queries.begin, seq.q.length, seq.k.length).begin;
  const int64_t end_key = p.visible_keys(queries.begin + queries.size - 1, seq.q.length, seq.k.length).end;
  if (first_key >= end_key) return {0, 0};
  return {first_key / kBlockN, num_blocks(end_key, kBlockN)};
}

// The query blocks with a row that sees some key of `keys`; the others are skipped.
IndexRange query_blocks_seeing(const FwdParams& p, const Sequence& seq, Block keys) {
  const IndexRange rows = p.rows_seeing(keys.begin, keys.begin + keys.size, seq.q.length, seq.k.length);
  if (rows.empty()) return {0, 0};
  return {rows.begin / kBlockM, num_blocks(rows.end, kBlockM)};
}

// ---- Scores: softmax_scale, softcap, ALiBi ---------------------------------------------------

// What one (sequence, head) does to q.k before the softmax:
//   s = softmax_scale * q.k
//   s = softcap * tanh(s / softcap)             when softcap > 0
//   s = s - slope * |i + len_k - len_q - j|     with ALiBi
// The result is kept in log2 units (times log2(e)): the softmax uses exp2.
class ScoreFn {
 public:
  struct Score {
    float log2;        // s * log2(e)
    float derivative;  // ds / d(softmax_scale * q.k): 1, or 1 - tanh^2 under softcap
  };

  ScoreFn(const FwdParams& p, const Sequence& seq, int64_t h)
      : scale_(p.softmax_scale),
        softcap_(p.softcap),
        inv_softcap_(p.softcap > 0.f ? 1.f / p.softcap : 0.f),
        alibi_slope_(p.alibi_slope(seq.b, h)),
        diagonal_(seq.k.length - seq.q.length) {}

  Score operator()(float qk, int64_t row, int64_t col) const {
    float s = qk * scale_;
    float derivative = 1.f;
    if (softcap_ > 0.f) {
      const float t = std::tanh(s * inv_softcap_);
      s = softcap_ * t;
      derivative = 1.f - t * t;
    }
    if (alibi_slope_ != 0.f) s -= alibi_slope_ * static_cast<float>(std::abs(row + diagonal_ - col));
    return {s * kLog2e, derivative};
  }

 private:
  float scale_, softcap_, inv_softcap_, alibi_slope_;
  int64_t diagonal_;
};

// ---- Dropout ----------------------------------------------------------------------------------

// The keep decisions of one (sequence, head); see common/philox.h for the mapping.
class Dropout {
 public:
  Dropout(const FwdParams& p, const Sequence& seq, int64_t h)
      : enabled_(p.has_dropout()),
        scale_(p.dropout_scale),
        threshold_(p.dropout_threshold),
        seed_(p.philox_seed),
        offset_(p.philox_offset),
        batch_head_(static_cast<uint64_t>(seq.b) * p.heads_q + h) {}

  bool enabled() const { return enabled_; }
  float scale() const { return scale_; }  // 1 / (1 - dropout_p)

  // keep[c - cols.begin] for the columns of `cols` (sequence coordinates) of query `row`.
  void keep_flags(int64_t row, IndexRange cols, uint8_t* keep) const {
    fill_dropout_keep_flags(seed_, offset_, threshold_, batch_head_, row, cols.begin, cols.end, keep);
  }

 private:
  bool enabled_;
  float scale_;
  uint32_t threshold_;
  uint64_t seed_, offset_, batch_head_;
};

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

// ---- Backward -------------------------------------------------------------------------------

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

// Calls fn with a value of the C++ element type that `dtype` names.
template <typename Fn>
void dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat32: return fn(float{});
    case DType::kFloat16: return fn(c10::Half{});
    case DType::kBFloat16: return fn(c10::BFloat16{});
  }
}

}  // namespace

void attention_fwd(const FwdParams& p) {
  if (p.batch == 0 || p.heads_q == 0) return;  // nothing to do; heads_per_kv() would divide by 0
  dispatch_dtype(p.dtype, [&](auto element) { attention_fwd_impl<decltype(element)>(p); });
}

void attention_bwd(const BwdParams& p) {
  if (p.batch == 0 || p.heads_q == 0) return;
  dispatch_dtype(p.dtype, [&](auto element) { attention_bwd_impl<decltype(element)>(p); });
}

void fill_dropout_keep_flags(uint64_t seed, uint64_t offset, uint32_t drop_threshold, uint64_t batch_head,
                             int64_t row, int64_t col_begin, int64_t col_end, uint8_t* keep) {
  // One Philox call per group of 8 columns; the range's first and last groups may be partial.
  constexpr int kColumns = kDropoutColumnsPerCall;
  for (int64_t group = col_begin / kColumns; group * kColumns < col_end; ++group) {
    const PhiloxWords words = dropout_random_words(seed, offset, batch_head, row, group);
    for (int i = 0; i < kColumns; ++i) {
      const int64_t col = group * kColumns + i;
      if (col >= col_begin && col < col_end) keep[col - col_begin] = dropout_keeps(words, i, drop_threshold);
    }
  }
}

void dropout_keep_mask(uint64_t seed, uint64_t offset, uint32_t drop_threshold, int64_t batch, int64_t heads,
                       int64_t seqlen_q, int64_t seqlen_k, uint8_t* mask) {
  at::parallel_for(0, batch * heads * seqlen_q, 1, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t row = index % seqlen_q, batch_head = index / seqlen_q;
      fill_dropout_keep_flags(seed, offset, drop_threshold, batch_head, row, 0, seqlen_k, mask + index * seqlen_k);
    }
  });
}

}  // namespace flash_ext::cpu
