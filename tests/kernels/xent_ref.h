// The f64 reference of the fused LM head + cross-entropy's loss, shared by the whole-vocabulary
// (test_lm_head_loss) and vocabulary-slice (test_vocab_parallel) kernel tests. Tests only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "shardlm/backend/backend.h"

namespace shardlm::test {

// Sum over the rows whose target is not kIgnoreIndex of logsumexp(row) - row[target], in f64.
// logits [n, V]; targets [n].
inline double cross_entropy_sum_ref(const std::vector<double>& logits,
                                    const std::vector<int32_t>& targets, int64_t n, int64_t V) {
  double loss = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (targets[i] == kIgnoreIndex) continue;
    const double* row = &logits[i * V];
    const double mx = *std::max_element(row, row + V);
    double sum = 0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(row[j] - mx);
    loss += mx + std::log(sum) - row[targets[i]];
  }
  return loss;
}

}  // namespace shardlm::test
