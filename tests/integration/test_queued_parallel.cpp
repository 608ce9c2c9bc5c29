// train.device = "cpu-queued" (backend/queued.h) computes what "cpu" computes, bit for bit:
// every op runs only when the host waits for it, as on a GPU, so an engine path that read
// device memory on the host without a copy, or wrote host memory a queued op still reads,
// would change the numbers. The scenarios are test_cuda_shared_gpu's (several ranks on one
// device, device tensors staged through the host world), with activation checkpoints and the
// LoRA base offloaded (copy_async and its fences), and the preference objectives' segment ids
// (copy_async from pinned slots, the pairs' arithmetic in queued ops), each run both ways with the
// same settings: the same losses and the same final weights, and the plan equal to the ledger.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "integration/tiny_runs.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

using shardlm::test::checkpoint_vector;
using shardlm::test::metric_series;
using shardlm::test::slurp;

constexpr int kSteps = 4;
const std::string kLora = " --set lora.rank=4 --set lora.alpha=8 --set lora.targets=all ";

struct Case {
  int ranks, micro, accum;
  const char* name;
  std::string sets;
};

fs::path run_on(const std::string& device, const Case& c) {
  const std::string staged = c.ranks > 1 ? " --set parallel.device_comm=host" : "";
  return shardlm::test::train_tiny(c.ranks, c.micro, c.accum,
                                   "shardlm_queued_" + std::string(c.name) + "_" + device, kSteps,
                                   true, "--set train.device=" + device + staged + " " + c.sets);
}

void expect_same_bits(const std::vector<Case>& cases) {
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path eager = run_on("cpu", c), queued = run_on("cpu-queued", c);
    const std::vector<double> want = metric_series(eager, "loss");
    ASSERT_EQ(want.size(), size_t(kSteps));
    EXPECT_EQ(metric_series(queued, "loss"), want);
    EXPECT_EQ(metric_series(queued, "grad_norm"), metric_series(eager, "grad_norm"));
    EXPECT_TRUE(checkpoint_vector(queued, kSteps, "params") ==
                checkpoint_vector(eager, kSteps, "params"))
        << "the final weights differ";
    for (int r = 0; r < c.ranks; ++r) {
      const json mem = json::parse(slurp(queued / ("memory_rank" + std::to_string(r) + ".json")));
      EXPECT_EQ(mem["peak_by_category"], mem["planned"]["peak_by_category"]) << "rank " << r;
      EXPECT_EQ(mem["host_peak_by_category"], mem["planned"]["host_peak_by_category"])
          << "rank " << r;
    }
  }
}

TEST(QueuedDevice, OneRankWithOffloadedCheckpointsAndLoraBase) {
  expect_same_bits({Case{1, 4, 2, "ckpt_offload",  // 6 layers: the backward fetches from the host
                         "--set model.n_layers=6 --set memory.checkpointing=full "
                         "--set memory.offload_checkpoints=true"},
                    Case{1, 4, 2, "bf16_selective",
                         "--set precision.activations=bf16 --set memory.checkpointing=selective"},
                    Case{1, 4, 2, "lora_base_host", kLora + "--set lora.offload_base=true"}});
}

TEST(QueuedDevice, ZeroTensorAndContextParallelOnSharedDevice) {
  expect_same_bits(
      {Case{2, 2, 2, "z0", "--set zero.stage=0"},
       Case{2, 2, 2, "z2_offload", "--set zero.stage=2 --set zero.offload_optimizer=cpu"},
       Case{2, 2, 2, "z3", "--set zero.stage=3 --set zero.reduce_bucket_bytes=60000"},
       Case{2, 2, 2, "z3_offload",
            "--set zero.stage=3 --set zero.offload_optimizer=cpu --set zero.offload_params=cpu"},
       Case{2, 4, 2, "tp2_sp", "--set parallel.tp=2 --set parallel.sequence_parallel=true"},
       Case{2, 4, 2, "ulysses2", "--set parallel.cp=2 --set parallel.cp_kind=ulysses"},
       Case{2, 4, 2, "ring2", "--set parallel.cp=2 --set parallel.cp_kind=ring"},
       Case{4, 4, 2, "hybrid4", "--set parallel.cp=4 --set parallel.cp_kind=hybrid"}});
}

TEST(QueuedDevice, PipelineGridsOnSharedDevice) {
  expect_same_bits({Case{2, 2, 4, "pp2", "--set parallel.pp=2"},
                    Case{4, 2, 2, "dp2_pp2", "--set parallel.pp=2 --set zero.stage=1"},
                    Case{4, 2, 4, "pp2_tp2", "--set parallel.pp=2 --set parallel.tp=2"},
                    Case{4, 2, 4, "pp2_cp2",
                         "--set parallel.pp=2 --set parallel.cp=2 --set parallel.cp_kind=ring"}});
}

