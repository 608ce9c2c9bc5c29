// Pipeline parallelism through the binary under mpiexec: parallel.pp = 2 and 4 (1F1B over 8
// micro-batches) and the 4D grid dp = 2 x pp = 2 x tp = 2 at ZeRO stages 1 and 3 follow the
// one-rank run with the same global batch (losses, clipping norms, evaluation losses and the
// final weights of the whole model, which every checkpoint holds in the one-rank arena order);
// a checkpoint written under dp = 2 x tp = 2 x pp = 2 resumes under dp = 4 and under
// tp = 4 x pp = 2 and continues as the uninterrupted run. Tied embeddings (the first and last
// stages each hold the matrix, their gradients summed) follow the tied one-rank run. So do
// dp = 2 x cp = 2 x tp = 2 (ZeRO 1 and 3) and pp = 2 x cp = 2 x tp = 2. So do stages with
// checkpoint placements (every k-th layer kept, offloaded to the host) and LoRA on stages, also
// with the stages split by tp (pp = 2 x tp = 2, dp = 2 x pp = 2 x tp = 2), whose checkpoint
// resumes bit for bit. A 4-layer model of dim 64 (8 layers for the placements).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "integration/tiny_runs.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

using shardlm::test::expect_continues;
using shardlm::test::expect_follows;
using shardlm::test::expect_same_norms;
using shardlm::test::metric_series;
using shardlm::test::rewind_run;
using shardlm::test::slurp;

constexpr int kSteps = 4;

// The tiny model's run `name` of this suite: 4 layers, dim 64, 4 heads and kv heads (so that
// tp = 4 divides them), 4 steps, a checkpoint every 2.
fs::path train(int ranks, int grad_accum, const std::string& name, bool fresh = true,
               const std::string& extra = "") {
  return shardlm::test::train_tiny(ranks, 1, grad_accum, "shardlm_pp_" + name, kSteps, fresh,
                                   shardlm::test::kPipelineModel + extra);
}

// Every rank plans its own stage: each rank's device plan equals its ledger category by category
// (and its host plan, with `host`). Returns the ranks' memory reports for further checks.
std::vector<json> expect_planned_memory(const fs::path& run, int ranks, bool host) {
  std::vector<json> reports;
  for (int r = 0; r < ranks; ++r) {
    reports.push_back(json::parse(slurp(run / ("memory_rank" + std::to_string(r) + ".json"))));
    const json& mem = reports.back();
    EXPECT_EQ(mem["peak_by_category"], mem["planned"]["peak_by_category"]) << "rank " << r;
    if (host) {
      EXPECT_EQ(mem["host_peak_by_category"], mem["planned"]["host_peak_by_category"])
          << "rank " << r;
    }
  }
  return reports;
}

struct Case {
  int ranks, accum;
  const char* name;
  std::string extra;
};

TEST(PipelineParallel, MatchesOneRankWithTheSameGlobalBatch) {
  const fs::path one = train(1, 8, "one");  // 8 sequences per step
  ASSERT_EQ(metric_series(one, "loss").size(), size_t(kSteps));
  for (const Case& c :
       {Case{2, 8, "pp2", "--set parallel.pp=2"}, Case{4, 8, "pp4", "--set parallel.pp=4"},
        Case{8, 4, "dp2_pp2_tp2_z1", "--set parallel.pp=2 --set parallel.tp=2 --set zero.stage=1"},
        Case{8, 4, "dp2_pp2_tp2_z3",
             "--set parallel.pp=2 --set parallel.tp=2 --set zero.stage=3"}}) {
    SCOPED_TRACE(c.name);
    const fs::path run = train(c.ranks, c.accum, c.name, true, c.extra);
    expect_follows(run, one, kSteps);
    // The clipping norm sums every stage's parameters: the one-rank norm.
    expect_same_norms(run, one);
    // The opening lines name the stages; every step reports the measured bubble.
    const std::string out = slurp(run.parent_path() / "out.txt");
    EXPECT_NE(out.find("pipeline: "), std::string::npos) << out;
    EXPECT_NE(out.find("textbook bubble"), std::string::npos);
    const std::vector<double> bubble = metric_series(run, "pp_bubble");
    ASSERT_EQ(bubble.size(), size_t(kSteps));
    for (double b : bubble) {
      EXPECT_GE(b, 0.0);
      EXPECT_LT(b, 1.0);
    }
    expect_planned_memory(run, c.ranks, /*host=*/false);
  }
}

