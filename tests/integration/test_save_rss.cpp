// Resident memory across checkpoint saves, measured by the kernel: each rank's peak resident
// set over a run (VmHWM, memory_rank*.json's host_peak_rss_bytes) against the plan's peak. On
// the CPU backend every byte the ledger holds is resident (test_memory_rss), so the peak minus
// the planned device and host peaks is the runtime's own memory (code, libraries, MPI, the data
// loader). Runs that save synchronously and asynchronously (checkpoint.async) on 1 and 2 ranks
// show the same runtime memory as the run that never saves, within kSlack: a save holds no more
// than the plan's staging buffer or snapshot, where gathering a state vector (50 MiB here) on
// one rank would show as that much more.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "integration/tiny_runs.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using shardlm::test::slurp;

constexpr int64_t kMiB = int64_t(1) << 20;
// Page rounding, allocator bins and the checkpoint writer's file handles and manifest text.
constexpr int64_t kSlack = 8 * kMiB;

// A model of dim 512 with 4 layers (12.9M parameters: 49 MiB a state vector in f32), 4 steps.
// Returns each rank's peak resident set minus its planned device and host peaks.
std::vector<int64_t> runtime_memory(int ranks, const std::string& name, const std::string& sets) {
  const fs::path run = shardlm::test::train_tiny(
      ranks, 1, 2 / ranks, "shardlm_save_rss_" + name, 4, true,
      "--set model.dim=512 --set model.n_heads=8 --set model.n_kv_heads=8 "
      "--set model.ffn_dim=1536 --set model.n_layers=4 --set zero.stage=3 " +
          sets);
  std::vector<int64_t> runtime;
  for (int r = 0; r < ranks; ++r) {
    const json mem = json::parse(slurp(run / ("memory_rank" + std::to_string(r) + ".json")));
    const json& planned = mem["planned"]["peak_bytes"];
    const int64_t peak = mem["host_peak_rss_bytes"].get<int64_t>();
    EXPECT_GT(peak, 0) << name << " rank " << r;
    runtime.push_back(peak - planned["device"].get<int64_t>() - planned["host"].get<int64_t>());
    ::testing::Test::RecordProperty(
        name + "_rank" + std::to_string(r),
        std::to_string(peak) + " peak rss, " + std::to_string(runtime.back()) + " beyond the plan");
  }
  return runtime;
}

TEST(SaveRss, ASaveHoldsNoMoreThanThePlanSays) {
  for (int ranks : {1, 2}) {
    SCOPED_TRACE(std::to_string(ranks) + " ranks");
    const std::string n = std::to_string(ranks);
    const std::vector<int64_t> none = runtime_memory(
        ranks, "none" + n, "--set checkpoint.every_steps=0 --set checkpoint.at_end=false");
    const std::vector<int64_t> sync =
        runtime_memory(ranks, "sync" + n, "--set checkpoint.every_steps=2");
    const std::vector<int64_t> async = runtime_memory(
        ranks, "async" + n, "--set checkpoint.every_steps=2 --set checkpoint.async=true");
    for (int r = 0; r < ranks; ++r) {
      SCOPED_TRACE("rank " + std::to_string(r));
      EXPECT_GT(none[r], 0);           // the plan never claims more than is resident
      EXPECT_LT(none[r], 256 * kMiB);  // and the rest is a runtime's, not a model's
      EXPECT_LE(sync[r] - none[r], kSlack) << sync[r] / kMiB << " against " << none[r] / kMiB;
      EXPECT_LE(async[r] - none[r], kSlack) << async[r] / kMiB << " against " << none[r] / kMiB;
    }
  }
}

}  // namespace
