// bf16 activations under every parallel strategy: the tiny model trained with bf16 parameters
// (precision.activations = auto, so activations, checkpoints, the residual stream and their
// gradients are bf16 too) by ZeRO 0-3, each context-parallel kind, tensor parallelism with and
// without sequence parallelism (tiny Gemma 2 and 3 models too), pipeline stages and LoRA, each
// against the one-rank bf16 run of the same global batch. A sum in another order (a partial
// gradient per rank, a ring of key blocks, a tp all-reduce) rounds differently when its result is
// stored in bf16 (8 significant bits), so the runs agree within follow_bounds' bf16 bound
// (tiny_runs.h, tests/tolerance.h) rather than fp32's. Every rank's measured memory is its plan,
// category by category, on both pools.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "integration/tiny_runs.h"
#include "tiny_gemma.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using shardlm::test::metric_series;
using shardlm::test::slurp;

constexpr int kSteps = 10;

const std::string kBf16 = "--set precision.param=bf16 ";

fs::path train(int ranks, int micro_batch, int grad_accum, const std::string& name,
               const std::string& extra) {
  return shardlm::test::train_tiny(ranks, micro_batch, grad_accum, "shardlm_bf16_" + name, kSteps,
                                   true, kBf16 + extra);
}

void expect_follows_in_bf16(const fs::path& run, const fs::path& one, int ranks) {
  const shardlm::test::FollowBounds bound = shardlm::test::follow_bounds(one, /*bf16=*/true);
  for (const char* key : {"loss", "eval_loss"}) {
    const std::vector<double> ref = metric_series(one, key), got = metric_series(run, key);
    ASSERT_EQ(got.size(), ref.size()) << key;
    ASSERT_FALSE(ref.empty()) << key;
    for (size_t i = 0; i < ref.size(); ++i)
      EXPECT_NEAR(got[i], ref[i], bound.relative * std::abs(ref[i])) << key << " " << i + 1;
  }
  shardlm::test::expect_same_weights(run, one, kSteps, bound.weights);
  for (int r = 0; r < ranks; ++r) {
    const json mem = json::parse(slurp(run / ("memory_rank" + std::to_string(r) + ".json")));
    EXPECT_EQ(mem["peak_by_category"], mem["planned"]["peak_by_category"]) << "rank " << r;
    EXPECT_EQ(mem["host_peak_by_category"], mem["planned"]["host_peak_by_category"])
        << "rank " << r;
  }
}

struct Case {
  const char* name;
  int ranks, micro, accum;
  std::string sets;
};

// Runs every case against the one-rank run of 8 sequences per step.
void expect_cases_follow(const std::string& suite, const std::vector<Case>& cases,
                         const std::string& common = "") {
  const fs::path one = train(1, 4, 2, suite + "_one", common);
  ASSERT_EQ(metric_series(one, "loss").size(), size_t(kSteps));
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path run = train(c.ranks, c.micro, c.accum, suite + "_" + c.name, common + c.sets);
    expect_follows_in_bf16(run, one, c.ranks);
  }
}

TEST(Bf16Parallel, ZeroStagesMatchOneRank) {
  expect_cases_follow(
      "zero",
      {{"z0", 2, 2, 2, "--set zero.stage=0"},
       {"z1", 2, 2, 2, "--set zero.stage=1"},
       {"z2", 2, 4, 1, "--set zero.stage=2"},
       {"z3_offload", 2, 2, 2,
        "--set zero.stage=3 --set zero.offload_optimizer=cpu --set zero.offload_params=cpu"}});
}

TEST(Bf16Parallel, ContextParallelKindsMatchOneRank) {
  expect_cases_follow(
      "cp", {{"ulysses4", 4, 4, 2, "--set parallel.cp=4 --set parallel.cp_kind=ulysses"},
             {"ring4", 4, 4, 2, "--set parallel.cp=4 --set parallel.cp_kind=ring"},
             {"hybrid4", 4, 4, 2,
              "--set parallel.cp=4 --set parallel.cp_kind=hybrid --set parallel.cp_ulysses=2"},
             // Every 2nd layer's input kept, half of those on the host: recomputed layers
             // gather their ZeRO-3 parameters and exchange keys and values in backward.
             {"ring2_every2_half_offload_z3", 2, 4, 2,
              "--set parallel.cp=2 --set parallel.cp_kind=ring --set zero.stage=3 "
              "--set memory.checkpointing=full --set memory.checkpoint_every=2 "
              "--set memory.offload_checkpoints=0.5"}});
}

TEST(Bf16Parallel, TensorAndPipelineParallelMatchOneRank) {
  expect_cases_follow(
      "tp_pp",
      {{"tp2", 2, 4, 2, "--set parallel.tp=2"},
       {"tp2_no_sp", 2, 4, 2, "--set parallel.tp=2 --set parallel.sequence_parallel=false"},
       {"pp2", 2, 4, 2, "--set parallel.pp=2"},
       {"pp2_tp2", 4, 4, 2, "--set parallel.pp=2 --set parallel.tp=2 --set zero.stage=1"},
       // One layer a stage, its checkpoints on the host for each micro-batch in flight.
       {"pp2_full_offload", 2, 4, 2,
        "--set parallel.pp=2 --set memory.checkpointing=full "
        "--set memory.offload_checkpoints=true"}});
}

// Gemma's post-norms on the row-parallel projections' summed outputs, with and without
// sequence parallelism, and with pipeline stages.
TEST(Bf16Parallel, GemmaUnderTensorParallelMatchesOneRank) {
  expect_cases_follow(
      "gemma2_tp",
      {{"tp2", 2, 4, 2, "--set parallel.tp=2"},
       {"tp2_no_sp", 2, 4, 2, "--set parallel.tp=2 --set parallel.sequence_parallel=false"}},
      shardlm::test::kTinyGemma2);
  expect_cases_follow(
      "gemma3_tp",
      {{"tp2_full", 2, 4, 2, "--set parallel.tp=2 --set memory.checkpointing=full"},
       {"pp2_tp2", 4, 4, 2, "--set parallel.pp=2 --set parallel.tp=2 --set zero.stage=1"}},
      shardlm::test::kTinyGemma3);
}

TEST(Bf16Parallel, LoraMatchesOneRank) {
  expect_cases_follow(
      "lora",
      {{"z3", 2, 2, 2, "--set zero.stage=3"},
       {"z3_base_on_host", 2, 2, 2, "--set zero.stage=3 --set lora.offload_base=true"},
       {"ring2", 2, 4, 2, "--set parallel.cp=2 --set parallel.cp_kind=ring"}},
      "--set lora.rank=4 --set lora.alpha=8 ");
}

// The adapters on every projection, split with their base projections under tp (also on each
// of two pipeline stages).
TEST(Bf16Parallel, LoraUnderTensorParallelMatchesOneRank) {
  expect_cases_follow("lora_tp",
                      {{"tp2", 2, 4, 2, "--set parallel.tp=2"},
                       {"dp2_tp2_z3", 4, 2, 2, "--set parallel.tp=2 --set zero.stage=3"},
                       {"pp2_tp2", 4, 4, 2, "--set parallel.pp=2 --set parallel.tp=2"}},
                      "--set lora.rank=4 --set lora.alpha=8 --set lora.targets=all ");
}

}  // namespace