// The preference objectives' step on the device: each micro-batch's segment ids (and full
// fine-tuning DPO's reference sums) written into a pinned slot and taken up by copy_async, the
// slot written again three micro-batches later; the pairs' sums, coefficients and token weights
// computed by queued ops (under cp the sums all-reduced in place), the metrics read at the
// step's end (one rank, two pipeline stages, two cp ranks; LoRA DPO with its adapters-off
// reference, full fine-tuning SimPO and DPO with its table).
TEST(QueuedDevice, PreferenceObjectivesUploadTheirSegmentIdsInOrder) {
  static const fs::path pairs = shardlm::test::write_pairs_file("queued_pairs.jsonl");
  const std::string data = " --set data.train=" + pairs.string() + " --set data.packing=samples ";
  const std::string dpo = data + "--set train.objective=dpo --set train.dpo.beta=0.1 ";
  const std::string simpo = data + "--set train.objective=simpo --set train.simpo.beta=0.1 ";
  expect_same_bits({Case{1, 2, 4, "dpo_lora", dpo + kLora}, Case{1, 2, 2, "simpo_full", simpo},
                    Case{1, 2, 2, "dpo_full", dpo},
                    Case{2, 2, 4, "dpo_lora_pp2", dpo + kLora + "--set parallel.pp=2"},
                    Case{2, 2, 2, "dpo_lora_ring2",
                         dpo + kLora + "--set parallel.cp=2 --set parallel.cp_kind=ring"}});
}

TEST(QueuedDevice, LoraOnEveryAxisOnSharedDevice) {
  expect_same_bits(
      {Case{2, 4, 2, "lora_tp2", kLora + "--set parallel.tp=2"},
       Case{2, 2, 4, "lora_pp2", kLora + "--set parallel.pp=2"},
       Case{2, 2, 2, "lora_z3", kLora + "--set zero.stage=3"},
       Case{2, 2, 2, "lora_z3_base_host",
            kLora + "--set zero.stage=3 --set lora.offload_base=true"},
       Case{4, 2, 4, "lora_pp2_tp2", kLora + "--set parallel.pp=2 --set parallel.tp=2"}});
}

// log.profile wraps the queued backend: each op's time is its run (the profiler waits for the
// queue after every op), every family is timed, and the numbers are the unprofiled run's.
TEST(QueuedDevice, ProfileTimesEveryOpFamilyOverTheQueue) {
  const Case plain{1, 4, 2, "profile", ""};
  const fs::path eager = run_on("cpu", plain);
  const fs::path profiled =
      run_on("cpu-queued", Case{1, 4, 2, "profile", "--set log.profile=true"});
  EXPECT_EQ(metric_series(profiled, "loss"), metric_series(eager, "loss"));
  const json profile = json::parse(slurp(profiled / "summary.json"))["profile"];
  ASSERT_EQ(profile.size(), 9u) << profile.dump();
  for (const char* family : {"linear (GEMM)", "attention", "lm head + loss", "rmsnorm", "rope",
                             "swiglu", "embedding", "optimizer", "elementwise"})
    EXPECT_GT(profile.value(family, 0.0), 0.0) << family << " in " << profile.dump();
}

// The host's waits in a step, counted as a GPU counts them (QueuedBackend::host_waits), at 2
// micro-batches a step. SFT: one per micro-batch, the loss's read (with the id checks), and per
// step the gradient norm's one read and the step's closing synchronize; the inputs go up from
// the pinned slots without a wait. ZeRO-3 with the head in 3 pieces and 7 loss chunks a
// micro-batch reads each micro-batch's loss once too. The preference objectives (LoRA DPO
// with its reference forward, full fine-tuning DPO with its table, SimPO) compute their pairs
// on the device and read the step's metrics once: the norm, the synchronize and the metrics.
// CudaTrain's host-wait tests hold a GPU to the same counts; docs/kernels.md lists them. The
// queue runs a copy only when a fence needs it, so its count is a device's or more: a
// host_wait_fence that a GPU would find passed can still find the copy queued here.
TEST(QueuedDevice, HostWaitsPerStepAreTheListedOnes) {
  constexpr int kMicroBatches = 2;
  constexpr double kPerStep = 1 /* gradient norm */ + 1 /* the step's synchronize */;
  static const fs::path pairs = shardlm::test::write_pairs_file("queued_wait_pairs.jsonl");
  const std::string data = " --set data.train=" + pairs.string() + " --set data.packing=samples ";
  const std::string dpo = data + "--set train.objective=dpo --set train.dpo.beta=0.1 ";
  const std::string simpo = data + "--set train.objective=simpo --set train.simpo.beta=0.1 ";
  struct Counted {
    Case run;
    double waits;
  };
  const std::vector<Counted> cases = {
      {Case{1, 4, kMicroBatches, "waits_sft", ""}, kMicroBatches * 1 /* loss */ + kPerStep},
      {Case{1, 4, kMicroBatches, "waits_pieces",
            "--set zero.stage=3 --set zero.reduce_bucket_bytes=60000 --set model.vocab_size=4096 "
            "--set memory.loss_chunk_tokens=40"},
       kMicroBatches * 1 /* loss */ + kPerStep},
      {Case{1, 2, kMicroBatches, "waits_dpo_lora", dpo + kLora}, 1 /* metrics */ + kPerStep},
      {Case{1, 2, kMicroBatches, "waits_dpo_full", dpo}, 1 /* metrics */ + kPerStep},
      {Case{1, 2, kMicroBatches, "waits_simpo", simpo}, 1 /* metrics */ + kPerStep}};
  for (const Counted& c : cases) {
    SCOPED_TRACE(c.run.name);
    const std::vector<double> waits = metric_series(run_on("cpu-queued", c.run), "host_waits");
    EXPECT_EQ(waits, std::vector<double>(kSteps, c.waits));
  }
}

