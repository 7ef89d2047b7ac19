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

#include "attention_cpu.h"

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

// The rows of one (batch, head) slice of a (batch, seqlen, heads, head_dim) tensor.
template <typename T>
struct HeadRows {
  T* base;             // element (row 0, dim 0)
  int64_t row_stride;  // elements from one row to the next
  T* row(int64_t r) const { return base + r * row_stride; }
};

template <typename T>
HeadRows<T> head_rows(T* data, const TensorStrides& strides, int64_t b, int64_t h) {
  return {data + b * strides.batch + h * strides.head, strides.row};
}

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

// ---- Causal masking (bottom-right aligned) --------------------------------------------------

// One past the last key that query `row` sees: all keys, or with causal masking the keys
// j <= causal_last_key(row). 0 when the row sees none (seqlen_q > seqlen_k, or seqlen_k == 0).
int64_t visible_key_end(const FwdParams& p, int64_t row) {
  if (!p.causal) return p.seqlen_k;
  return std::clamp<int64_t>(p.causal_last_key(row) + 1, 0, p.seqlen_k);
}

// How many keys of `keys` query `row` sees; they are always a prefix of the block.
int visible_keys_in(const FwdParams& p, int64_t row, Block keys) {
  return static_cast<int>(std::clamp<int64_t>(visible_key_end(p, row) - keys.begin, 0, keys.size));
}

// Key blocks [0, result) hold every key that some row of `queries` sees. The last row sees the
// most, so later blocks are wholly in the future of the whole query block and are skipped.
int64_t num_key_blocks_seen_by(const FwdParams& p, Block queries) {
  return num_blocks(visible_key_end(p, queries.begin + queries.size - 1), kBlockN);
}

// The first query block with a row that sees some key of `keys`; earlier blocks are skipped.
int64_t first_query_block_seeing(const FwdParams& p, Block keys) {
  if (!p.causal) return 0;
  // Query i sees key keys.begin iff keys.begin <= i + seqlen_k - seqlen_q.
  const int64_t first_row = std::max<int64_t>(0, keys.begin + p.seqlen_q - p.seqlen_k);
  return first_row / kBlockM;
}

// ---- Forward --------------------------------------------------------------------------------

