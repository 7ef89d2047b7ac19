// Dropout keep bits of a thread's score elements in the mma accumulator layouts, from the Philox
// words of common/philox.h (the CPU path draws the very same words). One Philox call gives the 4
// words of columns 4c..4c+3 of a row; the lanes that hold those columns share the call: each lane
// computes a share of the calls and shuffles hand out the bits, so every call runs once per warp.
// (One call per lane and element made the backward with dropout 2.5x slower than without.)
// The calls run in loops that are not unrolled: 32 inlined Philox calls spill registers.
// Every lane of the warp must call these together (they shuffle).
#pragma once

#include <cstdint>

#include "philox.h"
#include "../params.h"

namespace flash_ext {

// The forward's Philox seed and offset (possibly known only on the device), published once, by the
// first thread of the first CTA, for the backward.
__device__ __forceinline__ void publish_rng_state(const FwdParams& params) {
  if (params.rng_state_out != nullptr && blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0 &&
      threadIdx.x == 0) {
    const PhiloxSeedOffset rng = philox_seed_offset(params);
    params.rng_state_out[0] = static_cast<int64_t>(rng.seed);
    params.rng_state_out[1] = static_cast<int64_t>(rng.offset);
  }
}

// Row-major score tiles (rows are queries; forward, dQ kernel): the thread holds columns
// first_key + nj * 8 + 2 (lane % 4) + e of `row`, e = 0, 1, nj < kNTiles. Returns bit 2 nj + e set
// = kept. Lanes t and t ^ 1 (t = lane % 4) hold words 0-1 and 2-3 of one call per tile: each
// computes every other tile's call and passes the partner its two bits.
template <int kNTiles>
__device__ __forceinline__ uint32_t row_keep_bits(const PhiloxSeedOffset& rng, uint64_t batch_head, int row,
                                                  int first_key, uint32_t drop_threshold) {
  static_assert(2 * kNTiles <= 32 && kNTiles % 2 == 0, "one 32-bit mask; tiles in pairs");
  const int lane = threadIdx.x % 32;
  const int pair_half = lane % 2;  // words 2 * pair_half and + 1 of each shared call are this lane's
  uint32_t own_bits = 0, their_bits = 0;
#pragma unroll 1
  for (int nj = pair_half; nj < kNTiles; nj += 2) {
    const int column = first_key + nj * 8 + 2 * (lane % 4);  // even; the call covers column & ~3 .. + 3
    const PhiloxWords words = dropout_random_words(rng.seed, rng.offset, batch_head, row, column / 4);
    const uint32_t own0 = pair_half == 0 ? words.w[0] : words.w[2], own1 = pair_half == 0 ? words.w[1] : words.w[3];
    const uint32_t their0 = pair_half == 0 ? words.w[2] : words.w[0], their1 = pair_half == 0 ? words.w[3] : words.w[1];
    own_bits |= ((dropout_keeps(own0, drop_threshold) ? 1u : 0u) | (dropout_keeps(own1, drop_threshold) ? 2u : 0u))
                << (2 * nj);
    their_bits |=
        ((dropout_keeps(their0, drop_threshold) ? 1u : 0u) | (dropout_keeps(their1, drop_threshold) ? 2u : 0u))
        << (2 * nj);
  }
  return own_bits | __shfl_xor_sync(0xffffffff, their_bits, 1);
}

// Transposed score tiles (rows are keys; dK/dV kernel): the thread holds keys
// thread_key + 16 mi + 8 half and queries thread_query + 8 nj + e; returns bit
// ((mi * 2 + half) * kNTiles + nj) * 2 + e set = kept. Element (query i, key j) is word j % 4 of
// the call for (row i, columns j / 4), so the four lanes whose keys are j - j % 4 .. + 3
// (lane / 4 % 4 = 0..3, same lane % 4 and lane / 16) need the same calls, a word each: each lane
// computes a quarter of them, keeps all four words' bits, and four shuffles hand every lane its own.
// thread_key - lane / 4 % 4 must be a multiple of 4.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ uint32_t transposed_keep_bits(const PhiloxSeedOffset& rng, uint64_t batch_head,
                                                         int thread_query, int thread_key, uint32_t drop_threshold) {
  constexpr int kBits = kMTiles * 2 * kNTiles * 2;
  constexpr int kCallsPerLane = kBits / 4;
  static_assert(kBits <= 32 && kCallsPerLane <= 8, "one 32-bit mask; a byte per word");
  const int lane = threadIdx.x % 32;
  const int word_of_lane = lane / 4 % 4;                  // = key % 4 of every key this lane holds
  const int group_first_key = thread_key - word_of_lane;  // first key of thread_key's group of four
  uint32_t computed = 0;  // bit 8 * word + c: whether word `word` of this lane's call c keeps its element
#pragma unroll 1
  for (int c = 0; c < kCallsPerLane; ++c) {
    const int i = word_of_lane * kCallsPerLane + c;             // the bit index (mi, half, nj, e) this call serves
    const int key = group_first_key + 8 * (i / (2 * kNTiles));  // 16 mi + 8 half = 8 (i / (2 kNTiles))
    const int query = thread_query + i / 2 % kNTiles * 8 + i % 2;
    const PhiloxWords words = dropout_random_words(rng.seed, rng.offset, batch_head, query, key / 4);
#pragma unroll
    for (int word = 0; word < 4; ++word) {
      computed |= (dropout_keeps(words.w[word], drop_threshold) ? 1u : 0u) << (8 * word + c);
    }
  }
  uint32_t bits = 0;
#pragma unroll
  for (int source = 0; source < 4; ++source) {  // the lane that computed bits [source * kCallsPerLane, + kCallsPerLane)
    const uint32_t from_source = __shfl_sync(0xffffffff, computed, (lane & ~12) | (source << 2));
    bits |= (from_source >> (8 * word_of_lane) & 0xffu) << (source * kCallsPerLane);
  }
  return bits;
}

}  // namespace flash_ext