// Short documents, a blank line apart (the corpus' verses cut to 12-40 characters): with the
// byte-level tokenizer every 64-token row holds several, so every micro-batch's rows are packed.
fs::path write_short_documents(const std::string& file_name) {
  const fs::path p = shardlm::test::scratch_root() / file_name;
  std::ifstream in(shardlm::test::kTinyCorpus);
  std::ofstream out(p);
  size_t i = 0;
  for (std::string l; std::getline(in, l);)
    if (l.size() > 40) out << l.substr(0, 12 + i++ % 29) << "\n\n";
  return p;
}

// Ulysses over 2 ranks with packed documents on cpu-queued: each micro-batch's group document
// starts and their spans go up by copy_async from host halves used in turn, and add no wait.
// The listed waits, per micro-batch: the loss's read, and each all-to-all of the staged world
// (every collective on device tensors is copied through the host, each of its copies a wait:
// the P pieces in and the P pieces out of one chunk, the tensors being far smaller than a
// staging slot), 4 a layer forward (q, k, v, out) and 8 backward (out, dout, q, k, v gathered
// again; dq, dk, dv back). Per step: the cp ranks' gradient all-reduce (one bucket of one chunk:
// a copy in, a copy out), the gradient norm and the closing synchronize. In this world every
// collective drains the queue, so the device is never a micro-batch behind when the next is
// sharded here: ContextParallel.UlyssesShardsAheadOfADeviceOneMicroBatchBehind holds the halves
// to that case.
TEST(QueuedDevice, UlyssesPackedDocumentsWaitOnlyTheListedWaits) {
  constexpr int kRanks = 2, kMicroBatches = 2, kLayers = 2;  // train_tiny's 2 layers
  constexpr double kAllToAllCopies = 2 * kRanks, kAllToAllsPerLayer = 4 + 8;
  constexpr double kPerMicroBatch = 1 /* loss */ + kLayers * kAllToAllsPerLayer * kAllToAllCopies;
  constexpr double kPerStep = 2 /* gradient all-reduce */ + 1 /* norm */ + 1 /* synchronize */;
  static const fs::path docs = write_short_documents("queued_short_documents.txt");
  const Case run{
      kRanks, 4, kMicroBatches, "waits_ulysses_packed",
      "--set data.train=" + docs.string() + " --set parallel.cp=2 --set parallel.cp_kind=ulysses"};
  EXPECT_EQ(metric_series(run_on("cpu-queued", run), "host_waits"),
            std::vector<double>(kSteps, kMicroBatches * kPerMicroBatch + kPerStep));
}

TEST(QueuedDevice, SeveralRanksNeedTheStagedWorld) {
  const fs::path dir = shardlm::test::scratch_root() / "shardlm_queued_error";
  fs::create_directories(dir);
  const int code = shardlm::test::run_shardlm(
      2,
      " train --config " + std::string(SHARDLM_SOURCE_DIR) +
          "/configs/demo.json --set data.train=" + shardlm::test::kTinyCorpus +
          " --set train.device=cpu-queued --set log.dir=" + (dir / "run").string(),
      dir / "out.txt");
  EXPECT_EQ(code, 2);
  EXPECT_NE(slurp(dir / "out.txt").find("parallel.device_comm = \"host\""), std::string::npos)
      << slurp(dir / "out.txt");
}

}  // namespace
