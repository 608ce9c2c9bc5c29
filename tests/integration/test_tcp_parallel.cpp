// The TCP world (no MPI): ranks started by `shardlm launch` train the tiny model with ZeRO-3,
// tensor parallelism, Ulysses and ring context parallelism, a pipeline, and device tensors
// staged through the TCP world (parallel.device_comm = "host"), each following the one-rank run
// of the same global batch as the MPI runs of the other equivalence suites do; every rank's plan
// equals its ledger. And the launcher: the first failing rank's exit code is the job's.
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

struct Case {
  int ranks, micro, accum;
  const char* name;
  std::string sets;
};

class TcpWorld : public ::testing::Test {
 protected:
  void SetUp() override {
    shardlm::test::multi_rank_launch() = shardlm::test::MultiRankLaunch::kShardlmLaunch;
  }
  void TearDown() override {
    shardlm::test::multi_rank_launch() = shardlm::test::MultiRankLaunch::kMpiexec;
  }

  // Runs each case through `shardlm launch` and compares it with `one`.
  static void expect_cases_follow(const fs::path& one, int steps, const std::vector<Case>& cases,
                                  const std::string& common = "") {
    for (const Case& c : cases) {
      SCOPED_TRACE(c.name);
      const fs::path run =
          shardlm::test::train_tiny(c.ranks, c.micro, c.accum, std::string("shardlm_tcp_") + c.name,
                                    steps, true, common + c.sets);
      expect_follows(run, one, steps);
      for (int r = 0; r < c.ranks; ++r) {
        const json mem = json::parse(slurp(run / ("memory_rank" + std::to_string(r) + ".json")));
        EXPECT_EQ(mem["peak_by_category"], mem["planned"]["peak_by_category"]) << "rank " << r;
        EXPECT_EQ(mem["host_peak_by_category"], mem["planned"]["host_peak_by_category"])
            << "rank " << r;
      }
      EXPECT_NE(slurp(run.parent_path() / "out.txt").find("ranks over TCP"), std::string::npos)
          << slurp(run.parent_path() / "out.txt");
    }
  }
};

TEST_F(TcpWorld, ZeroTensorAndContextParallelismFollowOneRank) {
  const int steps = 10;
  const fs::path one = shardlm::test::train_tiny(1, 4, 2, "shardlm_tcp_one", steps);
  ASSERT_EQ(metric_series(one, "loss").size(), size_t(steps));
  expect_cases_follow(
      one, steps,
      {Case{2, 2, 2, "z3", "--set zero.stage=3 --set zero.reduce_bucket_bytes=60000"},
       Case{2, 4, 2, "tp2", "--set parallel.tp=2"},
       Case{2, 4, 2, "ulysses2", "--set parallel.cp=2 --set parallel.cp_kind=ulysses"},
       Case{2, 4, 2, "ring2", "--set parallel.cp=2 --set parallel.cp_kind=ring"},
       Case{2, 2, 2, "z3_host_staged",
            "--set zero.stage=3 --set parallel.device_comm=host "
            "--set parallel.device_comm_staging_kib=8"}});
}

// Pipeline stages send activations ahead and block in receives: the progress thread moves the
// sends while a rank waits elsewhere. The pipeline suite's model (4 layers, 4 kv heads).
TEST_F(TcpWorld, PipelineFollowsOneRank) {
  const int steps = 4;
  const std::string& model = shardlm::test::kPipelineModel;
  const fs::path one = shardlm::test::train_tiny(1, 1, 8, "shardlm_tcp_pp_one", steps, true, model);
  ASSERT_EQ(metric_series(one, "loss").size(), size_t(steps));
  expect_cases_follow(one, steps, {Case{2, 1, 8, "pp2", "--set parallel.pp=2"}}, model);
}

// A config error on every rank: the job exits with the error's code (2), not 0 or a signal's.
TEST_F(TcpWorld, LaunchExitsWithTheFirstFailuresCode) {
  const fs::path dir = shardlm::test::scratch_root() / "shardlm_tcp_launch_error";
  fs::create_directories(dir);
  const int code = shardlm::test::run_shardlm(
      2,
      " train --config " + std::string(SHARDLM_SOURCE_DIR) +
          "/configs/demo.json --set data.train=" + shardlm::test::kTinyCorpus +
          " --set parallel.tp=3 --set log.dir=" + (dir / "run").string(),
      dir / "out.txt");
  EXPECT_EQ(code, 2) << slurp(dir / "out.txt");
  EXPECT_NE(slurp(dir / "out.txt").find("parallel.tp"), std::string::npos)
      << slurp(dir / "out.txt");
}

}  // namespace
