// End-to-end training on one GPU (train.device = cuda): the tiny model's fp32 loss curve equals
// the stored CPU baseline, bf16 parameters track it, every ZeRO stage with and without host
// offload and every checkpointing policy and placement give the GPU fp32 run's losses, a LoRA
// base in host memory the same adapters, the planner's device peak equals the ledger's and
// the driver's over a grid of configurations, and the trained model samples text. Label gpu.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "driver_bounds.h"
#include "integration/tiny_runs.h"
#include "shardlm/config/config.h"
#include "shardlm/train/trainer.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kSource = test::source_dir();

TrainResult run(const std::string& name, std::vector<std::string> sets,
                std::string* log_out = nullptr) {
  const std::string text = R"({
    "model": {"preset": "tiny"},
    "data": {"train": "tests/data/genesis_1_12.txt", "seq_len": 64, "valid_fraction": 0.1},
    "train": {"micro_batch": 4, "grad_accum": 2, "max_steps": 40, "lr": 3e-3,
              "min_lr": 3e-4, "warmup_steps": 5, "eval_every": 20, "eval_batches": 4,
              "seed": 42, "device": "cuda"},
    "log": {"every_steps": 1},
    "sample": {"prompt": "In the", "max_new_tokens": 24, "count": 1}
  })";
  const std::string dir = (test::scratch_root() / ("gpu_" + name)).string();
  fs::remove_all(dir);
  sets.push_back("log.dir=\"" + dir + "\"");
  std::ostringstream log;
  TrainResult r = train(parse_run_config(text, sets, kSource), log);
  if (log_out) *log_out = log.str();
  return r;
}

std::vector<double> baseline() {
  std::ifstream f(kSource + "/tests/integration/baseline_tiny_loss.json");
  return json::parse(f)["losses"].get<std::vector<double>>();
}

TEST(CudaTrain, Fp32TracksTheCpuBaselineAndSamples) {
  std::string log;
  const TrainResult r = run("fp32", {"precision.param=\"fp32\""}, &log);
  const auto want = baseline();
  ASSERT_EQ(r.losses.size(), want.size());
  // The CPU and the GPU sum in different orders; fp32 keeps them within 1e-3 over 40 steps.
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(r.losses[i], want[i], 1e-3 * want[i]) << "step " << i + 1;
  EXPECT_NE(log.find("--- sample 1 ---"), std::string::npos) << log;
}

