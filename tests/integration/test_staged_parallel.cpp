// parallel.device_comm = "mpi" on the CPU: every parallel strategy with its device tensors
// staged through a tiny host buffer (8 KiB per rank: 1 KiB slots, so every collective and
// transfer runs in many chunks) follows the one-rank run of the same global batch, as the
// plain MPI runs of test_data_parallel, test_tensor_parallel and test_pipeline_parallel do;
// the staging buffer is in the ledger and the plan (host pool, category comm).
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "integration/tiny_runs.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

using shardlm::test::expect_follows;
using shardlm::test::metric_series;
using shardlm::test::slurp;

const std::string kStaged =
    " --set parallel.device_comm=mpi --set parallel.device_comm_staging_kib=8 ";

struct Case {
  int ranks, micro, accum;
  const char* name;
  std::string sets;
};

// Runs each case staged and compares it with `one`; every rank's plan equals its ledger, the
// staging buffer included.
void expect_cases_follow(const fs::path& one, int steps, const std::vector<Case>& cases,
                         const std::string& common = "") {
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path run = shardlm::test::train_tiny(c.ranks, c.micro, c.accum,
                                                   std::string("shardlm_staged_") + c.name, steps,
                                                   true, common + kStaged + c.sets);
    expect_follows(run, one, steps);
    for (int r = 0; r < c.ranks; ++r) {
      const json mem = json::parse(slurp(run / ("memory_rank" + std::to_string(r) + ".json")));
      EXPECT_EQ(mem["peak_by_category"], mem["planned"]["peak_by_category"]) << "rank " << r;
      EXPECT_EQ(mem["host_peak_by_category"], mem["planned"]["host_peak_by_category"])
          << "rank " << r;
      EXPECT_GE(mem["host_peak_by_category"]["comm"].get<int64_t>(), 8192) << "rank " << r;
    }
    EXPECT_NE(slurp(run.parent_path() / "out.txt").find("device tensors staged through 8.0 KiB"),
              std::string::npos);
  }
}

TEST(StagedComm, ZeroStagesAndContextParallelismFollowOneRank) {
  const int steps = 4;  // every collective of each case runs every step
  const fs::path one = shardlm::test::train_tiny(1, 4, 2, "shardlm_staged_one", steps);
  ASSERT_EQ(metric_series(one, "loss").size(), size_t(steps));
  expect_cases_follow(
      one, steps,
      {Case{2, 2, 2, "z0", "--set zero.stage=0"}, Case{2, 2, 2, "z1", "--set zero.stage=1"},
       Case{2, 2, 2, "z2", "--set zero.stage=2 --set zero.reduce_bucket_bytes=60000"},
       Case{2, 2, 2, "z3", "--set zero.stage=3 --set zero.reduce_bucket_bytes=60000"},
       Case{2, 2, 2, "z3_offload",
            "--set zero.stage=3 --set zero.offload_optimizer=cpu --set zero.offload_params=cpu"},
       Case{2, 4, 2, "ulysses2", "--set parallel.cp=2 --set parallel.cp_kind=ulysses"},
       Case{2, 4, 2, "ring2", "--set parallel.cp=2 --set parallel.cp_kind=ring"},
       Case{2, 4, 2, "tp2", "--set parallel.tp=2"},
       Case{4, 4, 1, "dp2_cp2_ring_z3",
            "--set parallel.cp=2 --set parallel.cp_kind=ring --set zero.stage=3"}});
}

// Pipeline stages send activations ahead and block in receives: the staged sends must advance
// while a rank waits elsewhere. The pipeline suite's model (4 layers, 4 kv heads), 4 steps.
TEST(StagedComm, PipelineAndTheGridFollowOneRank) {
  const int steps = 4;
  const std::string& model = shardlm::test::kPipelineModel;
  const fs::path one =
      shardlm::test::train_tiny(1, 1, 8, "shardlm_staged_pp_one", steps, true, model);
  ASSERT_EQ(metric_series(one, "loss").size(), size_t(steps));
  expect_cases_follow(
      one, steps,
      {Case{2, 1, 8, "pp2", "--set parallel.pp=2"},
       Case{4, 1, 8, "pp2_tp2_z1", "--set parallel.pp=2 --set parallel.tp=2 --set zero.stage=1"}},
      model);
}

TEST(StagedComm, ConfigErrorsNameTheKey) {
  const fs::path dir = shardlm::test::scratch_root() / "shardlm_staged_errors";
  fs::create_directories(dir);
  auto run = [&](const std::string& extra) {
    const int code = shardlm::test::run_shardlm(
        1,
        " train --config " + std::string(SHARDLM_SOURCE_DIR) + "/configs/demo.json --set " +
            "data.train=" + shardlm::test::kTinyCorpus +
            " --set log.dir=" + (dir / "run").string() + " " + extra,
        dir / "out.txt");
    EXPECT_EQ(code, 2) << extra;
    return slurp(dir / "out.txt");
  };
  EXPECT_NE(run("--set parallel.device_comm=gloo").find("parallel.device_comm"), std::string::npos);
  EXPECT_NE(
      run("--set parallel.device_comm_staging_kib=0").find("parallel.device_comm_staging_kib"),
      std::string::npos);
}

}  // namespace
