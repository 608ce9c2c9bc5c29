// What the model-level parallel tests (tensor, pipeline) share: deterministic packed rows for a
// micro-batch, and the comparison of a shard's gradients with the single-rank model's, piece by
// piece (ShardPiece maps each element of the shard's arena to the whole arena): every element
// within 2e-5 of the whole gradient's largest magnitude; the first five misses are reported.
// Tests only.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "shardlm/model/llama.h"
#include "shardlm/model/tensor_shard.h"

namespace shardlm::test {

// B rows of T tokens from an LCG seeded with `seed`, in [0, vocab); row r holds two documents,
// the second starting at cut(r); targets are the next token within a document, kIgnoreIndex at
// each document's last token.
inline void fill_two_documents(const BatchInputs& in, int64_t B, int64_t T, int64_t vocab,
                               uint64_t seed, const std::function<int64_t(int64_t)>& cut) {
  uint64_t h = seed;
  for (int64_t r = 0; r < B; ++r)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t i = r * T + t, start = t < cut(r) ? 0 : cut(r);
      h = h * 6364136223846793005ull + 1442695040888963407ull;
      in.tokens.i32()[i] = int32_t((h >> 33) % uint64_t(vocab));
      in.positions.i32()[i] = int32_t(t - start);
      in.seg_start.i32()[i] = int32_t(start);
    }
  for (int64_t i = 0; i < B * T; ++i) {
    const bool last = (i + 1) % T == 0 || in.seg_start.i32()[i + 1] != in.seg_start.i32()[i];
    in.targets.i32()[i] = last ? kIgnoreIndex : in.tokens.i32()[i + 1];
  }
}

// shard [shard arena] and whole [whole_total] f32 host gradients agree piece by piece within
// `relative` times the whole's largest element (tests/tolerance.h); where: prefixed to messages.
inline void expect_pieces_match(const std::vector<ShardPiece>& pieces, const float* shard,
                                const float* whole, int64_t whole_total, double relative,
                                const std::string& where = "") {
  float gmax = 0;
  for (int64_t i = 0; i < whole_total; ++i) gmax = std::max(gmax, std::abs(whole[i]));
  int bad = 0;
  for (const ShardPiece& p : pieces)
    for (int64_t i = 0; i < p.count && bad < 5; ++i)
      if (std::abs(shard[p.shard + i] - whole[p.full + i]) > relative * gmax) {
        ++bad;
        ADD_FAILURE() << where << "gradient at full offset " << p.full + i << ": "
                      << shard[p.shard + i] << " vs " << whole[p.full + i] << " (max |g| " << gmax
                      << ")";
      }
}

}  // namespace shardlm::test
