// Tensor parallelism through the binary under mpiexec: parallel.tp = 2 and 4 (alone and with
// data parallelism over ZeRO stages 1 and 3) follow the one-rank run with the same global
// batch (losses, evaluation losses and the final weights of the whole model, which every
// checkpoint holds in the one-rank arena order); a checkpoint written under tp = 2 resumes
// under tp = 1 and one written under tp = 1 resumes under tp = 2. The tiny model has 4 heads
// and 4 kv heads here, so that tp = 4 divides them. The embeddings and head are
// vocabulary-parallel; a vocabulary tp does not divide is a config error (exit 2). Sequence
// parallelism is on by default under tp, so every tp case runs with it; one tp = 2 case turns
// it off. Tiny Gemma 2 and Gemma 3 models follow their one-rank runs the same way, and a Gemma
// checkpoint of tp = 2 resumes under tp = 1.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <fmt/format.h>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "integration/tiny_runs.h"
#include "tiny_gemma.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kBinary = SHARDLM_BINARY;
const std::string kCorpus = shardlm::test::kTinyCorpus;

using shardlm::test::expect_continues;
using shardlm::test::expect_follows;
using shardlm::test::expect_same_norms;
using shardlm::test::kTinyGemma2;
using shardlm::test::kTinyGemma3;
using shardlm::test::metric_series;
using shardlm::test::rewind_run;
using shardlm::test::slurp;

// The tiny model's run `name` of this suite (shardlm::test::train_tiny).
fs::path train(int ranks, int micro_batch, int grad_accum, const std::string& name, int steps = 20,
               bool fresh = true, const std::string& extra = "") {
  return shardlm::test::train_tiny(ranks, micro_batch, grad_accum, "shardlm_tp_" + name, steps,
                                   fresh, "--set model.n_kv_heads=4 " + extra);
}

struct Case {
  int ranks, micro, accum;
  const char* name;
  std::string extra;
};

// The runs compared with the one-rank run: 10 steps, which hold an evaluation and a checkpoint.
constexpr int kFollowSteps = 10;

TEST(TensorParallel, MatchesOneRankWithTheSameGlobalBatch) {
  const fs::path one = train(1, 4, 2, "one", kFollowSteps);  // 8 sequences per step
  ASSERT_EQ(metric_series(one, "loss").size(), size_t(kFollowSteps));
  for (const Case& c :
       {Case{2, 4, 2, "tp2", "--set parallel.tp=2"}, Case{4, 4, 2, "tp4", "--set parallel.tp=4"},
        Case{2, 4, 2, "tp2_no_sp", "--set parallel.tp=2 --set parallel.sequence_parallel=false"},
        Case{4, 2, 2, "dp2_tp2_z1", "--set parallel.tp=2 --set zero.stage=1"},
        Case{4, 2, 2, "dp2_tp2_z3", "--set parallel.tp=2 --set zero.stage=3"},
        Case{4, 4, 2, "cp2_tp2_ulysses_z1",
             "--set parallel.tp=2 --set parallel.cp=2 --set zero.stage=1"},
        Case{4, 4, 2, "cp2_tp2_ring_z3",
             "--set parallel.tp=2 --set parallel.cp=2 --set parallel.cp_kind=ring "
             "--set zero.stage=3"}}) {
    SCOPED_TRACE(c.name);
    const fs::path run = train(c.ranks, c.micro, c.accum, c.name, kFollowSteps, true, c.extra);
    expect_follows(run, one, kFollowSteps);
    // The clipping norm (train.grad_clip = 1 clips these steps) counts the split tensors over
    // the tp group and the replicated ones once: the one-rank norm.
    expect_same_norms(run, one);
    // Every rank plans its own shard; plan and ledger agree.
    for (int r = 0; r < c.ranks; ++r) {
      const json mem = json::parse(slurp(run / ("memory_rank" + std::to_string(r) + ".json")));
      EXPECT_GT(mem["peak_by_category"]["params"].get<int64_t>(), 0);
    }
  }
}