// The other grids of eight ranks with three or four axes: dp 2 x cp 2 x tp 2 at ZeRO 1
// (Ulysses) and 3 (ring), and pp 2 x cp 2 x tp 2; sequence parallelism and the
// vocabulary-parallel head are on (the tp defaults).
TEST(PipelineParallel, ContextAndTensorParallelGridsMatchOneRank) {
  const fs::path one = train(1, 8, "one4d");
  for (const Case& c :
       {Case{8, 4, "dp2_cp2_tp2_z1",
             "--set parallel.cp=2 --set parallel.cp_kind=ulysses --set parallel.tp=2 "
             "--set zero.stage=1"},
        Case{8, 4, "dp2_cp2_tp2_z3",
             "--set parallel.cp=2 --set parallel.cp_kind=ring --set parallel.tp=2 "
             "--set zero.stage=3"},
        Case{8, 8, "pp2_cp2_tp2_z1",
             "--set parallel.pp=2 --set parallel.cp=2 --set parallel.cp_kind=ring "
             "--set parallel.tp=2 --set zero.stage=1"}}) {
    SCOPED_TRACE(c.name);
    const fs::path run = train(c.ranks, c.accum, c.name, true, c.extra);
    expect_follows(run, one, kSteps);
    expect_same_norms(run, one);
    expect_planned_memory(run, c.ranks, /*host=*/false);
  }
}

// A sliding window of 7 tokens (shorter than the sequences and their documents) on every layer:
// pipeline stages, ring context parallelism (most blocks outside the window skipped) and tensor
// parallelism together follow the one-rank run of the same window.
TEST(PipelineParallel, SlidingWindowOnFourAxesMatchesOneRank) {
  const std::string window = "--set model.sliding_window=7 ";
  const fs::path one = train(1, 8, "one_window", true, window);
  const Case c{8, 8, "pp2_cp2_tp2_window",
               window +
                   "--set parallel.pp=2 --set parallel.cp=2 --set parallel.cp_kind=ring "
                   "--set parallel.tp=2 --set zero.stage=1"};
  const fs::path run = train(c.ranks, c.accum, c.name, true, c.extra);
  expect_follows(run, one, kSteps);
  expect_same_norms(run, one);
  expect_planned_memory(run, c.ranks, /*host=*/false);
}

TEST(PipelineParallel, TiedEmbeddingsOnTheFirstAndLastStages) {
  const std::string tied = "--set model.tie_embeddings=true ";
  const fs::path one = train(1, 8, "tied_one", true, tied);
  for (const Case& c :
       {Case{2, 8, "tied_pp2", tied + "--set parallel.pp=2"},
        Case{4, 8, "tied_pp4_z2", tied + "--set parallel.pp=4 --set zero.stage=2"},
        Case{8, 4, "tied_dp2_pp2_tp2_z3",
             tied + "--set parallel.pp=2 --set parallel.tp=2 --set zero.stage=3"}}) {
    SCOPED_TRACE(c.name);
    const fs::path run = train(c.ranks, c.accum, c.name, true, c.extra);
    expect_follows(run, one, kSteps);
    expect_same_norms(run, one);  // the tied matrix counted once
  }
}

