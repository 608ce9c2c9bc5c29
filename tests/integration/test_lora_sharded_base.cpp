// A dense LoRA base sharded by ZeRO-3 through the binary: at zero.stage = 3 over more than one
// rank each rank holds its chunk of every decoder layer and gathers a layer on use, on the
// device or in host memory (staged through two device slots), also under tensor parallelism
// (each tp shard's layers sharded over its dp ranks), with the next layer gathered ahead
// (zero.prefetch_layers >= 1, the default) or not (0), through checkpoint recompute too. The
// runs follow the one-rank run of the same global batch, hold less of the base than a replicated
// one, and every rank's plan is its ledger category by category; a checkpoint resumes across the
// sharded and unsharded grids; the end-of-run sample reads the final checkpoint (the one-rank run's
// text), and sampling without one is refused naming the keys.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "integration/lora_runs.h"
#include "integration/tiny_runs.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using shardlm::test::slurp;

using TrainOutcome = shardlm::test::lora_runs::LoraRun;
using shardlm::test::lora_runs::expect_follows;
using shardlm::test::lora_runs::expect_plan_equals_ledger;

// 6 steps of a 2-layer tiny model with adapters on every projection, 4 sequences per step.
TrainOutcome train(int ranks, int micro, const std::string& name, const std::string& extra) {
  return shardlm::test::lora_runs::train_lora(
      ranks, micro, shardlm::test::scratch_root() / ("shardlm_lora_sharded_" + name),
      " --set lora.dropout=0.1 " + extra);
}

json memory_of(const fs::path& run, int rank) {
  return json::parse(slurp(run / ("memory_rank" + std::to_string(rank) + ".json")));
}

int64_t params_bytes(const fs::path& run, int rank, const char* section) {
  return memory_of(run, rank)[section].value("params", int64_t{0});
}

TEST(ShardedLoraBase, Zero3RunsFollowTheOneRankRun) {
  const TrainOutcome one = train(1, 4, "one", "");
  ASSERT_EQ(one.exit_code, 0) << one.out;
  EXPECT_EQ(one.out.find("decoder layers sharded"), std::string::npos) << one.out;
  const TrainOutcome replicated = train(2, 2, "zero2", " --set zero.stage=2");
  ASSERT_EQ(replicated.exit_code, 0) << replicated.out;
  const TrainOutcome host_one = train(1, 4, "host_one", " --set lora.offload_base=true");
  ASSERT_EQ(host_one.exit_code, 0) << host_one.out;
  struct Case {
    int ranks, micro, zero_ranks;
    const char* name;
    const char* sets;
    bool on_host;
  };
  const std::string z3 = " --set zero.stage=3";
  for (const Case c :
       {Case{2, 2, 2, "dp2", "", false}, Case{4, 1, 4, "dp4", "", false},
        Case{2, 2, 2, "dp2_host", " --set lora.offload_base=true", true},
        Case{2, 2, 2, "dp2_no_prefetch", " --set zero.prefetch_layers=0", false},
        Case{2, 2, 2, "dp2_host_no_prefetch",
             " --set lora.offload_base=true --set zero.prefetch_layers=0", true},
        Case{2, 2, 2, "dp2_recompute",
             " --set memory.checkpointing=full --set memory.checkpoint_every=2", false},
        Case{4, 1, 4, "dp4_host_recompute",
             " --set lora.offload_base=true --set memory.checkpointing=full"
             " --set memory.checkpoint_every=2",
             true},
        Case{4, 2, 2, "dp2_tp2", " --set parallel.tp=2", false},
        Case{4, 2, 2, "dp2_tp2_host", " --set parallel.tp=2 --set lora.offload_base=true", true}}) {
    SCOPED_TRACE(c.name);
    const TrainOutcome r = train(c.ranks, c.micro, c.name, z3 + c.sets);
    ASSERT_EQ(r.exit_code, 0) << r.out;
    EXPECT_NE(r.out.find("decoder layers sharded over " + std::to_string(c.zero_ranks) + " ranks"),
              std::string::npos)
        << r.out;
    expect_follows(r.dir, one.dir);
    expect_plan_equals_ledger(r.dir, c.ranks);
    if (c.sets == std::string()) {  // a rank holds its chunks, not the replicated base
      for (int rank = 0; rank < c.ranks; ++rank)
        EXPECT_LT(params_bytes(r.dir, rank, "peak_by_category"),
                  params_bytes(replicated.dir, 0, "peak_by_category"))
            << "rank " << rank;
    }
    if (c.on_host && c.ranks == 2) {  // about half the layers fewer in host memory
      for (int rank = 0; rank < c.ranks; ++rank)
        EXPECT_LT(params_bytes(r.dir, rank, "host_peak_by_category"),
                  params_bytes(host_one.dir, 0, "host_peak_by_category") * 3 / 4)
            << "rank " << rank;
    }
  }
}