// Rewinds a finished 20-step run to its step-10 checkpoint.
TEST(TensorParallel, CheckpointsResumeUnderAnotherTp) {
  const fs::path one = train(1, 4, 2, "r_one");
  const std::vector<double> ref = metric_series(one, "loss");
  ASSERT_EQ(ref.size(), 20u);
  // Saved under tp = 2, resumed under tp = 1.
  const fs::path tp2 = train(2, 4, 2, "r_tp2", 20, true, "--set parallel.tp=2");
  rewind_run(tp2, 10, 20);
  const fs::path a = train(1, 4, 2, "r_tp2", 20, /*fresh=*/false);
  // Saved under tp = 1, resumed under dp = 2 x tp = 2 at ZeRO stage 1.
  const fs::path tp1 = train(1, 4, 2, "r_tp1");
  rewind_run(tp1, 10, 20);
  const fs::path b =
      train(4, 2, 2, "r_tp1", 20, /*fresh=*/false, "--set parallel.tp=2 --set zero.stage=1");
  for (const fs::path& run : {a, b}) {
    SCOPED_TRACE(run.string());
    expect_continues(run, one, 10, 20);
  }
}

// Post-norms on the row-parallel projections' summed outputs: tp = 2 with and without sequence
// parallelism, full recompute, dp = 2 x tp = 2 at ZeRO-3 and pp = 2 x tp = 2 follow the one-rank
// run of the same global batch, as the Llama layers do.
TEST(TensorParallel, GemmaMatchesOneRankWithTheSameGlobalBatch) {
  for (const auto& [gemma, layers] :
       {std::pair{"gemma2", kTinyGemma2}, std::pair{"gemma3", kTinyGemma3}}) {
    SCOPED_TRACE(gemma);
    const std::string name = std::string(gemma) + "_";
    const fs::path one = train(1, 4, 2, name + "one", kFollowSteps, true, layers);
    ASSERT_EQ(metric_series(one, "loss").size(), size_t(kFollowSteps));
    for (const Case& c :
         {Case{2, 4, 2, "tp2", "--set parallel.tp=2"},
          Case{2, 4, 2, "tp2_no_sp_full",
               "--set parallel.tp=2 --set parallel.sequence_parallel=false "
               "--set memory.checkpointing=full --set memory.mlp_chunk_tokens=96"},
          Case{2, 4, 2, "tp2_sp_full", "--set parallel.tp=2 --set memory.checkpointing=full"},
          Case{4, 2, 2, "dp2_tp2_z3", "--set parallel.tp=2 --set zero.stage=3"},
          Case{4, 4, 2, "pp2_tp2", "--set parallel.pp=2 --set parallel.tp=2 --set zero.stage=1"}}) {
      SCOPED_TRACE(c.name);
      const fs::path run =
          train(c.ranks, c.micro, c.accum, name + c.name, kFollowSteps, true, layers + c.extra);
      expect_follows(run, one, kFollowSteps);
    }
  }
}

// A Gemma 3 checkpoint written under tp = 2 resumes under tp = 1.
TEST(TensorParallel, GemmaCheckpointsResumeUnderAnotherTp) {
  const fs::path one = train(1, 4, 2, "r_gemma3_one", 20, true, kTinyGemma3);
  ASSERT_EQ(metric_series(one, "loss").size(), 20u);
  const fs::path tp2 =
      train(2, 4, 2, "r_gemma3_tp2", 20, true, kTinyGemma3 + "--set parallel.tp=2");
  rewind_run(tp2, 10, 20);
  const fs::path resumed = train(1, 4, 2, "r_gemma3_tp2", 20, /*fresh=*/false, kTinyGemma3);
  expect_continues(resumed, one, 10, 20);
}

TEST(TensorParallel, ConfigErrorsNameTheKey) {
  const fs::path dir = shardlm::test::scratch_root() / "shardlm_tp_errors";
  fs::create_directories(dir);
  int exit_code = -1;
  auto run = [&](const std::string& extra) {
    const std::string cmd = kBinary + " train --config " + std::string(SHARDLM_SOURCE_DIR) +
                            "/configs/demo.json --set data.train=" + kCorpus +
                            " --set log.dir=" + (dir / "run").string() + " " + extra + " > " +
                            (dir / "out.txt").string() + " 2>&1";
    const int status = std::system(cmd.c_str());
    EXPECT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return slurp(dir / "out.txt");
  };
  // The vocabulary is split by rows: tp must divide it (a config error, exit 2).
  const std::string vocab = run("--set parallel.tp=2 --set model.vocab_size=321");
  EXPECT_EQ(exit_code, 2) << vocab;
  EXPECT_NE(vocab.find("model.vocab_size"), std::string::npos) << vocab;
  EXPECT_NE(vocab.find("parallel.tp"), std::string::npos) << vocab;
  // tiny has 2 kv heads
  EXPECT_NE(run("--set parallel.tp=4").find("model.n_kv_heads"), std::string::npos);
}

}  // namespace
