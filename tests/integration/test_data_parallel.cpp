// Data parallelism through the binary under mpiexec: N ranks with the same global batch as one
// rank (micro-batch x accumulation x ranks held equal) give the same losses and final weights
// within fp32 tolerance; every rank writes its memory report; rank 0 alone writes the rest.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "test_util.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kBinary = SHARDLM_BINARY;
const std::string kMpiexec = SHARDLM_MPIEXEC;
const std::string kCorpus = std::string(SHARDLM_SOURCE_DIR) + "/tests/data/genesis_1_12.txt";

using shardlm::test::slurp;

// Trains a 2-layer tiny model to `steps` with `ranks` processes; returns the run directory.
// fresh = false continues the run already in that directory (train.resume = auto).
fs::path train(int ranks, int micro_batch, int grad_accum, const std::string& name, int steps = 20,
               bool fresh = true) {
  const fs::path dir = fs::temp_directory_path() / ("shardlm_dp_" + name);
  if (fresh) fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string args =
      " train --config " + std::string(SHARDLM_SOURCE_DIR) + "/configs/demo.json" +
      " --set data.train=" + kCorpus + " --set data.seq_len=64 --set model.n_layers=2" +
      " --set train.max_steps=" + std::to_string(steps) +
      " --set train.eval_every=10 --set train.eval_batches=0" +
      " --set sample.count=0 --set checkpoint.every_steps=10 --set train.micro_batch=" +
      std::to_string(micro_batch) + " --set train.grad_accum=" + std::to_string(grad_accum) +
      " --set log.dir=" + (dir / "run").string();
  // One thread per rank: 4 ranks share this machine's cores. CI runs as root, which Open MPI
  // refuses unless told; the variables are harmless for other users.
  std::string cmd = "OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ";
  cmd += ranks == 1
             ? kBinary + args
             : kMpiexec + " -n " + std::to_string(ranks) +
                   " --oversubscribe --mca mpi_yield_when_idle 1 --bind-to none " + kBinary + args;
  cmd += " > " + (dir / "out.txt").string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << slurp(dir / "out.txt");
  return dir / "run";
}

std::vector<double> losses(const fs::path& run, const char* key) {
  std::vector<double> v;
  std::ifstream f(run / "metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    const json m = json::parse(line);
    if (m.contains(key) && (std::string(key) != "loss" || m.contains("grad_norm")))
      v.push_back(m[key].get<double>());
  }
  return v;
}

std::vector<float> final_params(const fs::path& run) {
  const std::string bytes = slurp(run / "checkpoints" / "step_00000020" / "params.bin");
  std::vector<float> p(bytes.size() / 4);
  std::memcpy(p.data(), bytes.data(), p.size() * 4);
  return p;
}

TEST(DataParallel, MatchesOneRankWithTheSameGlobalBatch) {
  const fs::path one = train(1, 4, 2, "n1");  // 8 sequences per step
  const std::vector<double> ref = losses(one, "loss");
  const std::vector<double> ref_eval = losses(one, "eval_loss");
  const std::vector<float> ref_w = final_params(one);
  ASSERT_EQ(ref.size(), 20u);
  ASSERT_FALSE(ref_w.empty());
  struct Case {
    int ranks, micro, accum;
  };
  for (const Case c : {Case{2, 2, 2}, Case{2, 4, 1}, Case{4, 2, 1}}) {
    SCOPED_TRACE(::testing::Message() << c.ranks << " ranks x " << c.micro << " x " << c.accum);
    const fs::path run = train(c.ranks, c.micro, c.accum,
                               "n" + std::to_string(c.ranks) + "_" + std::to_string(c.accum));
    const std::vector<double> got = losses(run, "loss");
    ASSERT_EQ(got.size(), ref.size());
    // fp32 sums in a different order (per-rank partial gradients, then the all-reduce):
    // agreement to ~1e-4 relative over 20 steps of Adam.
    for (size_t i = 0; i < ref.size(); ++i)
      EXPECT_NEAR(got[i], ref[i], 2e-4 * std::abs(ref[i])) << "step " << i + 1;
    const std::vector<double> got_eval = losses(run, "eval_loss");
    ASSERT_EQ(got_eval.size(), ref_eval.size());
    for (size_t i = 0; i < ref_eval.size(); ++i)
      EXPECT_NEAR(got_eval[i], ref_eval[i], 2e-4 * std::abs(ref_eval[i]));
    const std::vector<float> w = final_params(run);
    ASSERT_EQ(w.size(), ref_w.size());
    double worst = 0;
    for (size_t i = 0; i < w.size(); ++i)
      worst = std::max(worst, double(std::abs(w[i] - ref_w[i])));
    EXPECT_LT(worst, 2e-4) << "largest weight difference";
    for (int r = 0; r < c.ranks; ++r) {
      const json mem = json::parse(slurp(run / ("memory_rank" + std::to_string(r) + ".json")));
      EXPECT_EQ(mem["rank"].get<int>(), r);
      EXPECT_GT(mem["peak_by_category"]["params"].get<int64_t>(), 0);
    }
    EXPECT_TRUE(fs::exists(run / "summary.json"));
  }
}

TEST(DataParallel, ACheckpointResumesUnderAnotherRankCount) {
  // The learning-rate schedule depends on the total step count, so every run aims at 20 steps;
  // the 4-rank run is "stopped" at step 10 by rewinding it to its step-10 checkpoint.
  const fs::path one = train(1, 4, 2, "r1");
  const std::vector<double> ref = losses(one, "loss");
  ASSERT_EQ(ref.size(), 20u);
  const fs::path four = train(4, 2, 1, "r4");
  // Rewind the 4-rank run to its step-10 state: drop later checkpoints and point latest back.
  const fs::path ck = four / "checkpoints";
  ASSERT_TRUE(fs::exists(ck / "step_00000010")) << "needs checkpoint.every_steps=10";
  fs::remove_all(ck / "step_00000020");
  std::ofstream(ck / "latest") << "step_00000010\n";
  const fs::path two = train(2, 2, 2, "r4", 20, /*fresh=*/false);
  const std::vector<double> got = losses(two, "loss");
  ASSERT_EQ(got.size(), 20u);
  for (size_t i = 10; i < 20; ++i)
    EXPECT_NEAR(got[i], ref[i], 2e-4 * std::abs(ref[i])) << "step " << i + 1;
}

}  // namespace