// A checkpoint written by the sharded run resumes on one rank, and one written on one rank
// resumes sharded with the base in host memory; both continue as the uninterrupted run.
TEST(ShardedLoraBase, CheckpointResumesAcrossGrids) {
  const TrainOutcome one = train(1, 4, "resume_ref", "");
  ASSERT_EQ(one.exit_code, 0) << one.out;
  const TrainOutcome sharded = train(2, 2, "resume_dp2", " --set zero.stage=3");
  ASSERT_EQ(sharded.exit_code, 0) << sharded.out;
  auto step3 = [](const TrainOutcome& r) {
    return (r.dir / "checkpoints" / "step_00000003").string();
  };
  const TrainOutcome to_one = train(1, 4, "resume_to_one", " --set train.resume=" + step3(sharded));
  const TrainOutcome to_sharded =
      train(2, 2, "resume_to_dp2_host",
            " --set zero.stage=3 --set lora.offload_base=true --set train.resume=" + step3(one));
  for (const TrainOutcome* r : {&to_one, &to_sharded}) {
    SCOPED_TRACE(r->dir.string());
    ASSERT_EQ(r->exit_code, 0) << r->out;
    EXPECT_NE(r->out.find("resume: continuing"), std::string::npos) << r->out;
    expect_follows(r->dir, one.dir, 3);
  }
}

// The end-of-run sample reads the final checkpoint (the base from its source, the adapters
// merged): the sharded run's greedy text is the one-rank run's. Without a final checkpoint
// there is nothing to read it from: refused, naming the keys.
TEST(ShardedLoraBase, SamplesFromTheFinalCheckpoint) {
  const std::string greedy =
      " --set sample.count=1 --set sample.temperature=0 --set sample.max_new_tokens=8";
  const TrainOutcome one = train(1, 4, "sample_one", greedy);
  ASSERT_EQ(one.exit_code, 0) << one.out;
  const TrainOutcome sharded = train(2, 2, "sample_dp2", greedy + " --set zero.stage=3");
  ASSERT_EQ(sharded.exit_code, 0) << sharded.out;
  EXPECT_NE(sharded.out.find("sample: the parameters of"), std::string::npos) << sharded.out;
  auto sample_of = [](const std::string& out) {
    const size_t at = out.rfind("--- sample 1 ---");
    return at == std::string::npos ? std::string() : out.substr(at, 64);
  };
  EXPECT_FALSE(sample_of(one.out).empty()) << one.out;
  EXPECT_EQ(sample_of(sharded.out), sample_of(one.out));
  const TrainOutcome refused =
      train(2, 2, "sample_no_final", greedy + " --set zero.stage=3 --set checkpoint.at_end=false");
  EXPECT_EQ(refused.exit_code, 2) << refused.out;
  EXPECT_NE(refused.out.find("checkpoint.at_end"), std::string::npos) << refused.out;
  EXPECT_NE(refused.out.find("sample.count"), std::string::npos) << refused.out;
}

}  // namespace
