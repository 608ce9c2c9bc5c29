// LoRA through the binary: ZeRO stages 2 and 3 on 2 ranks (with dropout: the mask follows the
// token's place in the step, so it does not depend on who holds the row) and context
// parallelism on 2 ranks give the one-rank run's losses and adapters for the same global
// batch; so does tensor parallelism (tp = 2 with and without sequence parallelism, dp = 2 x
// tp = 2 at ZeRO 1 and 3, with dropout: a row-parallel projection's input columns draw the
// whole input's mask), its checkpoints holding the whole adapters, which resume across tp = 2
// and tp = 1 both ways, and with the base offloaded to the host; a checkpoint resumes under
// another rank count and stage; resume refuses another LoRA config; bad lora.* values exit 2
// naming the key.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <fmt/format.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "integration/lora_runs.h"
#include "integration/tiny_runs.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using shardlm::test::slurp;

const std::string kCorpus = shardlm::test::kTinyCorpus;

using TrainOutcome = shardlm::test::lora_runs::LoraRun;
using shardlm::test::lora_runs::expect_follows;
using shardlm::test::lora_runs::expect_plan_equals_ledger;

// 6 steps of a 2-layer tiny model with adapters on every projection, 4 sequences per step.
TrainOutcome train(int ranks, int micro, const std::string& name, const std::string& extra,
                   bool fresh = true) {
  return shardlm::test::lora_runs::train_lora(
      ranks, micro, shardlm::test::scratch_root() / ("shardlm_lora_" + name), extra, fresh);
}

std::vector<double> losses(const fs::path& run) {
  return shardlm::test::metric_series(run, "loss");
}

TEST(LoraParallel, ZeroAndContextParallelMatchOneRank) {
  const std::string dropout = " --set lora.dropout=0.1";
  const TrainOutcome one = train(1, 4, "one", dropout);
  ASSERT_EQ(one.exit_code, 0) << one.out;
  ASSERT_EQ(losses(one.dir).size(), 6u);
  for (const int stage : {2, 3}) {
    SCOPED_TRACE(::testing::Message() << "zero stage " << stage);
    const TrainOutcome r = train(2, 2, "zero" + std::to_string(stage),
                                 dropout + " --set zero.stage=" + std::to_string(stage));
    ASSERT_EQ(r.exit_code, 0) << r.out;
    expect_follows(r.dir, one.dir);
  }
  // Context parallelism shards each row's tokens, so it is compared without dropout.
  const TrainOutcome one_plain = train(1, 4, "one_plain", "");
  ASSERT_EQ(one_plain.exit_code, 0) << one_plain.out;
  const TrainOutcome cp = train(2, 4, "cp2", " --set parallel.cp=2 --set parallel.cp_kind=ring");
  ASSERT_EQ(cp.exit_code, 0) << cp.out;
  expect_follows(cp.dir, one_plain.dir);
  // The base in host memory and only layer 0's input kept: layer 1 recomputed from it, its
  // base staged onto the device again and its keys and values exchanged again.
  const TrainOutcome lean = train(2, 4, "cp2_lean",
                                  " --set parallel.cp=2 --set parallel.cp_kind=ring"
                                  " --set lora.offload_base=true --set memory.checkpointing=full"
                                  " --set memory.checkpoint_every=2"
                                  " --set memory.offload_checkpoints=true");
  ASSERT_EQ(lean.exit_code, 0) << lean.out;
  expect_follows(lean.dir, one_plain.dir);
}

// The adapters split with their base projections: each tp rank computes its heads' and its
// MLP columns' share of every update, so the runs follow the one-rank run of the same global
// batch (4 sequences per step), and the checkpoints hold the whole adapters in the one-rank
// arena's order.
TEST(LoraParallel, TensorParallelMatchesOneRank) {
  const std::string dropout = " --set lora.dropout=0.1";
  const TrainOutcome one = train(1, 4, "tp_one", dropout);
  ASSERT_EQ(one.exit_code, 0) << one.out;
  struct Case {
    int ranks, micro;
    const char* name;
    const char* sets;
  };
  for (const Case c :
       {Case{2, 4, "tp2", " --set parallel.tp=2"},
        Case{2, 4, "tp2_no_sp", " --set parallel.tp=2 --set parallel.sequence_parallel=false"},
        Case{4, 2, "dp2_tp2_z1", " --set parallel.tp=2 --set zero.stage=1"},
        Case{4, 2, "dp2_tp2_z3", " --set parallel.tp=2 --set zero.stage=3"}}) {
    SCOPED_TRACE(c.name);
    const TrainOutcome r = train(c.ranks, c.micro, c.name, dropout + c.sets);
    ASSERT_EQ(r.exit_code, 0) << r.out;
    expect_follows(r.dir, one.dir);
    // The clipping norm counts the split adapters over the tp group, the whole ones once.
    shardlm::test::expect_same_norms(r.dir, one.dir);
    expect_plan_equals_ledger(r.dir, c.ranks);
    const fs::path model_json = fs::path("checkpoints") / "step_00000006" / "model.json";
    EXPECT_EQ(json::parse(slurp(r.dir / model_json)), json::parse(slurp(one.dir / model_json)));
  }
}

