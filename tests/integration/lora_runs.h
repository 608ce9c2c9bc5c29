// The LoRA runs through the binary that the LoRA and QLoRA integration tests share: 6 steps of a
// 2-layer tiny model with adapters on every projection (checkpoints at steps 3 and 6), the check
// that a run followed the one-rank run (losses and final adapters), and the check that every
// rank's plan is its ledger. Tests only; needs what tiny_runs.h needs.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "integration/tiny_runs.h"

namespace shardlm::test::lora_runs {

struct LoraRun {
  int exit_code;
  std::filesystem::path dir;  // the run directory
  std::string out;
};

// 6 steps of a 2-layer tiny model with rank-4 adapters on every projection, `micro` sequences a
// micro-batch, in `scratch` (emptied first when `fresh`); `sets` (--set flags) come last.
inline LoraRun train_lora(int ranks, int micro, const std::filesystem::path& scratch,
                          const std::string& sets, bool fresh = true) {
  if (fresh) std::filesystem::remove_all(scratch);
  std::filesystem::create_directories(scratch);
  const std::string args =
      " train --config " + std::string(SHARDLM_SOURCE_DIR) + "/configs/demo.json" +
      " --set data.train=" + kTinyCorpus +
      " --set data.seq_len=32 --set model.n_layers=2 --set train.max_steps=6" +
      " --set train.lr=1e-2 --set train.warmup_steps=0 --set train.eval_every=0" +
      " --set train.eval_batches=2 --set sample.count=0 --set checkpoint.every_steps=3" +
      " --set lora.rank=4 --set lora.alpha=8 --set lora.targets=all" +
      " --set train.eps=" + kBoundedAdamEps + " --set train.micro_batch=" + std::to_string(micro) +
      " --set log.dir=" + (scratch / "run").string() + " " + sets;
  const int code = run_shardlm(ranks, args, scratch / "out.txt");
  return {code, scratch / "run", slurp(scratch / "out.txt")};
}

// Losses from step `first_step` on, and the final adapters, as the one-rank run's, within
// follow_bounds.
inline void expect_follows(const std::filesystem::path& run, const std::filesystem::path& one,
                           size_t first_step = 0) {
  const std::vector<double> ref = metric_series(one, "loss"), got = metric_series(run, "loss");
  ASSERT_EQ(got.size() + first_step, ref.size());
  const FollowBounds bound = follow_bounds(one);
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_NEAR(got[i], ref[i + first_step], bound.relative * std::abs(ref[i + first_step]))
        << "step " << i + first_step + 1;
  expect_same_weights(run, one, 6, bound.weights);  // the adapters of the last checkpoint
}

// Every rank's measured memory is its plan, category by category, on both pools.
inline void expect_plan_equals_ledger(const std::filesystem::path& run, int ranks) {
  for (int r = 0; r < ranks; ++r) {
    const nlohmann::json mem =
        nlohmann::json::parse(slurp(run / ("memory_rank" + std::to_string(r) + ".json")));
    EXPECT_EQ(mem["peak_by_category"], mem["planned"]["peak_by_category"]) << "rank " << r;
    EXPECT_EQ(mem["host_peak_by_category"], mem["planned"]["host_peak_by_category"])
        << "rank " << r;
  }
}

}  // namespace shardlm::test::lora_runs
