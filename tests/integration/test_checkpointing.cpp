// Activation checkpointing and the sequence-tiled MLP: every mode (none, selective, full, with
// and without host offload) gives bitwise the same loss and gradients as keeping everything,
// the device holds strictly less the more is recomputed or offloaded, and chunking the MLP
// changes gradients only by f32 rounding while bounding its transients by the chunk.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "integration/grad_check_model.h"
#include "shardlm/backend/backend.h"
#include "shardlm/model/llama.h"
#include "shardlm/train/config.h"
#include "shardlm/train/trainer.h"
#include "test_util.h"

namespace shardlm {
namespace {

// The finite-difference checks' tiny model, with a third layer.
ModelConfig tiny_config() {
  ModelConfig c = test::grad_check_config("checkpointing", /*tie=*/false, /*bias=*/true);
  c.n_layers = 3;
  return c;
}

// B rows of T tokens, packed: two documents per row split at a row-dependent point, a few
// ignored targets.
void fill_batch(BatchInputs& in, int64_t B, int64_t T, int64_t V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t split = 3 + 2 * b;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t i = b * T + t;
      const int64_t start = t < split ? 0 : split;
      in.tokens.i32()[i] = int32_t(rng() % V);
      in.targets.i32()[i] = (t % 5 == 4) ? kIgnoreIndex : int32_t(rng() % V);
      in.positions.i32()[i] = int32_t(t - start);
      in.seg_start.i32()[i] = int32_t(start);
    }
  }
}

struct Mode {
  Checkpointing checkpointing;
  bool offload;
  std::string name() const {
    return checkpointing_name(checkpointing) + (offload ? "+offload" : "");
  }
};

const Mode kModes[] = {{Checkpointing::kNone, false},
                       {Checkpointing::kSelective, false},
                       {Checkpointing::kFull, false},
                       {Checkpointing::kSelective, true},
                       {Checkpointing::kFull, true}};

ModelOptions options(const Mode& m, DType param_dtype, int64_t mlp_chunk) {
  ModelOptions opt;
  opt.param_dtype = param_dtype;
  opt.max_batch = 2;
  opt.max_seq = 11;
  opt.loss_chunk_tokens = 7;
  opt.mlp_chunk_tokens = mlp_chunk;
  opt.checkpointing = m.checkpointing;
  opt.offload_checkpoints = m.offload;
  return opt;
}

// What a run produces: losses and gradients of a full-size and a smaller micro-batch, the
// evaluation loss and the last logits.
struct Outcome {
  std::vector<double> losses;
  std::vector<std::vector<float>> grads;
  std::vector<float> logits;
  int64_t allocations_in_steps = 0;
};