// The base in host memory under tp = 2 with a vocabulary whose table slice (4096 rows) is
// larger than a decoder layer: the tp shard's slots hold the whole slice (its
// vocabulary-parallel embedding and loss read it whole), one rank's hold a layer and take the
// table in pieces; the runs agree and each plan is its ledger.
TEST(LoraParallel, OffloadedBaseUnderTensorParallelMatchesOneRank) {
  const std::string sets = " --set lora.offload_base=true --set model.vocab_size=8192";
  const TrainOutcome one = train(1, 4, "tp_offload_one", sets);
  ASSERT_EQ(one.exit_code, 0) << one.out;
  const TrainOutcome tp2 = train(2, 4, "tp_offload_tp2", sets + " --set parallel.tp=2");
  ASSERT_EQ(tp2.exit_code, 0) << tp2.out;
  expect_follows(tp2.dir, one.dir);
  expect_plan_equals_ledger(tp2.dir, 2);
  expect_plan_equals_ledger(one.dir, 1);
}

// A checkpoint written under tp = 2 resumes on one rank, and one written on one rank resumes
// under dp = 2 x tp = 2 at ZeRO stage 3; both continue as the uninterrupted one-rank run.
TEST(LoraParallel, CheckpointResumesAcrossTp) {
  const TrainOutcome one = train(1, 4, "tp_resume_ref", "");
  ASSERT_EQ(one.exit_code, 0) << one.out;
  const TrainOutcome tp2 = train(2, 4, "tp_resume_tp2", " --set parallel.tp=2");
  ASSERT_EQ(tp2.exit_code, 0) << tp2.out;
  auto step3 = [](const TrainOutcome& r) {
    return (r.dir / "checkpoints" / "step_00000003").string();
  };
  const TrainOutcome to_one = train(1, 4, "tp_resume_to_one", " --set train.resume=" + step3(tp2));
  const TrainOutcome to_tp2 =
      train(4, 2, "tp_resume_to_tp2",
            " --set parallel.tp=2 --set zero.stage=3 --set train.resume=" + step3(one));
  ASSERT_EQ(losses(one.dir).size(), 6u);
  for (const TrainOutcome* r : {&to_one, &to_tp2}) {
    SCOPED_TRACE(r->dir.string());
    ASSERT_EQ(r->exit_code, 0) << r->out;
    EXPECT_NE(r->out.find("resume: continuing"), std::string::npos) << r->out;
    expect_follows(r->dir, one.dir, 3);
  }
}

// A LoRA checkpoint (adapters and their Adam state) written at step 3 by one rank resumes on 2
// ranks at stage 3 and continues as the uninterrupted one-rank run; another LoRA config is
// refused.
TEST(LoraParallel, CheckpointResumesAcrossRanksAndRefusesAnotherConfig) {
  const TrainOutcome one = train(1, 4, "resume_ref", "");
  ASSERT_EQ(one.exit_code, 0) << one.out;
  const std::string step3 = (one.dir / "checkpoints" / "step_00000003").string();
  const TrainOutcome other =
      train(1, 4, "resume_other", " --set lora.rank=8 --set train.resume=" + step3);
  EXPECT_EQ(other.exit_code, 2) << other.out;
  EXPECT_NE(other.out.find("lora"), std::string::npos) << other.out;
  const TrainOutcome rest =
      train(2, 2, "resume", " --set zero.stage=3 --set train.resume=" + step3);
  ASSERT_EQ(rest.exit_code, 0) << rest.out;
  EXPECT_NE(rest.out.find("resume: continuing"), std::string::npos) << rest.out;
  expect_follows(rest.dir, one.dir, 3);
}

TEST(LoraParallel, BadLoraConfigsExit2NamingTheKey) {
  struct Case {
    const char* sets;
    const char* key;
  };
  for (const Case c :
       {Case{"--set lora.rank=-1", "lora.rank"}, Case{"--set lora.alpha=0", "lora.alpha"},
        Case{"--set lora.dropout=1", "lora.dropout"},
        Case{"--set lora.targets=q,qkv", "lora.targets"},
        Case{"--set lora.targets=", "lora.targets"}, Case{"--set lora.rnk=4", "lora.rank"}}) {
    SCOPED_TRACE(c.sets);
    const TrainOutcome r = train(1, 4, "bad", c.sets);
    EXPECT_EQ(r.exit_code, 2) << r.out;
    EXPECT_NE(r.out.find(c.key), std::string::npos) << r.out;
  }
}

}  // namespace
