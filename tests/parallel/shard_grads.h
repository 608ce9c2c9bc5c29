// Comparing a shard's gradients with the single-rank model's, piece by piece (ShardPiece maps
// each element of the shard's arena to the whole arena): every element within 2e-5 of the
// whole gradient's largest magnitude; the first five misses are reported. Tests only.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "shardlm/model/tensor_shard.h"

namespace shardlm::test {

// shard [shard arena] and whole [whole_total] f32 host gradients; where: prefixed to messages.
inline void expect_pieces_match(const std::vector<ShardPiece>& pieces, const float* shard,
                                const float* whole, int64_t whole_total,
                                const std::string& where = "") {
  float gmax = 0;
  for (int64_t i = 0; i < whole_total; ++i) gmax = std::max(gmax, std::abs(whole[i]));
  int bad = 0;
  for (const ShardPiece& p : pieces)
    for (int64_t i = 0; i < p.count && bad < 5; ++i)
      if (std::abs(shard[p.shard + i] - whole[p.full + i]) > 2e-5f * gmax) {
        ++bad;
        ADD_FAILURE() << where << "gradient at full offset " << p.full + i << ": "
                      << shard[p.shard + i] << " vs " << whole[p.full + i] << " (max |g| " << gmax
                      << ")";
      }
}

}  // namespace shardlm::test