// Checkpoint placements on stages: 8 layers (4 a stage under pp 2, 2 under pp 4), every other
// layer's input kept, kept layers waiting on the host (each micro-batch in flight has its own
// device slots and host places); the runs follow the one-rank run and every rank's plan is its
// ledger on both pools.
TEST(PipelineParallel, CheckpointPlacementsOnStagesMatchOneRank) {
  const std::string eight = "--set model.n_layers=8 ";
  const fs::path one = train(1, 8, "place_one", true, eight);
  for (const Case& c :
       {Case{2, 8, "place_pp2_every2_half",
             eight + "--set parallel.pp=2 --set memory.checkpointing=full "
                     "--set memory.checkpoint_every=2 --set memory.offload_checkpoints=0.5"},
        Case{4, 8, "place_pp4_offload_z3",
             eight + "--set parallel.pp=4 --set memory.checkpointing=selective "
                     "--set memory.offload_checkpoints=true --set zero.stage=3"},
        Case{4, 4, "place_dp2_pp2_every2_offload",
             eight + "--set parallel.pp=2 --set memory.checkpointing=full "
                     "--set memory.checkpoint_every=2 --set memory.offload_checkpoints=true "
                     "--set zero.stage=1"}}) {
    SCOPED_TRACE(c.name);
    const fs::path run = train(c.ranks, c.accum, c.name, true, c.extra);
    expect_follows(run, one, kSteps);
    expect_same_norms(run, one);
    const std::vector<json> reports = expect_planned_memory(run, c.ranks, /*host=*/true);
    for (size_t r = 0; r < reports.size(); ++r)  // each micro-batch in flight's offloaded ones
      EXPECT_GT(reports[r]["host_peak_by_category"].value("checkpoints", int64_t{0}), 0)
          << "rank " << r;
  }
}

// LoRA on stages: the frozen base sliced per stage from the whole model's initial weights, each
// stage training its layers' adapters (dropout masks per micro-batch, recomputed in backward
// after other micro-batches' forwards); the checkpoints hold the whole adapter arena, so a run
// saved under pp = 2 resumes under dp = 2 (and the merged model samples from rank 0).
TEST(PipelineParallel, LoraOnStagesMatchesOneRank) {
  const std::string lora = "--set lora.rank=4 --set lora.alpha=8 --set lora.dropout=0.1 ";
  // A greedy sample of 8 tokens from the merged model at the end (gathered from the stages).
  const std::string greedy =
      "--set sample.count=1 --set sample.temperature=0 --set sample.max_new_tokens=8 ";
  const fs::path one = train(1, 8, "lora_one", true, lora + greedy);
  for (const Case& c :
       {Case{2, 8, "lora_pp2", lora + greedy + "--set parallel.pp=2"},
        Case{4, 4, "lora_dp2_pp2_z3_offload",
             lora + "--set parallel.pp=2 --set zero.stage=3 --set lora.offload_base=true "
                    "--set memory.checkpointing=full --set memory.offload_checkpoints=true"},
        Case{4, 8, "lora_pp4", lora + "--set parallel.pp=4"}}) {
    SCOPED_TRACE(c.name);
    const fs::path run = train(c.ranks, c.accum, c.name, true, c.extra);
    expect_follows(run, one, kSteps);
    expect_same_norms(run, one);
    expect_planned_memory(run, c.ranks, /*host=*/true);
  }
  auto sample_of = [](const fs::path& run) {
    const std::string out = slurp(run.parent_path() / "out.txt");
    const size_t at = out.rfind("--- sample 1 ---");
    return at == std::string::npos ? std::string() : out.substr(at, 64);
  };
  EXPECT_FALSE(sample_of(one).empty());
  EXPECT_EQ(sample_of(shardlm::test::scratch_root() / "shardlm_pp_lora_pp2" / "run"),
            sample_of(one));
  const fs::path saved = train(2, 8, "lora_r_pp2", true, lora + "--set parallel.pp=2");
  rewind_run(saved, 2, kSteps);
  const fs::path resumed = train(2, 4, "lora_r_pp2", false, lora);
  expect_continues(resumed, one, 2, kSteps);
}