// Folds one tile of a query row's scores into the row's running softmax state.
//   scores   in: s * scale_log2 (log2 units), -inf where masked; out: exp2(score - row_max), the
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
  const int64_t q_blocks = num_blocks(p.seqlen_q, kBlockM);
  const int64_t num_tasks = static_cast<int64_t>(p.batch) * p.heads_q * q_blocks;

  at::parallel_for(0, num_tasks, 1, [&](int64_t task_begin, int64_t task_end) {
    // Per-thread tiles, reused by every task of this chunk.
    std::vector<float> q_tile(kBlockM * head_dim), k_tile(kBlockN * head_dim), v_tile(kBlockN * head_dim);
    std::vector<float> acc_o(kBlockM * head_dim);  // unnormalised output, relative to row_max
    std::vector<float> row_max(kBlockM), row_sum(kBlockM);
    std::vector<float> scores(kBlockN);  // one row of S at a time

    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t q_block = task % q_blocks;
      const int64_t h = task / q_blocks % p.heads_q;
      const int64_t b = task / q_blocks / p.heads_q;
      const int64_t h_kv = h / p.heads_per_kv();
      const auto q = head_rows(static_cast<const T*>(p.q), p.q_strides, b, h);
      const auto k = head_rows(static_cast<const T*>(p.k), p.k_strides, b, h_kv);
      const auto v = head_rows(static_cast<const T*>(p.v), p.v_strides, b, h_kv);
      const auto out = head_rows(static_cast<T*>(p.out), p.out_strides, b, h);
      float* lse = p.lse + (b * p.heads_q + h) * p.seqlen_q;

      const Block queries = block_at(q_block, kBlockM, p.seqlen_q);
      load_tile(q, queries, head_dim, q_tile.data());
      std::fill(acc_o.begin(), acc_o.end(), 0.f);
      std::fill(row_max.begin(), row_max.end(), kNegInf);
      std::fill(row_sum.begin(), row_sum.end(), 0.f);

      const int64_t k_blocks = num_key_blocks_seen_by(p, queries);
      for (int64_t k_block = 0; k_block < k_blocks; ++k_block) {
        const Block keys = block_at(k_block, kBlockN, p.seqlen_k);
        load_tile(k, keys, head_dim, k_tile.data());
        load_tile(v, keys, head_dim, v_tile.data());

        for (int r = 0; r < queries.size; ++r) {
          const float* q_row = &q_tile[r * head_dim];
          float* o_row = &acc_o[r * head_dim];
          const int visible = visible_keys_in(p, queries.begin + r, keys);
          for (int c = 0; c < visible; ++c) {
            scores[c] = dot(q_row, &k_tile[c * head_dim], head_dim) * p.scale_log2;
          }
          std::fill(scores.begin() + visible, scores.begin() + keys.size, kNegInf);

          const float rescale = online_softmax_update(scores.data(), keys.size, row_max[r], row_sum[r]);
          for (int d = 0; d < head_dim; ++d) o_row[d] *= rescale;
          for (int c = 0; c < visible; ++c) axpy(scores[c], &v_tile[c * head_dim], o_row, head_dim);
        }
      }

      for (int r = 0; r < queries.size; ++r) {
        // row_sum >= 1 for a row that saw a key (its max term is exp2(0)); 0 for one that saw none.
        const bool saw_keys = row_sum[r] > 0.f;
        const float inv_sum = saw_keys ? 1.f / row_sum[r] : 0.f;
        float* o_row = &acc_o[r * head_dim];
        for (int d = 0; d < head_dim; ++d) o_row[d] *= inv_sum;
        // Natural-log lse: log(sum exp(s * softmax_scale)) = row_max * ln2 + log(row_sum).
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

// Index of row `row` of head (b, h) in the (batch, heads_q, seqlen_q) lse / D arrays.
int64_t row_stat_index(const FwdParams& p, int64_t b, int64_t h, int64_t row) {
  return (b * p.heads_q + h) * p.seqlen_q + row;
}

// D_i = sum_d dout[i, d] * out[i, d] for every query row, (batch, heads_q, seqlen_q). It is the
// softmax-Jacobian term of dS = P * (dP - D), needed by both passes, and only O(seqlen) in size.
template <typename T>
std::vector<float> compute_softmax_d(const BwdParams& p) {
  std::vector<float> softmax_d(static_cast<size_t>(p.batch) * p.heads_q * p.seqlen_q);
  const int64_t num_heads = static_cast<int64_t>(p.batch) * p.heads_q;
  at::parallel_for(0, num_heads, 1, [&](int64_t bh_begin, int64_t bh_end) {
    for (int64_t bh = bh_begin; bh < bh_end; ++bh) {
      const int64_t b = bh / p.heads_q, h = bh % p.heads_q;
      const auto dout = head_rows(static_cast<const T*>(p.dout), p.dout_strides, b, h);
      const auto out = head_rows(static_cast<const T*>(p.out), p.out_strides, b, h);
      for (int64_t i = 0; i < p.seqlen_q; ++i) {
        const T* dout_row = dout.row(i);
        const T* out_row = out.row(i);
        float sum = 0.f;
        for (int d = 0; d < p.head_dim; ++d) {
          sum += static_cast<float>(dout_row[d]) * static_cast<float>(out_row[d]);
        }
        softmax_d[row_stat_index(p, b, h, i)] = sum;
      }
    }
  });
  return softmax_d;
}

template <typename T>
void load_query_tile(const BwdParams& p, int64_t b, int64_t h, int64_t q_block,
                     const std::vector<float>& softmax_d, QueryTile& tile) {
  tile.rows = block_at(q_block, kBlockM, p.seqlen_q);
  const auto q = head_rows(static_cast<const T*>(p.q), p.q_strides, b, h);
  const auto dout = head_rows(static_cast<const T*>(p.dout), p.dout_strides, b, h);
  load_tile(q, tile.rows, p.head_dim, tile.q.data());
  load_tile(dout, tile.rows, p.head_dim, tile.dout.data());
  for (int r = 0; r < tile.rows.size; ++r) {
    const int64_t idx = row_stat_index(p, b, h, tile.rows.begin + r);
    tile.lse_log2[r] = p.lse[idx] * kLog2e;
    tile.softmax_d[r] = softmax_d[idx];
  }
}

template <typename T>
void load_key_tile(const BwdParams& p, int64_t b, int64_t h_kv, int64_t k_block, KeyTile& tile) {
  tile.rows = block_at(k_block, kBlockN, p.seqlen_k);
  const auto k = head_rows(static_cast<const T*>(p.k), p.k_strides, b, h_kv);
  const auto v = head_rows(static_cast<const T*>(p.v), p.v_strides, b, h_kv);
  load_tile(k, tile.rows, p.head_dim, tile.k.data());
  load_tile(v, tile.rows, p.head_dim, tile.v.data());
}

// For query row r of `queries` against `keys`, recomputes
//   P_rc  = exp2(s_rc * scale_log2 - lse_r * log2(e))   (the forward's normalised softmax)
//   dS_rc = P_rc * (dP_rc - D_r),  dP = dO . V^T
// into probs[c] and dscores[c] for the keys the row sees, and returns how many that is. The
// remaining keys of the block are masked: their P and dS are 0 and are not written.
int recompute_row(const FwdParams& p, const QueryTile& queries, int r, const KeyTile& keys,
                  float* probs, float* dscores) {
  const float lse_log2 = queries.lse_log2[r];
  // A row that saw no key has P = 0 everywhere; lse = -inf would make the exponent NaN.
  if (lse_log2 == kNegInf) return 0;
  const int head_dim = p.head_dim;
  const float* q_row = &queries.q[r * head_dim];
  const float* dout_row = &queries.dout[r * head_dim];
  const int visible = visible_keys_in(p, queries.rows.begin + r, keys.rows);
  for (int c = 0; c < visible; ++c) {
    probs[c] = std::exp2(dot(q_row, &keys.k[c * head_dim], head_dim) * p.scale_log2 - lse_log2);
    const float dprob = dot(dout_row, &keys.v[c * head_dim], head_dim);
    dscores[c] = probs[c] * (dprob - queries.softmax_d[r]);
  }
  return visible;
}

// Pass 1: one task per (batch, kv head, key block) owns those dK and dV rows. It sums
// dV += P^T . dO and dK += dS^T . Q over every query head of its GQA group and every query
// block that sees the key block, then writes dk = softmax_scale * dK and dv once.
template <typename T>
void compute_dk_dv(const BwdParams& p, const std::vector<float>& softmax_d) {
  const int head_dim = p.head_dim;
  const int64_t q_blocks = num_blocks(p.seqlen_q, kBlockM);
  const int64_t k_blocks = num_blocks(p.seqlen_k, kBlockN);
  const int64_t num_tasks = static_cast<int64_t>(p.batch) * p.heads_kv * k_blocks;

  at::parallel_for(0, num_tasks, 1, [&](int64_t task_begin, int64_t task_end) {
    QueryTile queries(head_dim);
    KeyTile keys(head_dim);
    std::vector<float> acc_dk(kBlockN * head_dim), acc_dv(kBlockN * head_dim);
    std::vector<float> probs(kBlockN), dscores(kBlockN);

    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t k_block = task % k_blocks;
      const int64_t h_kv = task / k_blocks % p.heads_kv;
      const int64_t b = task / k_blocks / p.heads_kv;
      load_key_tile<T>(p, b, h_kv, k_block, keys);
      std::fill(acc_dk.begin(), acc_dk.end(), 0.f);
      std::fill(acc_dv.begin(), acc_dv.end(), 0.f);

      const int64_t first_h = h_kv * p.heads_per_kv();
      for (int64_t h = first_h; h < first_h + p.heads_per_kv(); ++h) {
        for (int64_t q_block = first_query_block_seeing(p, keys.rows); q_block < q_blocks; ++q_block) {
          load_query_tile<T>(p, b, h, q_block, softmax_d, queries);
          for (int r = 0; r < queries.rows.size; ++r) {
            const int visible = recompute_row(p, queries, r, keys, probs.data(), dscores.data());
            for (int c = 0; c < visible; ++c) {
              axpy(probs[c], &queries.dout[r * head_dim], &acc_dv[c * head_dim], head_dim);
              axpy(dscores[c], &queries.q[r * head_dim], &acc_dk[c * head_dim], head_dim);
            }
          }
        }
      }
      store_tile(acc_dk.data(), p.softmax_scale, head_dim, keys.rows,
                 head_rows(static_cast<T*>(p.dk), p.dk_strides, b, h_kv));
      store_tile(acc_dv.data(), 1.f, head_dim, keys.rows,
                 head_rows(static_cast<T*>(p.dv), p.dv_strides, b, h_kv));
    }
  });
}

// Pass 2: one task per (batch, query head, query block) owns those dQ rows. It sums
// dQ += dS . K over the key blocks the query block sees and writes dq = softmax_scale * dQ.
template <typename T>
void compute_dq(const BwdParams& p, const std::vector<float>& softmax_d) {
  const int head_dim = p.head_dim;
  const int64_t q_blocks = num_blocks(p.seqlen_q, kBlockM);
  const int64_t num_tasks = static_cast<int64_t>(p.batch) * p.heads_q * q_blocks;

  at::parallel_for(0, num_tasks, 1, [&](int64_t task_begin, int64_t task_end) {
    QueryTile queries(head_dim);
    KeyTile keys(head_dim);
    std::vector<float> acc_dq(kBlockM * head_dim);
    std::vector<float> probs(kBlockN), dscores(kBlockN);

    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t q_block = task % q_blocks;
      const int64_t h = task / q_blocks % p.heads_q;
      const int64_t b = task / q_blocks / p.heads_q;
      const int64_t h_kv = h / p.heads_per_kv();
      load_query_tile<T>(p, b, h, q_block, softmax_d, queries);
      std::fill(acc_dq.begin(), acc_dq.end(), 0.f);

      const int64_t k_blocks = num_key_blocks_seen_by(p, queries.rows);
      for (int64_t k_block = 0; k_block < k_blocks; ++k_block) {
        load_key_tile<T>(p, b, h_kv, k_block, keys);
        for (int r = 0; r < queries.rows.size; ++r) {
          const int visible = recompute_row(p, queries, r, keys, probs.data(), dscores.data());
          for (int c = 0; c < visible; ++c) {
            axpy(dscores[c], &keys.k[c * head_dim], &acc_dq[r * head_dim], head_dim);
          }
        }
      }
      store_tile(acc_dq.data(), p.softmax_scale, head_dim, queries.rows,
                 head_rows(static_cast<T*>(p.dq), p.dq_strides, b, h));
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

}  // namespace flash_ext::cpu
