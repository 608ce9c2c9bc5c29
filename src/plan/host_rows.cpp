// The plan's host bytes of what the trainer holds outside its buffers, from sizes (plan.h): a
// preference objective's host rows, the data sets and their sources, DPO's reference tables.
#include "shardlm/plan/plan.h"

namespace shardlm {

int64_t preference_host_bytes(int64_t B, int64_t T, int64_t Tl, int64_t runner_pair_lists) {
  const int64_t local = B * Tl, row = B * T;
  const int64_t list = max_micro_batch_pairs(B, T) * kPreferencePairBytes;
  // the runner: row positions, pair lists; the evaluation: logps, at row positions, targets,
  // row positions, a pair list
  return local * 8 + runner_pair_lists * list + local * 8 + row * 8 + row * 4 + local * 8 + list;
}

int64_t data_set_host_bytes(const DataSetSizes& set) {
  int64_t bytes = (set.seq_len + 1) * (4 + 1);  // fill scratch: tokens, mask
  if (set.samples) {
    bytes += set.windows * 8 * 2;                     // each window's tokens and targets
    bytes += (set.windows + 1) * 8 + set.placed * 8;  // the windows' items
    if (set.paired) bytes += set.documents / 2 * 8;   // each pair's kept length
  } else if (set.window_targets) {
    bytes += set.windows * 8;
  }
  return bytes;
}

int64_t memory_source_host_bytes(int64_t tokens, int64_t documents, bool masked) {
  return tokens * (4 + (masked ? 1 : 0)) + documents * 8;
}

int64_t corpus_source_host_bytes(int64_t documents, int64_t shards) {
  return documents * 8 + shards * 8;
}

}  // namespace shardlm