// LoRA on stages split by tp: each (stage, tp shard) trains its layers' adapters split with their
// base projections (dropout's masks drawn over the whole input), alone (pp = 2 x tp = 2), with
// ZeRO 3 over dp = 2 and with the base in host memory; every run follows the one-rank run of
// the same global batch and each rank's plan is its ledger. A pp = 2 x tp = 2 checkpoint resumed
// on the same grid continues bit for bit as the uninterrupted run (test_sharded_checkpoint
// resumes one across grids).
TEST(PipelineParallel, LoraOnStagesSplitByTensorParallelismMatchesOneRank) {
  // Every projection: column-parallel ones split B, row-parallel ones (o, down) split A.
  const std::string lora =
      "--set lora.rank=4 --set lora.alpha=8 --set lora.dropout=0.1 --set lora.targets=all ";
  const std::string grid = "--set parallel.pp=2 --set parallel.tp=2 ";
  const fs::path one = train(1, 8, "lora_tp_one", true, lora);
  for (const Case& c : {Case{4, 8, "lora_pp2_tp2", lora + grid},
                        Case{8, 4, "lora_dp2_pp2_tp2_z3_offload",
                             lora + grid + "--set zero.stage=3 --set lora.offload_base=true"}}) {
    SCOPED_TRACE(c.name);
    const fs::path run = train(c.ranks, c.accum, c.name, true, c.extra);
    expect_follows(run, one, kSteps);
    expect_same_norms(run, one);
    expect_planned_memory(run, c.ranks, /*host=*/true);
  }
  const fs::path saved = shardlm::test::scratch_root() / "shardlm_pp_lora_pp2_tp2" / "run";
  std::vector<std::string> final_state;
  for (const char* v : {"params", "adam_m", "adam_v"})
    final_state.push_back(shardlm::test::checkpoint_vector(saved, kSteps, v));
  rewind_run(saved, 2, kSteps);
  const fs::path again = train(4, 8, "lora_pp2_tp2", false, lora + grid);
  size_t i = 0;
  for (const char* v : {"params", "adam_m", "adam_v"})
    EXPECT_TRUE(shardlm::test::checkpoint_vector(again, kSteps, v) == final_state[i++])
        << v << " differs from the uninterrupted run's";
  // Ring context parallelism on the four axes' grid (pp 2 x cp 2 x tp 2); it splits each row's
  // tokens, so it is compared without dropout.
  const std::string plain = "--set lora.rank=4 --set lora.alpha=8 --set lora.targets=all ";
  const fs::path one_plain = train(1, 8, "lora_tp_one_plain", true, plain);
  const fs::path cp = train(8, 8, "lora_pp2_cp2_tp2", true,
                            plain + grid + "--set parallel.cp=2 --set parallel.cp_kind=ring");
  expect_follows(cp, one_plain, kSteps);
  expect_same_norms(cp, one_plain);
  expect_planned_memory(cp, 8, /*host=*/true);
}

// Rewinds a finished run to its step-2 checkpoint.
TEST(PipelineParallel, CheckpointsResumeOnAnotherGrid) {
  const fs::path one = train(1, 8, "r_one");
  const std::vector<double> ref = metric_series(one, "loss");
  ASSERT_EQ(ref.size(), size_t(kSteps));
  const std::string grid = "--set parallel.pp=2 --set parallel.tp=2 --set zero.stage=1";
  // Saved under dp = 2 x tp = 2 x pp = 2, resumed under dp = 4 (tp = pp = 1) and under
  // tp = 4 x pp = 2 (dp = 1): the global batch stays 8 sequences.
  const fs::path a0 = train(8, 4, "r_dp4", true, grid);
  rewind_run(a0, 2, kSteps);
  const fs::path a = train(4, 2, "r_dp4", false, "--set zero.stage=1");
  const fs::path b0 = train(8, 4, "r_tp4pp2", true, grid);
  rewind_run(b0, 2, kSteps);
  const fs::path b = train(8, 8, "r_tp4pp2", false, "--set parallel.pp=2 --set parallel.tp=4");
  for (const fs::path& run : {a, b}) {
    SCOPED_TRACE(run.string());
    expect_continues(run, one, 2, kSteps);
  }
}

TEST(PipelineParallel, ConfigErrorsNameTheKeys) {
  const fs::path dir = shardlm::test::scratch_root() / "shardlm_pp_errors";
  fs::create_directories(dir);
  auto run = [&](const std::string& extra) {
    const std::string cmd = std::string(SHARDLM_BINARY) + " train --config " +
                            std::string(SHARDLM_SOURCE_DIR) +
                            "/configs/demo.json --set data.train=" + shardlm::test::kTinyCorpus +
                            " --set log.dir=" + (dir / "run").string() + " " + extra + " > " +
                            (dir / "out.txt").string() + " 2>&1";
    const int status = std::system(cmd.c_str());
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 2) << slurp(dir / "out.txt");
    return slurp(dir / "out.txt");
  };
  const std::string too_many = run("--set parallel.pp=8");  // tiny has 4 layers
  EXPECT_NE(too_many.find("parallel.pp"), std::string::npos) << too_many;
  EXPECT_NE(too_many.find("model.n_layers"), std::string::npos) << too_many;
}

}  // namespace
