// Runs of the tiny demo model through the binary, alone, under mpiexec or through `shardlm
// launch`, and the comparison of a parallel run with the one-rank run of the same global batch,
// from the start or after a resume on another grid: what the data-, tensor-, context- and
// pipeline-parallel integration tests share. Tests only; needs SHARDLM_BINARY, SHARDLM_MPIEXEC
// and SHARDLM_SOURCE_DIR from CMake.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <fmt/format.h>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardlm/train/checkpoint.h"
#include "test_util.h"

namespace shardlm::test {

inline const std::string kTinyCorpus =
    std::string(SHARDLM_SOURCE_DIR) + "/tests/data/genesis_1_12.txt";

// The pipeline suites' model (with train_tiny's): 4 layers, dim 64, 4 heads and kv heads (so
// that tp = 4 divides them), a checkpoint every 2 steps, gradients clipped.
inline const std::string kPipelineModel =
    "--set model.n_layers=4 --set model.dim=64 --set model.ffn_dim=128 "
    "--set model.n_kv_heads=4 --set checkpoint.every_steps=2 --set train.grad_clip=1 ";

// How run_shardlm starts several ranks: under mpiexec (the MPI world), or through `shardlm
// launch` (the TCP world, no MPI). A test suite sets it once, before its runs.
enum class MultiRankLaunch { kMpiexec, kShardlmLaunch };
inline MultiRankLaunch& multi_rank_launch() {
  static MultiRankLaunch launch = MultiRankLaunch::kMpiexec;
  return launch;
}

// Runs `shardlm <args>` as `ranks` processes (mpiexec or `shardlm launch` when more than one),
// its output into `out`; returns the exit code (-1 when it did not exit normally).
inline int run_shardlm(int ranks, const std::string& args, const std::filesystem::path& out) {
  // One thread per rank: 4 ranks share this machine's cores. CI runs as root, which Open MPI
  // refuses unless told; the variables are harmless for other users.
  std::string cmd = "OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ";
  if (ranks == 1)
    cmd += std::string(SHARDLM_BINARY) + args;
  else if (multi_rank_launch() == MultiRankLaunch::kShardlmLaunch)
    cmd += std::string(SHARDLM_BINARY) + " launch --nproc " + std::to_string(ranks) + " --" + args;
  else
    cmd += shardlm::test::mpiexec() + " -n " + std::to_string(ranks) +
           " --oversubscribe --mca mpi_yield_when_idle 1 --bind-to none " + SHARDLM_BINARY + args;
  cmd += " > " + out.string() + " 2>&1";
  const int status = std::system(cmd.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Trains a 2-layer tiny model (demo config, T = 64) to `steps` with `ranks` processes in
// scratch_root()/name and returns its run directory. fresh = false continues the run already
// there (train.resume = auto). `extra`: more --set options.
inline std::filesystem::path train_tiny(int ranks, int micro_batch, int grad_accum,
                                        const std::string& name, int steps = 20, bool fresh = true,
                                        const std::string& extra = "") {
  namespace fs = std::filesystem;
  const fs::path dir = scratch_root() / name;
  if (fresh) fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string args =
      " train --config " + std::string(SHARDLM_SOURCE_DIR) + "/configs/demo.json" +
      " --set data.train=" + kTinyCorpus + " --set data.seq_len=64 --set model.n_layers=2" +
      " --set train.max_steps=" + std::to_string(steps) +
      " --set train.eval_every=10 --set train.eval_batches=0" +
      " --set sample.count=0 --set checkpoint.every_steps=10 --set train.micro_batch=" +
      std::to_string(micro_batch) + " --set train.grad_accum=" + std::to_string(grad_accum) +
      " --set log.dir=" + (dir / "run").string() + " " + extra;
  const int code = run_shardlm(ranks, args, dir / "out.txt");
  EXPECT_EQ(code, 0) << slurp(dir / "out.txt");
  return dir / "run";
}

// The values of `key` in metrics.jsonl, in order ("loss": the training steps' only).
inline std::vector<double> metric_series(const std::filesystem::path& run, const char* key) {
  std::vector<double> v;
  std::ifstream f(run / "metrics.jsonl");
  for (std::string line; std::getline(f, line);) {
    const nlohmann::json m = nlohmann::json::parse(line);
    if (m.contains(key) && (std::string(key) != "loss" || m.contains("grad_norm")))
      v.push_back(m[key].get<double>());
  }
  return v;
}

// The bytes of a whole state vector ("params", "adam_m", ...) of the checkpoint at `step`,
// from whichever rank's files hold its ranges.
inline std::string checkpoint_vector(const std::filesystem::path& run, int step,
                                     const std::string& name) {
  const CheckpointReader r((run / "checkpoints" / fmt::format("step_{:08d}", step)).string());
  std::string bytes(r.vector_bytes(name), '\0');
  r.read_vector(name, 0, bytes.data(), bytes.size());
  return bytes;
}

// The whole parameter vector of the checkpoint at `step` (its bytes as f32 words).
inline std::vector<float> checkpoint_params(const std::filesystem::path& run, int step = 20) {
  const std::string bytes = checkpoint_vector(run, step, "params");
  std::vector<float> p(bytes.size() / 4);
  std::memcpy(p.data(), bytes.data(), p.size() * 4);
  return p;
}

// The final weights (checkpoint of `step`) of `run` and of the one-rank run `one` agree to 2e-4.
inline void expect_same_weights(const std::filesystem::path& run, const std::filesystem::path& one,
                                int step) {
  const std::vector<float> w = checkpoint_params(run, step), ref_w = checkpoint_params(one, step);
  ASSERT_FALSE(ref_w.empty());
  ASSERT_EQ(w.size(), ref_w.size());
  double worst = 0;
  for (size_t i = 0; i < w.size(); ++i) worst = std::max(worst, double(std::abs(w[i] - ref_w[i])));
  EXPECT_LT(worst, 2e-4) << "largest weight difference";
}

// `run` followed the one-rank run `one` (same global batch): the same losses, evaluation losses
// and final weights. fp32 sums in a different order (per-rank partial gradients, then the
// all-reduce): agreement to ~1e-4 relative over 20 steps of Adam.
inline void expect_follows(const std::filesystem::path& run, const std::filesystem::path& one,
                           int steps) {
  const std::vector<double> ref = metric_series(one, "loss"), got = metric_series(run, "loss");
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i)
    EXPECT_NEAR(got[i], ref[i], 2e-4 * std::abs(ref[i])) << "step " << i + 1;
  const std::vector<double> ref_eval = metric_series(one, "eval_loss"),
                            got_eval = metric_series(run, "eval_loss");
  ASSERT_EQ(got_eval.size(), ref_eval.size());
  for (size_t i = 0; i < ref_eval.size(); ++i)
    EXPECT_NEAR(got_eval[i], ref_eval[i], 2e-4 * std::abs(ref_eval[i]));
  expect_same_weights(run, one, steps);
}

// Rewinds a finished run to its checkpoint of step `keep`, as if it had stopped there: the
// checkpoint of step `last` is removed and `latest` points back, so that the next
// train_tiny(fresh = false) resumes from step `keep` (needs checkpoint.every_steps to hit it).
inline void rewind_run(const std::filesystem::path& run, int keep, int last) {
  const std::filesystem::path ck = run / "checkpoints";
  ASSERT_TRUE(std::filesystem::exists(ck / fmt::format("step_{:08d}", keep)))
      << "needs a checkpoint at step " << keep;
  std::filesystem::remove_all(ck / fmt::format("step_{:08d}", last));
  std::ofstream(ck / "latest") << fmt::format("step_{:08d}", keep) << "\n";
}

// `run`, resumed at step `from`, continued as the uninterrupted one-rank run `one` does: the
// losses of steps from + 1 .. steps within 2e-4 relative and, with `weights`, the final weights.
inline void expect_continues(const std::filesystem::path& run, const std::filesystem::path& one,
                             int from, int steps, bool weights = true) {
  const std::vector<double> ref = metric_series(one, "loss"), got = metric_series(run, "loss");
  ASSERT_EQ(got.size(), size_t(steps));
  ASSERT_EQ(ref.size(), size_t(steps));
  for (size_t i = size_t(from); i < size_t(steps); ++i)
    EXPECT_NEAR(got[i], ref[i], 2e-4 * std::abs(ref[i])) << "step " << i + 1;
  if (weights) expect_same_weights(run, one, steps);
}

}  // namespace shardlm::test