TEST(CudaTrain, Bf16ParametersTrackTheFp32Curve) {
  const TrainResult r = run("bf16", {"precision.param=\"bf16\""});
  const auto want = baseline();
  ASSERT_EQ(r.losses.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_NEAR(r.losses[i], want[i], 0.03 * want[i]) << "step " << i + 1;
}

TEST(CudaTrain, ZeroStagesOffloadAndCheckpointingGiveTheSameLosses) {
  const TrainResult ref = run("ref", {});
  const std::vector<std::vector<std::string>> variants = {
      {"zero.stage=1"},
      {"zero.stage=2"},
      {"zero.stage=3"},
      {"zero.stage=2", "zero.offload_optimizer=\"cpu\""},
      {"zero.stage=3", "zero.offload_optimizer=\"cpu\"", "zero.offload_params=\"cpu\""},
      {"memory.checkpointing=\"selective\""},
      {"memory.checkpointing=\"full\"", "memory.offload_checkpoints=true"},
      // Half the kept layers on the host (the copy stream's prefetch), every 2nd layer's input.
      {"memory.checkpointing=\"full\"", "memory.checkpoint_every=2",
       "memory.offload_checkpoints=0.5"},
      {"memory.mlp_chunk_tokens=48", "memory.loss_chunk_tokens=40"},
  };
  for (size_t v = 0; v < variants.size(); ++v) {
    const TrainResult r = run("variant" + std::to_string(v), variants[v]);
    ASSERT_EQ(r.losses.size(), ref.losses.size());
    std::string what;
    for (const auto& s : variants[v]) what += s + " ";
    // Not bit-identical: the embedding and RMSNorm weight gradients are summed with atomic adds,
    // whose order varies from run to run (~1e-7 per step, grown by 40 steps of training).
    for (size_t i = 0; i < ref.losses.size(); ++i)
      EXPECT_NEAR(r.losses[i], ref.losses[i], 2e-4 * ref.losses[i]) << what << "step " << i + 1;
  }
}

// The LoRA base in host memory (two of its units staged on the device, the next fetched on the
// copy stream) trains the same adapters as the base on the device.
TEST(CudaTrain, LoraBaseOnTheHostGivesTheSameLosses) {
  const std::vector<std::string> lora = {"lora.rank=8", "lora.targets=\"all\"",
                                         "precision.param=\"bf16\""};
  const TrainResult ref = run("lora_ref", lora);
  std::vector<std::string> lean = lora;
  for (const char* s : {"lora.offload_base=true", "memory.checkpointing=\"full\"",
                        "memory.checkpoint_every=2", "memory.offload_checkpoints=true"})
    lean.push_back(s);
  const TrainResult r = run("lora_lean", lean);
  ASSERT_EQ(r.losses.size(), ref.losses.size());
  for (size_t i = 0; i < ref.losses.size(); ++i)
    EXPECT_NEAR(r.losses[i], ref.losses[i], 2e-4 * ref.losses[i]) << "step " << i + 1;
}

// The host waits for the device only where it must see a result, the same number in every step
// (metrics `host_waits`): per micro-batch the loss's read, which also reads the id checks of
// the embedding (forward and backward) and of the loss's targets; per step the gradient norm
// (one read for every segment, the id checks again) and the step's closing synchronize. The
// inputs go up from pinned slots without a wait: a slot's reuse waits only if the device is two
// micro-batches behind, which the loss read of each micro-batch rules out here.
// docs/kernels.md lists them.
TEST(CudaTrain, HostWaitsPerStepAreTheListedOnes) {
  const std::string name = "host_waits";
  run(name, {"precision.param=\"fp32\"", "train.max_steps=6", "train.eval_every=0"});
  constexpr int64_t kMicroBatches = 2;  // train.grad_accum of run()
  constexpr int64_t kPerMicroBatch = 1 /* the loss's read, with the id checks */;
  constexpr int64_t kPerStep = 1 /* gradient norm */ + 1 /* the step's synchronize */;
  std::ifstream f(test::scratch_root() / ("gpu_" + name) / "metrics.jsonl");
  int64_t steps = 0;
  for (std::string line; std::getline(f, line);) {
    const json m = json::parse(line);
    if (!m.contains("tokens_per_s")) continue;  // an evaluation's line
    ASSERT_TRUE(m.contains("host_waits")) << line;
    EXPECT_EQ(m["host_waits"].get<int64_t>(), kMicroBatches * kPerMicroBatch + kPerStep)
        << "step " << m["step"];
    ++steps;
  }
  EXPECT_EQ(steps, 6);
  // MFU's denominator on a GPU is the bf16 tensor-core rate, even for this f32 run.
  std::ifstream sf(test::scratch_root() / ("gpu_" + name) / "summary.json");
  EXPECT_EQ(json::parse(sf)["gemm_flops_dtype"], "bf16");
}

// The step's host waits, per step, from metrics.jsonl.
std::vector<int64_t> host_waits_per_step(const std::string& name) {
  std::ifstream f(test::scratch_root() / ("gpu_" + name) / "metrics.jsonl");
  std::vector<int64_t> waits;
  for (std::string line; std::getline(f, line);) {
    const json m = json::parse(line);
    if (m.contains("tokens_per_s")) waits.push_back(m.value("host_waits", int64_t{-1}));
  }
  return waits;
}

// ZeRO-3 with the LM head in pieces (a 4096-row table of 524K elements against buckets of 15K:
// pieces of a layer's 197K elements, 3 of them): the head's walks add every loss chunk's loss
// on the device and read it once per micro-batch, so 7 loss chunks of 40 rows (256 tokens a
// micro-batch) wait exactly as often as one chunk of all of them. Each chunk of each piece
// used to read its own result: 21 waits where one does.
TEST(CudaTrain, TheHeadInPiecesReadsItsLossOncePerMicroBatch) {
  const std::vector<std::string> sets = {"precision.param=\"fp32\"",
                                         "train.max_steps=3",
                                         "train.eval_every=0",
                                         "zero.stage=3",
                                         "zero.reduce_bucket_bytes=60000",
                                         "model.vocab_size=4096"};
  std::vector<std::string> chunked = sets;
  chunked.push_back("memory.loss_chunk_tokens=40");
  run("pieces_chunked", chunked);
  run("pieces_one_chunk", sets);
  const std::vector<int64_t> waits = host_waits_per_step("pieces_chunked");
  ASSERT_EQ(waits.size(), 3u);
  for (int64_t w : waits) EXPECT_GT(w, 0);
  EXPECT_EQ(waits, host_waits_per_step("pieces_one_chunk"));
}

// A preference objective's step (LoRA DPO: the adapters-off reference forward, then the
// policy's forward and weighted backward) computes its pairs' sums, coefficients and token
// weights on the device: the host sends each micro-batch's segment ids up from pinned slots
// (whose reuse never waits: plan/preference_step.h) and reads the step's metrics once, with
// its loss. The weighted head's gradient walk reads no loss. Per step: the metrics, the
// gradient norm and the closing synchronize. docs/kernels.md lists them.
TEST(CudaTrain, PreferenceStepWaitsForItsMetricsOnce) {
  const std::string name = "preference_waits";
  const fs::path pairs = test::write_pairs_file("gpu_preference_pairs.jsonl");
  run(name, {"precision.param=\"fp32\"", "train.max_steps=4", "train.eval_every=0",
             "data.train=\"" + pairs.string() + "\"", "data.packing=\"samples\"",
             "train.objective=\"dpo\"", "train.dpo.beta=0.1", "lora.rank=4", "lora.alpha=8",
             "lora.targets=\"all\""});
  constexpr int64_t kPerStep = 1 /* the metrics */ + 1 /* gradient norm */ + 1 /* synchronize */;
  EXPECT_EQ(host_waits_per_step(name), std::vector<int64_t>(4, kPerStep));
}

// Over a grid of configurations: the planner's device peak is the ledger's, and cudaMemGetInfo
// agrees with the ledger within the driver's rounding (driver_bounds.h).
TEST(CudaTrain, PlannedDevicePeakEqualsTheLedgerAndTheDriver) {
  const std::vector<std::vector<std::string>> grid = {
      {"zero.stage=3", "memory.checkpointing=\"full\""},
      {"precision.param=\"bf16\"", "zero.stage=1"},
      {"precision.param=\"bf16\"", "zero.stage=2", "zero.offload_optimizer=\"cpu\"",
       "zero.reduce_dtype=\"bf16\"", "memory.checkpointing=\"full\"", "memory.checkpoint_every=2",
       "memory.offload_checkpoints=0.5"},
      {"precision.param=\"bf16\"", "zero.stage=3", "zero.offload_optimizer=\"cpu\"",
       "zero.offload_params=\"cpu\"", "memory.checkpointing=\"selective\"",
       "memory.offload_checkpoints=true"},
      {"precision.param=\"bf16\"", "lora.rank=8", "lora.offload_base=true",
       "memory.checkpointing=\"full\"", "memory.offload_checkpoints=true"},
  };
  for (size_t i = 0; i < grid.size(); ++i) {
    std::vector<std::string> sets = grid[i];
    sets.push_back("train.max_steps=2");
    sets.push_back("train.warmup_steps=0");
    const std::string name = "plan" + std::to_string(i);
    run(name, sets);
    std::ifstream f(test::scratch_root() / ("gpu_" + name) / "memory_rank0.json");
    const json m = json::parse(f);
    for (const char* key : {"peak_by_category", "host_peak_by_category"})
      EXPECT_EQ(m[key], m["planned"][key]) << name << " " << key;
    EXPECT_EQ(m["driver_device_source"], "cudaMemGetInfo") << name;
    test::expect_driver_count_near_ledger(m, name);
  }
}

}  // namespace
}  // namespace shardlm
