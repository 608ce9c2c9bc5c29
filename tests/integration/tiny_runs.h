// Runs of the tiny demo model through the binary, alone or under mpiexec, and the comparison of
// a parallel run with the one-rank run of the same global batch: what the data-, tensor- and
// context-parallel integration tests share. Tests only; needs SHARDLM_BINARY, SHARDLM_MPIEXEC
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

#include "test_util.h"

namespace shardlm::test {

inline const std::string kTinyCorpus =
    std::string(SHARDLM_SOURCE_DIR) + "/tests/data/genesis_1_12.txt";

// Runs `shardlm <args>` as `ranks` processes (mpiexec when more than one), its output into
// `out`; returns the exit code (-1 when it did not exit normally).
inline int run_shardlm(int ranks, const std::string& args, const std::filesystem::path& out) {
  // One thread per rank: 4 ranks share this machine's cores. CI runs as root, which Open MPI
  // refuses unless told; the variables are harmless for other users.
  std::string cmd = "OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ";
  cmd += ranks == 1 ? std::string(SHARDLM_BINARY) + args
                    : std::string(SHARDLM_MPIEXEC) + " -n " + std::to_string(ranks) +
                          " --oversubscribe --mca mpi_yield_when_idle 1 --bind-to none " +
                          SHARDLM_BINARY + args;
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

// The whole parameter vector of the checkpoint at `step`.
inline std::vector<float> checkpoint_params(const std::filesystem::path& run, int step = 20) {
  const std::string bytes =
      slurp(run / "checkpoints" / fmt::format("step_{:08d}", step) / "params.bin");
  std::vector<float> p(bytes.size() / 4);
  std::memcpy(p.data(), bytes.data(), p.size() * 4);
  return p;
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
  const std::vector<float> w = checkpoint_params(run, steps), ref_w = checkpoint_params(one, steps);
  ASSERT_FALSE(ref_w.empty());
  ASSERT_EQ(w.size(), ref_w.size());
  double worst = 0;
  for (size_t i = 0; i < w.size(); ++i) worst = std::max(worst, double(std::abs(w[i] - ref_w[i])));
  EXPECT_LT(worst, 2e-4) << "largest weight difference";
}

}  // namespace shardlm::test