Outcome run(const Mode& m, DType param_dtype, int64_t mlp_chunk) {
  const ModelConfig cfg = tiny_config();
  auto be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  LlamaModel model(cfg, options(m, param_dtype, mlp_chunk), *be, ledger);
  model.init_weights(7);
  Outcome out;
  auto step = [&](int64_t B, int64_t T, uint64_t seed) {
    BatchInputs in = model.inputs(B, T);
    fill_batch(in, B, T, cfg.vocab_size, seed);
    model.zero_grads();
    const LossResult r = model.forward_backward(B, T, 1.f / float(B * T));
    out.losses.push_back(r.loss_sum);
    const float* g = model.grads().f32();
    out.grads.emplace_back(g, g + model.layout().total);
  };
  step(2, 11, 3);  // 22 rows: MLP chunks of 5, 5, 5, 5, 2
  const int64_t allocs = ledger.alloc_count();
  step(2, 11, 4);  // the steady state: same shape, nothing allocated
  step(1, 9, 5);   // a smaller micro-batch re-carves the views
  out.allocations_in_steps = ledger.alloc_count() - allocs;
  out.losses.push_back(model.forward_loss(1, 9).loss_sum);
  model.forward_last_logits(9, out.logits);
  return out;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

class CheckpointingTest : public ::testing::TestWithParam<DType> {};

TEST_P(CheckpointingTest, EveryModeGivesBitwiseTheSameLossAndGradients) {
  const DType dtype = GetParam();
  const Outcome ref = run(kModes[0], dtype, 5);
  ASSERT_EQ(ref.allocations_in_steps, 0);
  for (double loss : ref.losses) ASSERT_TRUE(std::isfinite(loss));
  for (const Mode& m : kModes) {
    SCOPED_TRACE(m.name());
    const Outcome o = run(m, dtype, 5);
    EXPECT_EQ(o.allocations_in_steps, 0);
    ASSERT_EQ(o.losses.size(), ref.losses.size());
    for (size_t i = 0; i < ref.losses.size(); ++i)
      EXPECT_EQ(std::memcmp(&o.losses[i], &ref.losses[i], sizeof(double)), 0)
          << "loss " << i << ": " << o.losses[i] << " vs " << ref.losses[i];
    for (size_t i = 0; i < ref.grads.size(); ++i)
      EXPECT_TRUE(same_bits(o.grads[i], ref.grads[i])) << "gradients of step " << i;
    EXPECT_TRUE(same_bits(o.logits, ref.logits));
  }
}

INSTANTIATE_TEST_SUITE_P(ParamDtypes, CheckpointingTest,
                         ::testing::Values(DType::kF32, DType::kBF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// Chunking the MLP only reorders the weight gradients' sums over rows.
TEST(Checkpointing, MlpChunksMatchTheUnchunkedMlpToRounding) {
  for (const Mode& m : {kModes[0], kModes[4]}) {
    SCOPED_TRACE(m.name());
    const Outcome whole = run(m, DType::kF32, 1000);
    const Outcome chunked = run(m, DType::kF32, 5);
    for (size_t i = 0; i < whole.losses.size(); ++i)
      EXPECT_NEAR(chunked.losses[i], whole.losses[i], 1e-5 * std::abs(whole.losses[i]));
    for (size_t s = 0; s < whole.grads.size(); ++s) {
      double max_abs = 0, max_diff = 0;
      for (size_t i = 0; i < whole.grads[s].size(); ++i) {
        max_abs = std::max(max_abs, double(std::abs(whole.grads[s][i])));
        max_diff = std::max(max_diff, double(std::abs(chunked.grads[s][i] - whole.grads[s][i])));
      }
      EXPECT_LE(max_diff, 1e-5 * max_abs) << "step " << s;
    }
  }
}

// A model of the size where the differences show, constructed in each mode.
struct Bytes {
  int64_t device, host_checkpoints, activations;
};

Bytes bytes_of(const Mode& m, int64_t mlp_chunk) {
  ModelConfig cfg = tiny_config();
  cfg.dim = 64;
  cfg.n_layers = 4;
  cfg.ffn_dim = 172;
  cfg.vocab_size = 256;
  auto be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  ModelOptions opt = options(m, DType::kF32, mlp_chunk);
  opt.max_batch = 2;
  opt.max_seq = 256;
  LlamaModel model(cfg, opt, *be, ledger);
  model.init_weights(1);
  BatchInputs in = model.inputs(2, 256);
  fill_batch(in, 2, 256, cfg.vocab_size, 9);
  model.zero_grads();
  const int64_t peak_before = ledger.peak_total(MemPool::kDevice);
  const LossResult r = model.forward_backward(2, 256, 1.f / 512);
  EXPECT_TRUE(std::isfinite(r.loss_sum));
  EXPECT_EQ(ledger.peak_total(MemPool::kDevice), peak_before);  // the step allocates nothing
  const int64_t act = ledger.current(MemPool::kDevice, MemCategory::kActivations);
  const int64_t kept_on_device = ledger.current(MemPool::kDevice, MemCategory::kCheckpoints);
  const int64_t host = ledger.current(MemPool::kHost, MemCategory::kCheckpoints);
  const int64_t kept_per_layer = int64_t(arena_bytes(
      layer_activation_specs(cfg, 2, 256, mlp_chunk, m.checkpointing, DType::kF32).kept));
  EXPECT_EQ(host, m.offload ? kept_per_layer * cfg.n_layers : 0);
  EXPECT_EQ(kept_on_device, kept_per_layer * (m.offload ? 2 : cfg.n_layers));
  std::printf(
      "%-18s mlp_chunk %4lld: device activations %8lld + checkpoints %8lld = %8lld B; "
      "host checkpoints %8lld B\n",
      m.name().c_str(), static_cast<long long>(mlp_chunk), static_cast<long long>(act),
      static_cast<long long>(kept_on_device), static_cast<long long>(act + kept_on_device),
      static_cast<long long>(host));
  return {act + kept_on_device, host, act};
}

TEST(Checkpointing, DeviceBytesShrinkWithEveryModeAndOffloadMovesThemToTheHost) {
  const Bytes none = bytes_of(kModes[0], 128);
  const Bytes selective = bytes_of(kModes[1], 128);
  const Bytes full = bytes_of(kModes[2], 128);
  const Bytes full_offload = bytes_of(kModes[4], 128);
  EXPECT_GT(none.device, selective.device);
  EXPECT_GT(selective.device, full.device);
  EXPECT_GT(full.device, full_offload.device);
  EXPECT_EQ(none.host_checkpoints, 0);
  EXPECT_EQ(full.host_checkpoints, 0);
  EXPECT_GT(full_offload.host_checkpoints, 0);
}

// The MLP's [rows, F] transients (h, d_h, d_up; and gate, up when recomputed) are one chunk.
TEST(Checkpointing, MlpTransientsAreBoundedByTheChunk) {
  const int64_t N = 512, F = 172, C = 128;
  for (const TensorSpec& s : backward_transients(tiny_config(), 2, 256, C, DType::kF32)) {
    if (s.name == "ffn_h" || s.name == "d_h" || s.name == "d_up") {
      EXPECT_EQ(s.shape[0], C);
    }
  }
  const int64_t f32 = 4;
  // none keeps gate and up per layer, so only the three transients shrink; full recomputes
  // gate and up too, in the work set.
  const int64_t none_saved =
      bytes_of(kModes[0], N).activations - bytes_of(kModes[0], C).activations;
  EXPECT_GE(none_saved, 3 * (N - C) * F * f32);
  const int64_t full_saved =
      bytes_of(kModes[2], N).activations - bytes_of(kModes[2], C).activations;
  EXPECT_GE(full_saved, 5 * (N - C) * F * f32);
}

// Through the trainer: the memory.* keys reach the model and the planner. Full checkpointing
// with host offload and ragged MLP chunks trains bitwise the same loss curve as no
// checkpointing, and the planned bytes equal the measured ones in both pools.
TEST(Checkpointing, TrainerRunsEveryModeOnTheSameCurveAsPlanned) {
  namespace fs = std::filesystem;
  using json = nlohmann::json;
  const std::string source = SHARDLM_SOURCE_DIR;
  auto run_with = [&](const std::string& mode, bool offload) {
    const std::string dir =
        (shardlm::test::scratch_root() / ("shardlm_ckpt_" + mode + (offload ? "_off" : "")))
            .string();
    fs::remove_all(dir);
    const RunConfig cfg = parse_run_config(
        R"({"model": {"preset": "tiny"},
            "data": {"train": "tests/data/genesis_1_12.txt", "seq_len": 64,
                     "valid_fraction": 0.1},
            "train": {"micro_batch": 2, "grad_accum": 2, "max_steps": 4, "eval_every": 2,
                      "eval_batches": 1, "seed": 5},
            "memory": {"mlp_chunk_tokens": 50}})",
        {"memory.checkpointing=\"" + mode + "\"",
         std::string("memory.offload_checkpoints=") + (offload ? "true" : "false"),
         "log.dir=\"" + dir + "\""},
        source);
    std::ostringstream log;
    const TrainResult r = train(cfg, log);
    std::ifstream f(fs::path(dir) / "memory_rank0.json");
    const json mem = json::parse(f);
    for (const char* key : {"peak_by_category", "host_peak_by_category"})
      EXPECT_EQ(mem["planned"][key], mem[key]) << mode << " " << key;
    EXPECT_EQ(mem["planned"]["peak_bytes"], mem["peak_bytes"]) << mode;
    EXPECT_EQ(mem["host_peak_by_category"]["checkpoints"].get<int64_t>() > 0, offload) << mode;
    return r.losses;
  };
  const std::vector<double> none = run_with("none", false);
  ASSERT_EQ(none.size(), 4u);
  EXPECT_EQ(run_with("selective", false), none);
  EXPECT_EQ(run_with("full", true), none);
}

}  // namespace
}  // namespace shardlm
