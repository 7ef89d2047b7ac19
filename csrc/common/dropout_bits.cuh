// Dropout keep bits of a thread's score elements in the mma accumulator layouts, from the Philox
// words of common/philox.h (the CPU path draws the very same words). One Philox call decides 8
// consecutive columns of a row; the lanes that hold those columns share the call: each lane
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
// first_key + nj * 8 + 2 (lane % 4) + e of `row`, e = 0, 1, nj < kNTiles (first_key a multiple of 8).
// Returns bit 2 nj + e set = kept. Tile nj's 8 columns are one Philox call, word t of which decides
// the two columns of lane t = lane % 4: lane t computes the calls of tiles t, t + 4, ... and three
// shuffles hand each lane of its quad its bits.
template <int kNTiles>
__device__ __forceinline__ uint32_t row_keep_bits(const PhiloxSeedOffset& rng, uint64_t batch_head, int row,
                                                  int first_key, uint32_t drop_threshold) {
  static_assert(2 * kNTiles <= 32, "one 32-bit mask");
  const int lane = threadIdx.x % 32;
  const int quad_lane = lane % 4;
  uint32_t bits_for[4] = {0u, 0u, 0u, 0u};  // [t]: the bits of quad lane t from this lane's calls
#pragma unroll 1
  for (int nj = quad_lane; nj < kNTiles; nj += 4) {
    const PhiloxWords words =
        dropout_random_words(rng.seed, rng.offset, batch_head, row, first_key / kDropoutColumnsPerCall + nj);
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      const uint32_t pair = (dropout_keeps(words, 2 * t, drop_threshold) ? 1u : 0u) |
                            (dropout_keeps(words, 2 * t + 1, drop_threshold) ? 2u : 0u);
      bits_for[t] |= pair << (2 * nj);
    }
  }
  // bits_for[t] by selects: indexed by a lane-dependent t, the array would live in local memory.
  auto bits_of = [&](int t) { return t == 0 ? bits_for[0] : t == 1 ? bits_for[1] : t == 2 ? bits_for[2] : bits_for[3]; };
  // Round r: each lane sends quad lane (its own + r) % 4 that lane's bits, and receives its own from
  // quad lane (its own - r) % 4.
  uint32_t bits = bits_of(quad_lane);
#pragma unroll
  for (int r = 1; r < 4; ++r) {
    bits |= __shfl_sync(0xffffffff, bits_of((quad_lane + r) & 3), (lane & ~3) | ((quad_lane - r) & 3));
  }
  return bits;
}

// Transposed score tiles (rows are keys; dK/dV kernel): the thread holds keys
// thread_key + 16 mi + 8 half and queries thread_query + 8 nj + e; returns bit
// ((mi * 2 + half) * kNTiles + nj) * 2 + e set = kept. Element (query i, key j) is decided by the
// call for (row i, columns j / 8), so the eight lanes whose keys are j - j % 8 .. + 7 (lane / 4 =
// 0..7, same lane % 4) need the same calls, an element each: each lane computes an eighth of them,
// keeps all eight elements' bits, and eight shuffles hand every lane its own.
// thread_key - lane / 4 must be a multiple of 8.
template <int kMTiles, int kNTiles>
__device__ __forceinline__ uint32_t transposed_keep_bits(const PhiloxSeedOffset& rng, uint64_t batch_head,
                                                         int thread_query, int thread_key, uint32_t drop_threshold) {
  constexpr int kBits = kMTiles * 2 * kNTiles * 2;
  constexpr int kCallsPerLane = kBits / 8;
  static_assert(kBits <= 32 && kBits % 8 == 0, "one 32-bit mask, whole calls per lane");
  const int lane = threadIdx.x % 32;
  const int key_of_lane = lane / 4;                      // = key % 8 of every key this lane holds
  const int group_first_key = thread_key - key_of_lane;  // first key of thread_key's group of eight
  uint32_t computed = 0;  // bit kCallsPerLane * k + c: whether key k's element of this lane's call c is kept
#pragma unroll 1
  for (int c = 0; c < kCallsPerLane; ++c) {
    const int i = key_of_lane * kCallsPerLane + c;              // the bit index (mi, half, nj, e) this call serves
    const int key = group_first_key + 8 * (i / (2 * kNTiles));  // 16 mi + 8 half = 8 (i / (2 kNTiles))
    const int query = thread_query + i / 2 % kNTiles * 8 + i % 2;
    const PhiloxWords words =
        dropout_random_words(rng.seed, rng.offset, batch_head, query, key / kDropoutColumnsPerCall);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      computed |= (dropout_keeps(words, k, drop_threshold) ? 1u : 0u) << (kCallsPerLane * k + c);
    }
  }
  uint32_t bits = 0;
#pragma unroll
  for (int source = 0; source < 8; ++source) {  // the lane that computed bits [source * kCallsPerLane, + kCallsPerLane)
    const uint32_t from_source = __shfl_sync(0xffffffff, computed, (lane & 3) | (source << 2));
    bits |= (from_source >> (kCallsPerLane * key_of_lane) & ((1u << kCallsPerLane) - 1u)) << (source * kCallsPerLane);
  }
  return bits;
}

}  // namespace flash_ext
