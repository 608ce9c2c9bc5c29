// Sharded checkpoints through the binary: every rank writes its own share of every state
// vector (the shares tile the whole vectors, tensors held by several tp ranks or pipeline
// stages written once), a checkpoint saved on one grid loads bit for bit on another and then
// continues as the one-rank run of the same global batch does (LoRA's adapters too, split over
// tp or over pipeline stages), a corrupt or missing shard is an error naming the file and the
// element range, and the memory a save uses is the plan's.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tiny_runs.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

using shardlm::test::checkpoint_vector;
using shardlm::test::expect_continues;
using shardlm::test::metric_series;
using shardlm::test::rewind_run;
using shardlm::test::slurp;

constexpr int kSteps = 20;

fs::path train(int ranks, int micro_batch, int grad_accum, const std::string& name,
               int steps = kSteps, bool fresh = true, const std::string& extra = "") {
  return shardlm::test::train_tiny(ranks, micro_batch, grad_accum, "shardlm_shard_" + name, steps,
                                   fresh, extra);
}

// A copy of the finished run `from` in a fresh directory, rewound to its step-10 checkpoint.
void copy_rewound(const fs::path& from, const std::string& name) {
  const fs::path dir = shardlm::test::scratch_root() / ("shardlm_shard_" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  fs::copy(from, dir / "run", fs::copy_options::recursive);
  rewind_run(dir / "run", 10, kSteps);
}

json manifest_of(const fs::path& run, int step) {
  return json::parse(
      slurp(run / "checkpoints" / fmt::format("step_{:08d}", step) / "manifest.json"));
}

// Each state vector is in `ranks` files, one a rank, whose ranges hold every element once;
// under tp a rank's columns of a matrix are one strided run, so no file lists more ranges than
// twice the tensors model.json lists (a range a row would be hundreds); and every rank's measured
// memory, checkpoint staging included, is the plan's.
void expect_one_share_a_rank(const fs::path& run, int ranks) {
  const json m = manifest_of(run, 10);
  ASSERT_TRUE(m.contains("vectors")) << m.dump();
  EXPECT_EQ(m["layout"]["world"].get<int>(), ranks);
  const size_t tensors =
      json::parse(slurp(run / "checkpoints" / "step_00000010" / "model.json"))["params"].size();
  if (m["layout"]["grid"]["tp"].get<int>() > 1)
    for (const auto& [name, entry] : m["files"].items())
      if (entry.contains("ranges")) {
        EXPECT_LE(entry["ranges"].size(), 2 * tensors) << name;
      }
  for (const auto& [vector, shape] : m["vectors"].items()) {
    SCOPED_TRACE(vector);
    const size_t want = shape["elems"].get<size_t>() * shape["elem_bytes"].get<size_t>();
    size_t bytes = 0;
    int files = 0;
    for (const auto& [name, entry] : m["files"].items()) {
      if (entry.value("vector", "") != vector) continue;
      ++files;
      bytes += entry["bytes"].get<size_t>();
      EXPECT_EQ(name, fmt::format("{}-{:05d}-of-{:05d}.bin", vector, files - 1, ranks));
    }
    EXPECT_EQ(files, ranks);
    EXPECT_EQ(bytes, want) << "every element written exactly once";
  }
  for (int r = 0; r < ranks; ++r) {
    const json mem = json::parse(slurp(run / ("memory_rank" + std::to_string(r) + ".json")));
    EXPECT_EQ(mem["peak_by_category"], mem["planned"]["peak_by_category"]) << "rank " << r;
  }
}

struct Regrid {
  std::string name;
  int ranks, micro, accum;
  std::string saved;  // the grid that writes the step-10 checkpoint
  int resumed_ranks, resumed_micro, resumed_accum;
  std::string resumed;  // the grid that loads it
};

// Saved on one grid, loaded on another: the parameters after a step at a vanishing learning
// rate are the saved ones bit for bit, and with the run's own learning rate the run continues
// as the one-rank run does. The global batch is 8 sequences throughout.
void check_regrid(const Regrid& g, const fs::path& one) {
  SCOPED_TRACE(g.name);
  const fs::path saved = train(g.ranks, g.micro, g.accum, g.name + "_saved", kSteps, true, g.saved);
  expect_one_share_a_rank(saved, g.ranks);
  const std::string saved_params = checkpoint_vector(saved, 10, "params");

  copy_rewound(saved, g.name + "_still");
  const fs::path still = train(g.resumed_ranks, g.resumed_micro, g.resumed_accum, g.name + "_still",
                               11, false, g.resumed + " --set train.lr=1e-30 --set train.min_lr=0");
  EXPECT_TRUE(checkpoint_vector(still, 11, "params") == saved_params)
      << "the parameters loaded on the other grid differ from the saved ones";

  copy_rewound(saved, g.name + "_on");
  const fs::path on = train(g.resumed_ranks, g.resumed_micro, g.resumed_accum, g.name + "_on",
                            kSteps, false, g.resumed);
  expect_continues(on, one, 10, kSteps);
}

TEST(ShardedCheckpoint, ResumesOnAnotherGridBitForBit) {
  const fs::path one = train(1, 4, 2, "one");
  ASSERT_EQ(metric_series(one, "loss").size(), size_t(kSteps));
  for (const Regrid& g :
       {Regrid{"dp4_to_dp2tp2", 4, 2, 1, "--set zero.stage=3 --set zero.reduce_bucket_bytes=60000",
               4, 2, 2, "--set parallel.tp=2 --set zero.stage=1"},
        Regrid{"tp2pp2_to_dp4", 4, 4, 2, "--set parallel.tp=2 --set parallel.pp=2", 4, 2, 1,
               "--set zero.stage=2"},
        Regrid{"z3_to_z1", 2, 2, 2, "--set zero.stage=3", 2, 2, 2, "--set zero.stage=1"}})
    check_regrid(g, one);
}

// LoRA's adapters (and their Adam state) are split with their base projections under tp and
// by layer over pipeline stages, or both (each stage's layers split by tp): each rank writes its
// pieces (an adapter half every tp rank holds, once), and any grid reads them back bit for bit
// and continues as one rank does.
TEST(ShardedCheckpoint, LoraAdaptersResumeAcrossTpAndStages) {
  const std::string lora = "--set lora.rank=4 --set lora.alpha=8 --set lora.targets=all ";
  const fs::path one = train(1, 4, 2, "lora_one", kSteps, true, lora);
  ASSERT_EQ(metric_series(one, "loss").size(), size_t(kSteps));
  for (const Regrid& g :
       {Regrid{"lora_tp2_to_one", 2, 4, 2, lora + "--set parallel.tp=2", 1, 4, 2, lora},
        Regrid{"lora_one_to_tp2", 1, 4, 2, lora, 2, 4, 2, lora + "--set parallel.tp=2"},
        Regrid{"lora_dp2tp2z3_to_pp2", 4, 2, 2, lora + "--set parallel.tp=2 --set zero.stage=3", 2,
               4, 2, lora + "--set parallel.pp=2"},
        Regrid{"lora_pp2_to_tp2", 2, 4, 2, lora + "--set parallel.pp=2", 2, 4, 2,
               lora + "--set parallel.tp=2"},
        Regrid{"lora_pp2tp2_to_one", 4, 4, 2, lora + "--set parallel.pp=2 --set parallel.tp=2", 1,
               4, 2, lora},
        Regrid{"lora_one_to_dp2pp2tp2z3", 1, 4, 2, lora, 8, 2, 2,
               lora + "--set parallel.pp=2 --set parallel.tp=2 --set zero.stage=3"}})
    check_regrid(g, one);
}

TEST(ShardedCheckpoint, TiedEmbeddingsAcrossStagesAreWrittenOnce) {
  const std::string tied = "--set model.tie_embeddings=true ";
  const fs::path run =
      train(4, 4, 2, "tied", 10, true, tied + "--set parallel.pp=2 --set parallel.tp=2");
  expect_one_share_a_rank(run, 4);
}

// A checkpoint of an older version, params.bin and optimizer.bin (m, v) written by one rank,
// resumes on 2 ranks and continues as the one-rank run.
TEST(ShardedCheckpoint, ASingleFileCheckpointOfAnOlderVersionStillResumes) {
  const fs::path one = train(1, 4, 2, "legacy_one");
  const fs::path dir = shardlm::test::scratch_root() / "shardlm_shard_legacy";
  fs::remove_all(dir);
  fs::create_directories(dir);
  // The run's files (its metrics of steps 1-10) with only the rewritten checkpoint.
  fs::copy(one, dir / "run", fs::copy_options::recursive);
  fs::remove_all(dir / "run" / "checkpoints");
  const fs::path src = one / "checkpoints" / "step_00000010";
  {
    shardlm::CheckpointWriter w((dir / "run" / "checkpoints").string(), 10);
    for (const char* name : {"model.json", "state.json"}) {
      const std::string text = slurp(src / name);
      w.add_file(name, text.data(), text.size());
    }
    const std::string params = checkpoint_vector(one, 10, "params");
    w.add_file("params.bin", params.data(), params.size());
    const std::string optimizer =
        checkpoint_vector(one, 10, "adam_m") + checkpoint_vector(one, 10, "adam_v");
    w.add_file("optimizer.bin", optimizer.data(), optimizer.size());
    w.commit(0);
  }
  EXPECT_FALSE(manifest_of(dir / "run", 10).contains("vectors"));
  const fs::path run = train(2, 2, 2, "legacy", kSteps, /*fresh=*/false);
  expect_continues(run, one, 10, kSteps);
}

// Runs `train` on 2 ranks resuming the run in `dir`; returns the exit code, output in `out`.
int resume_two_ranks(const fs::path& dir, const fs::path& out) {
  const std::string args =
      " train --config " + std::string(SHARDLM_SOURCE_DIR) + "/configs/demo.json" +
      " --set data.train=" + shardlm::test::kTinyCorpus +
      " --set data.seq_len=64 --set model.n_layers=2 --set train.max_steps=12" +
      " --set train.eval_every=10 --set train.eval_batches=0 --set sample.count=0" +
      " --set checkpoint.every_steps=10 --set train.micro_batch=2 --set train.grad_accum=2" +
      " --set log.dir=" + (dir / "run").string();
  return shardlm::test::run_shardlm(2, args, out);
}

TEST(ShardedCheckpoint, ACorruptOrMissingShardNamesTheFileAndTheRange) {
  const fs::path run = train(2, 2, 2, "damage", 10);
  const fs::path dir = run.parent_path(), ck = run / "checkpoints" / "step_00000010";
  const json m = manifest_of(run, 10);
  const json& entry = m["files"]["adam_v-00001-of-00002.bin"];
  const int64_t begin = entry["ranges"][0][0].get<int64_t>();
  const int64_t end = begin + entry["ranges"][0][1].get<int64_t>();
  const fs::path shard = ck / "adam_v-00001-of-00002.bin";
  const std::string good = slurp(shard);
  {
    std::string bad = good;
    bad[8] = char(bad[8] ^ 0x5a);
    std::ofstream(shard, std::ios::binary | std::ios::trunc) << bad;
  }
  EXPECT_EQ(resume_two_ranks(dir, dir / "corrupt.txt"), 3);
  const std::string corrupt = slurp(dir / "corrupt.txt");
  EXPECT_NE(corrupt.find("adam_v-00001-of-00002.bin: checksum mismatch in adam_v elements [" +
                         std::to_string(begin) + ", " + std::to_string(end) + ")"),
            std::string::npos)
      << corrupt;

  std::ofstream(shard, std::ios::binary | std::ios::trunc) << good;
  fs::remove(ck / "params-00000-of-00002.bin");
  EXPECT_EQ(resume_two_ranks(dir, dir / "missing.txt"), 3);
  const std::string missing = slurp(dir / "missing.txt");
  EXPECT_NE(missing.find("params-00000-of-00002.bin: missing (holds params elements [0, "),
            std::string::npos)
      << missing;
}

}  // namespace
