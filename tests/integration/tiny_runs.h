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

#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/config/config.h"
#include "shardlm/model/layout.h"
#include "test_util.h"
#include "tolerance.h"

namespace shardlm::test {

inline const std::string kTinyCorpus =
    std::string(SHARDLM_SOURCE_DIR) + "/tests/data/genesis_1_12.txt";

// Writes preference records cut from the tiny corpus, short enough that a pair fits a 64-token
// row, to scratch_root() / file_name (a name of each test binary's own: ctest runs several at
// once) and returns the path.
inline std::filesystem::path write_pairs_file(const std::string& file_name) {
  const std::filesystem::path p = scratch_root() / file_name;
  std::vector<std::string> lines;
  std::ifstream in(kTinyCorpus);
  for (std::string l; std::getline(in, l);)
    if (l.size() > 40) lines.push_back(l);
  std::ofstream out(p);
  for (size_t i = 0; i < 64; ++i) {
    const std::string& a = lines[i % lines.size()];
    const std::string& b = lines[(i * 7 + 3) % lines.size()];
    const std::string& c = lines[(i * 5 + 1) % lines.size()];
    // Completions open with a space, as TRL's text pairs usually do.
    const std::string chosen = b.substr(0, 6 + i % 11), rejected = c.substr(0, 5 + i % 7);
    const nlohmann::json record = {{"prompt", a.substr(0, 8 + i % 9)},
                                   {"chosen", std::string(1, ' ').append(chosen)},
                                   {"rejected", std::string(1, ' ').append(rejected)}};
    out << record.dump() << "\n";
  }
  return p;
}

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

// AdamW's eps in the tiny runs: above the gradients' small elements, so that the weights of two
// runs that sum in other orders stay within a bound (tests/tolerance.h).
inline const std::string kBoundedAdamEps = "1e-2";

// Trains a 2-layer tiny model (demo config, T = 64, AdamW eps kBoundedAdamEps) to `steps` with
// `ranks` processes in scratch_root()/name and returns its run directory. fresh = false continues
// the run already there (train.resume = auto). `extra`: more --set options.
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
      " --set sample.count=0 --set checkpoint.every_steps=10 --set train.eps=" + kBoundedAdamEps +
      " --set train.micro_batch=" + std::to_string(micro_batch) +
      " --set train.grad_accum=" + std::to_string(grad_accum) +
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

// What a run may differ by from the one-rank run `one` of the same global batch, which sums in
// another order (tests/tolerance.h), from `one`'s resolved configuration (summary.json) and
// gradient norms: losses relative, final weights absolute after its AdamW steps. `bf16`: both
// store activations (and working weights) in bf16, which a sum in another order may round the
// other way, averaged over the step's tokens.
struct FollowBounds {
  double relative;       // losses, evaluation losses
  double norm_relative;  // gradient norms: their elements, then the sum of their squares
  double weights;        // the largest weight difference after the run's steps
};

inline FollowBounds follow_bounds(const std::filesystem::path& one, bool bf16 = false) {
  const nlohmann::json summary = nlohmann::json::parse(slurp(one / "summary.json"));
  const RunConfig cfg = parse_run_config(summary["config"].dump(), {}, one.string());
  const int64_t rows = cfg.train.micro_batch * cfg.train.grad_accum;
  double relative = reorder_tolerance(reduction_chain(cfg.model, cfg.data.seq_len, rows));
  if (bf16)
    relative += bf16_mean_tolerance(bf16_stores_per_token(cfg.model), rows * cfg.data.seq_len);
  // Every gradient element is at most the (clipped) global norm; clipping scales the gradients
  // by a factor computed from the norm, which doubles their relative bound.
  double largest_norm = 0;
  const std::vector<double> norms = metric_series(one, "grad_norm");
  for (double n : norms) largest_norm = std::max(largest_norm, n);
  double grad_bound = relative * largest_norm;
  if (cfg.train.grad_clip > 0 && largest_norm > cfg.train.grad_clip)
    grad_bound = 2 * relative * cfg.train.grad_clip;
  const int steps = int(norms.size());
  const double lipschitz =
      adamw_lipschitz(cfg.train.lr, cfg.train.eps, cfg.train.beta1, cfg.train.beta2, steps);
  const int64_t params = make_param_layout(cfg.model).total;
  return {relative, relative + gamma_n(DType::kF32, params),
          weight_bound(lipschitz, grad_bound, steps)};
}

// The final weights (checkpoint of `step`: the parameters, or a LoRA run's adapters) of `run`
// and of the one-rank run `one` differ by at most `bound` (follow_bounds' weights).
inline void expect_same_weights(const std::filesystem::path& run, const std::filesystem::path& one,
                                int step, double bound) {
  const std::vector<float> w = checkpoint_params(run, step), ref_w = checkpoint_params(one, step);
  ASSERT_FALSE(ref_w.empty());
  ASSERT_EQ(w.size(), ref_w.size());
  double worst = 0;
  for (size_t i = 0; i < w.size(); ++i) worst = std::max(worst, double(std::abs(w[i] - ref_w[i])));
  EXPECT_LE(worst, bound) << "largest weight difference (of " << bound << " allowed)";
}

// `run` followed the one-rank run `one` (same global batch): the same losses, evaluation losses
// and final weights, within follow_bounds.
inline void expect_follows(const std::filesystem::path& run, const std::filesystem::path& one,
                           int steps) {
  const FollowBounds bound = follow_bounds(one);
  const double tol = bound.relative;
  const std::vector<double> ref = metric_series(one, "loss"), got = metric_series(run, "loss");
  ASSERT_EQ(got.size(), ref.size());
  for (size_t i = 0; i < ref.size(); ++i)
    EXPECT_NEAR(got[i], ref[i], tol * std::abs(ref[i])) << "step " << i + 1;
  const std::vector<double> ref_eval = metric_series(one, "eval_loss"),
                            got_eval = metric_series(run, "eval_loss");
  ASSERT_EQ(got_eval.size(), ref_eval.size());
  for (size_t i = 0; i < ref_eval.size(); ++i)
    EXPECT_NEAR(got_eval[i], ref_eval[i], tol * std::abs(ref_eval[i]));
  expect_same_weights(run, one, steps, bound.weights);
}

// The gradient norms of `run`, step by step, as the one-rank run `one`'s within follow_bounds.
inline void expect_same_norms(const std::filesystem::path& run, const std::filesystem::path& one) {
  const double tol = follow_bounds(one).norm_relative;
  const std::vector<double> norm = metric_series(run, "grad_norm"),
                            ref_norm = metric_series(one, "grad_norm");
  ASSERT_EQ(norm.size(), ref_norm.size());
  for (size_t i = 0; i < norm.size(); ++i)
    EXPECT_NEAR(norm[i], ref_norm[i], tol * ref_norm[i]) << "gradient norm, step " << i + 1;
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
// losses of steps from + 1 .. steps and, with `weights`, the final weights, within follow_bounds.
inline void expect_continues(const std::filesystem::path& run, const std::filesystem::path& one,
                             int from, int steps, bool weights = true) {
  const std::vector<double> ref = metric_series(one, "loss"), got = metric_series(run, "loss");
  ASSERT_EQ(got.size(), size_t(steps));
  ASSERT_EQ(ref.size(), size_t(steps));
  const FollowBounds bound = follow_bounds(one);
  for (size_t i = size_t(from); i < size_t(steps); ++i)
    EXPECT_NEAR(got[i], ref[i], bound.relative * std::abs(ref[i])) << "step " << i + 1;
  if (weights) expect_same_weights(run, one, steps, bound.weights);
}

}  // namespace shardlm::test
