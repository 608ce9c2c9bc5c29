// Activation checkpointing and the sequence-tiled MLP: every mode (none, selective, full, with
// and without host offload) gives bitwise the same loss and gradients as keeping everything,
// the device holds strictly less the more is recomputed or offloaded, and chunking the MLP
// changes gradients only by f32 rounding while bounding its transients by the chunk; the
// backward holds no per-consumer share of a norm output's gradient outside sequence parallelism.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
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
#include "shardlm/config/config.h"
#include "shardlm/model/llama.h"
#include "shardlm/model/tensor_shard.h"
#include "shardlm/plan/plan.h"
#include "shardlm/planner/plan_inputs.h"
#include "shardlm/train/trainer.h"
#include "test_util.h"
#include "tolerance.h"

namespace shardlm {
namespace {

// The layers: Llama's with q/k/v biases; Qwen3's q/k norms and heads of 6 (q_dim 24 != dim 16)
// instead; or Gemma 3's (those, with post-norms, GeGLU, (1 + w) norms, scaled embeddings and
// queries, local and global layers).
enum class Layers { kLlama, kQwen3, kGemma3 };

// The finite-difference checks' tiny model, with a third layer.
ModelConfig tiny_config(Layers layers = Layers::kLlama) {
  ModelConfig c = test::grad_check_config("checkpointing", /*tie=*/false, layers == Layers::kLlama);
  c.n_layers = 3;
  if (layers != Layers::kLlama) {
    c.qk_norm = true;
    c.explicit_head_dim = 6;
  }
  if (layers == Layers::kGemma3) {
    c.post_norms = c.norm_one_plus_weight = c.embed_scale = true;
    c.mlp_activation = "gelu_tanh";
    c.query_pre_attn_scalar = 10;
    c.global_layer_every = 2;
    c.rope_local_theta = 1000;
  }
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
  int host_layers = 0;  // of the kept layers, on the host (kAll: every one)
  int every = 1;        // keep every k-th layer's input only
  std::string name() const {
    std::string n = checkpointing_name(checkpointing);
    if (host_layers == CheckpointPlacement::kAll) n += "+offload";
    if (host_layers > 0 && host_layers != CheckpointPlacement::kAll)
      n += "+" + std::to_string(host_layers) + " on the host";
    if (every > 1) n += " every " + std::to_string(every);
    return n;
  }
};

const int kAll = CheckpointPlacement::kAll;
// The tiny model has 3 layers: every 2 keeps layers 0 and 2 (a segment of two and one of
// one), every 3 keeps layer 0 only (one segment recomputed whole).
const Mode kModes[] = {{Checkpointing::kNone},       {Checkpointing::kSelective},
                       {Checkpointing::kFull},       {Checkpointing::kSelective, kAll},
                       {Checkpointing::kFull, kAll}, {Checkpointing::kSelective, 1},
                       {Checkpointing::kFull, 2},    {Checkpointing::kFull, 0, 2},
                       {Checkpointing::kFull, 1, 2}, {Checkpointing::kFull, kAll, 2},
                       {Checkpointing::kFull, 0, 3}, {Checkpointing::kFull, kAll, 3}};

ModelOptions options(const Mode& m, DType param_dtype, int64_t mlp_chunk) {
  ModelOptions opt;
  opt.param_dtype = param_dtype;
  opt.max_batch = 2;
  opt.max_seq = 11;
  opt.loss_chunk_tokens = 7;
  opt.mlp_chunk_tokens = mlp_chunk;
  opt.checkpointing = m.checkpointing;
  opt.checkpoint_placement = {m.every, m.host_layers};
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

Outcome run(const Mode& m, DType param_dtype, int64_t mlp_chunk, Layers layers = Layers::kLlama) {
  const ModelConfig cfg = tiny_config(layers);
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

class CheckpointingTest : public ::testing::TestWithParam<std::tuple<DType, Layers>> {};

TEST_P(CheckpointingTest, EveryModeGivesBitwiseTheSameLossAndGradients) {
  const auto [dtype, layers] = GetParam();
  const Outcome ref = run(kModes[0], dtype, 5, layers);
  ASSERT_EQ(ref.allocations_in_steps, 0);
  for (double loss : ref.losses) ASSERT_TRUE(std::isfinite(loss));
  for (const Mode& m : kModes) {
    SCOPED_TRACE(m.name());
    const Outcome o = run(m, dtype, 5, layers);
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

// Llama-style layers, Qwen3's (q/k norms, whose inputs are recomputed or kept too) and Gemma
// 3's (the post-norms' inputs kept or recomputed, the MLP's by re-running its down projection).
INSTANTIATE_TEST_SUITE_P(ParamDtypes, CheckpointingTest,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values(Layers::kLlama, Layers::kQwen3,
                                                              Layers::kGemma3)),
                         [](const auto& info) {
                           const Layers layers = std::get<1>(info.param);
                           return std::string(dtype_name(std::get<0>(info.param))) +
                                  (layers == Layers::kQwen3    ? "_qk_norm"
                                   : layers == Layers::kGemma3 ? "_gemma3"
                                                               : "");
                         });

// Tied embeddings with bf16 parameters and f32 activations: the LM head's unit (the embeddings)
// is staged after the final norm's, so the final norm's backward converts its weight into its own
// transient (final_norm_w). The same weights held as f32 parameters (nothing staged) give
// bitwise the same loss and gradients.
TEST(Checkpointing, TiedHeadStagedAfterTheFinalNormGivesTheSameGradients) {
  ModelConfig cfg = test::grad_check_config("tied-staging", /*tie=*/true, /*bias=*/false);
  auto be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger_a, ledger_b;
  LlamaModel staged(cfg, options(kModes[0], DType::kBF16, 5), *be, ledger_a);
  LlamaModel plain(cfg, options(kModes[0], DType::kF32, 5), *be, ledger_b);
  staged.init_weights(7);
  const uint16_t* bits = staged.params().bf16();
  for (int64_t i = 0; i < staged.layout().total; ++i)
    plain.params().f32()[i] = bf16_to_f32(bits[i]);
  std::vector<std::vector<float>> grads;
  std::vector<double> losses;
  for (LlamaModel* m : {&staged, &plain}) {
    BatchInputs in = m->inputs(2, 11);
    fill_batch(in, 2, 11, cfg.vocab_size, 3);
    m->zero_grads();
    losses.push_back(m->forward_backward(2, 11, 1.f / 22.f).loss_sum);
    grads.emplace_back(m->grads().f32(), m->grads().f32() + m->layout().total);
  }
  EXPECT_EQ(losses[0], losses[1]);
  EXPECT_TRUE(same_bits(grads[0], grads[1]));
}

// Chunking the MLP only reorders the weight gradients' sums over rows.
TEST(Checkpointing, MlpChunksMatchTheUnchunkedMlpToRounding) {
  for (const Mode& m : {kModes[0], kModes[4]}) {
    SCOPED_TRACE(m.name());
    const Outcome whole = run(m, DType::kF32, 1000);
    const Outcome chunked = run(m, DType::kF32, 5);
    // The largest step: 2 x 11 rows (tests/tolerance.h).
    const double tol = test::reorder_tolerance(test::reduction_chain(tiny_config(), 11, 2));
    for (size_t i = 0; i < whole.losses.size(); ++i)
      EXPECT_NEAR(chunked.losses[i], whole.losses[i], tol * std::abs(whole.losses[i]));
    for (size_t s = 0; s < whole.grads.size(); ++s) {
      double max_abs = 0, max_diff = 0;
      for (size_t i = 0; i < whole.grads[s].size(); ++i) {
        max_abs = std::max(max_abs, double(std::abs(whole.grads[s][i])));
        max_diff = std::max(max_diff, double(std::abs(chunked.grads[s][i] - whole.grads[s][i])));
      }
      EXPECT_LE(max_diff, tol * max_abs) << "step " << s;
    }
  }
}

// The trainer's tiny run: 4 steps of 2 x 2 rows of 64 tokens, ragged MLP chunks.
std::string tiny_run_config() {
  return R"({"model": {"preset": "tiny"},
             "data": {"train": "tests/data/genesis_1_12.txt", "seq_len": 64,
                      "valid_fraction": 0.1},
             "train": {"micro_batch": 2, "grad_accum": 2, "max_steps": 4, "eval_every": 2,
                       "eval_batches": 1, "seed": 5},
             "memory": {"mlp_chunk_tokens": 50}})";
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
  const CheckpointMap map(cfg, m.checkpointing, {m.every, m.host_layers});
  EXPECT_EQ(host, kept_per_layer * map.host_layers());
  EXPECT_EQ(kept_on_device, kept_per_layer * map.device_slots());
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
  for (const TensorSpec& s :
       backward_transients(tiny_config(), 2, 256, C, Checkpointing::kFull, DType::kF32)) {
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

// q/k/v and gate/up accumulate their input gradients into d_norm: no [N, D] per-consumer share,
// except d_part as the seams' gather buffer under sequence parallelism.
TEST(Checkpointing, BackwardTransientsHoldNoConsumerShareWithoutSequenceParallelism) {
  auto names = [](const ModelConfig& c) {
    std::vector<std::string> out;
    for (const TensorSpec& s :
         backward_transients(c, 2, 256, 128, Checkpointing::kNone, DType::kBF16))
      out.push_back(s.name);
    return out;
  };
  auto has = [](const std::vector<std::string>& v, const char* name) {
    return std::find(v.begin(), v.end(), name) != v.end();
  };
  ModelConfig tp2 = tp_shard_config(model_preset("tiny"), 2);
  EXPECT_FALSE(has(names(tiny_config()), "d_part"));
  EXPECT_TRUE(has(names(tiny_config()), "d_norm"));
  tp2.sequence_parallel = false;
  EXPECT_FALSE(has(names(tp2), "d_part"));
  tp2.sequence_parallel = true;
  ASSERT_TRUE(has(names(tp2), "d_part"));
  for (const TensorSpec& s :
       backward_transients(tp2, 2, 256, 128, Checkpointing::kNone, DType::kBF16))
    if (s.name == "d_part") {
      EXPECT_EQ(s.shape, (Shape{2 * 256, tp2.dim}));
    }
  // The final norm's converted weight [D]: only where a tied head is staged after it.
  EXPECT_FALSE(has(names(tiny_config()), "final_norm_w"));
  EXPECT_TRUE(has(names(test::grad_check_config("tied", true, false)), "final_norm_w"));
}

// Post-norms on a tp shard: with the rows whole the MLP's summed output before its norm is one
// chunk's when recomputed; split (sequence parallelism) it is this rank's rows after the
// reduce-scatter, kept in every mode, as the norm's rstd; d_post holds this rank's rows.
TEST(Checkpointing, PostNormsUnderSequenceParallelismKeepTheRanksSummedMlpOutput) {
  ModelConfig tp2 = tp_shard_config(model_preset("tiny"), 2);
  tp2.post_norms = true;
  const int64_t B = 2, T = 256, C = 128, n = B * T / 2, D = tp2.dim;
  auto find = [](const std::vector<TensorSpec>& specs, const char* name) {
    const auto it = std::find_if(specs.begin(), specs.end(),
                                 [&](const TensorSpec& s) { return s.name == name; });
    return it == specs.end() ? Shape{} : it->shape;
  };
  for (Checkpointing mode :
       {Checkpointing::kNone, Checkpointing::kSelective, Checkpointing::kFull}) {
    SCOPED_TRACE(checkpointing_name(mode));
    const bool none = mode == Checkpointing::kNone;
    tp2.sequence_parallel = false;
    const LayerActivationSpecs whole = layer_activation_specs(tp2, B, T, C, mode, DType::kBF16);
    EXPECT_EQ(find(none ? whole.kept : whole.work, "mlp_out"), (Shape{none ? B * T : C, D}));
    EXPECT_EQ(find(none ? whole.kept : whole.work, "rstd_post2"), (Shape{none ? B * T : C}));
    tp2.sequence_parallel = true;
    const LayerActivationSpecs split = layer_activation_specs(tp2, B, T, C, mode, DType::kBF16);
    EXPECT_EQ(find(split.kept, "mlp_out"), (Shape{n, D}));
    EXPECT_EQ(find(split.kept, "rstd_post2"), (Shape{n}));
    EXPECT_EQ(find(split.work, "mlp_out"), Shape{});
    EXPECT_EQ(find(backward_transients(tp2, B, T, C, mode, DType::kBF16), "d_post"), (Shape{n, D}));
  }
}

// Recomputing layers hold their backward's d_attn in x_mid's bytes and (full checkpointing)
// d_norm in attn's, the MLP's chunks then taking d(xn2) in a chunk of their own; none keeps
// both, sequence parallelism (x_mid holds a rank's rows only) too. (work_set_aliases)
// EveryModeGivesBitwiseThe... above proves the placement: a tensor overwritten while still read
// changes the gradients.
TEST(Checkpointing, RecomputedLayersHoldTheirBackwardScratchInTheDeadWorkTensors) {
  auto names = [](const ModelConfig& c, Checkpointing mode) {
    std::vector<std::string> out;
    for (const TensorSpec& s : backward_transients(c, 2, 256, 128, mode, DType::kBF16)) {
      out.push_back(s.name);
      if (s.name == "d_xn2") {
        EXPECT_EQ(s.shape, (Shape{128, c.dim}));
      }
    }
    return out;
  };
  auto has = [](const std::vector<std::string>& v, const char* name) {
    return std::find(v.begin(), v.end(), name) != v.end();
  };
  const ModelConfig c = tiny_config();
  ASSERT_EQ(c.q_dim(), c.dim);
  const auto none = names(c, Checkpointing::kNone);
  const auto selective = names(c, Checkpointing::kSelective);
  const auto full = names(c, Checkpointing::kFull);
  EXPECT_TRUE(has(none, "d_attn") && has(none, "d_norm") && !has(none, "d_xn2"));
  EXPECT_TRUE(!has(selective, "d_attn") && has(selective, "d_norm") && !has(selective, "d_xn2"));
  EXPECT_TRUE(!has(full, "d_attn") && !has(full, "d_norm") && has(full, "d_xn2"));
  ModelConfig tp2 = tp_shard_config(model_preset("tiny"), 2);
  tp2.sequence_parallel = true;
  const auto sp = names(tp2, Checkpointing::kFull);
  EXPECT_TRUE(has(sp, "d_attn") && has(sp, "d_norm"));
  // q narrower than the residual stream (a tp shard's heads): d_attn fits x_mid, d_norm not attn.
  tp2.sequence_parallel = false;
  const auto narrow = names(tp2, Checkpointing::kFull);
  EXPECT_TRUE(!has(narrow, "d_attn") && has(narrow, "d_norm") && !has(narrow, "d_xn2"));
  // The final norm's input and output in the last layer's x_mid and q: a model of one stage
  // whose layers recompute; x_final not with post-norms (their output is normed into it).
  auto saved = [](const ModelConfig& c, Checkpointing mode) {
    std::vector<std::string> out;
    for (const TensorSpec& s : model_saved_activations(c, 2, 256, mode, DType::kBF16))
      out.push_back(s.name);
    return out;
  };
  EXPECT_TRUE(has(saved(c, Checkpointing::kNone), "x_final"));
  EXPECT_TRUE(has(saved(c, Checkpointing::kNone), "xn_final"));
  EXPECT_FALSE(has(saved(c, Checkpointing::kSelective), "x_final"));
  EXPECT_FALSE(has(saved(c, Checkpointing::kFull), "xn_final"));
  ModelConfig last_stage = c;
  last_stage.pp_begin = 1;
  EXPECT_TRUE(has(saved(last_stage, Checkpointing::kFull), "x_final"));
  EXPECT_TRUE(has(saved(last_stage, Checkpointing::kFull), "xn_final"));
  ModelConfig post_norms = c;
  post_norms.post_norms = true;
  EXPECT_TRUE(has(saved(post_norms, Checkpointing::kFull), "x_final"));
  EXPECT_FALSE(has(saved(post_norms, Checkpointing::kFull), "xn_final"));
}

// Through the trainer: the memory.* keys reach the model and the planner. Full checkpointing
// with host offload and ragged MLP chunks trains bitwise the same loss curve as no
// checkpointing, and the planned bytes equal the measured ones in both pools.
struct TrainedRun {
  std::vector<double> losses;
  nlohmann::json memory;  // memory_rank0.json
};

TrainedRun train_tiny(const std::string& name, const std::vector<std::string>& sets) {
  namespace fs = std::filesystem;
  const std::string dir = (shardlm::test::scratch_root() / ("shardlm_ckpt_" + name)).string();
  fs::remove_all(dir);
  std::vector<std::string> all = sets;
  all.push_back("log.dir=\"" + dir + "\"");
  const RunConfig cfg = parse_run_config(tiny_run_config(), all, SHARDLM_SOURCE_DIR);
  std::ostringstream log;
  const TrainResult r = train(cfg, log);
  std::ifstream f(fs::path(dir) / "memory_rank0.json");
  TrainedRun out{r.losses, nlohmann::json::parse(f)};
  for (const char* key : {"peak_by_category", "host_peak_by_category"})
    EXPECT_EQ(out.memory["planned"][key], out.memory[key]) << name << " " << key;
  EXPECT_EQ(out.memory["planned"]["peak_bytes"], out.memory["peak_bytes"]) << name;
  return out;
}

int64_t host_checkpoint_bytes(const TrainedRun& r) {
  return r.memory["host_peak_by_category"]["checkpoints"].get<int64_t>();
}

TEST(Checkpointing, TrainerRunsEveryModeOnTheSameCurveAsPlanned) {
  const TrainedRun none = train_tiny("none", {"memory.checkpointing=\"none\""});
  ASSERT_EQ(none.losses.size(), 4u);
  EXPECT_EQ(host_checkpoint_bytes(none), 0);
  const TrainedRun selective = train_tiny("selective", {"memory.checkpointing=\"selective\""});
  EXPECT_EQ(selective.losses, none.losses);
  EXPECT_EQ(host_checkpoint_bytes(selective), 0);
  const TrainedRun full = train_tiny(
      "full_offload", {"memory.checkpointing=\"full\"", "memory.offload_checkpoints=true"});
  EXPECT_EQ(full.losses, none.losses);
  EXPECT_GT(host_checkpoint_bytes(full), 0);
  const TrainedRun sparse =
      train_tiny("every2_half", {"memory.checkpointing=\"full\"", "memory.checkpoint_every=2",
                                 "memory.offload_checkpoints=0.5"});
  EXPECT_EQ(sparse.losses, none.losses);
  // 4 layers, every 2nd kept: 2 kept, half of them (one layer's input) on the host.
  EXPECT_EQ(host_checkpoint_bytes(sparse) * 4, host_checkpoint_bytes(full));
}

// memory.offload_checkpoints = "auto" puts on the host the fewest kept layers that keep the
// device within memory.budget_gib: with the budget set to the plan of 3 of the 4 layers on
// the host (fewer need more device slots), the run places exactly 3 there.
TEST(Checkpointing, AutoOffloadFillsTheDeviceBudget) {
  const std::vector<std::string> full = {"memory.checkpointing=\"full\""};
  RunConfig three = parse_run_config(tiny_run_config(), full, SHARDLM_SOURCE_DIR);
  three.memory.offload_checkpoints = {0.75, false};
  auto be = make_backend(DeviceKind::kCpu);
  const PlanInputs pin = plan_inputs_for(three, 1, *be);
  ASSERT_EQ(pin.checkpoint_placement.host_layers, 3);
  const int64_t device = plan_memory(pin).peak_bytes[int(MemPool::kDevice)];
  const double budget_gib = double(device) / double(int64_t{1} << 30);
  std::vector<std::string> sets = full;
  sets.push_back("memory.offload_checkpoints=\"auto\"");
  sets.push_back(fmt::format("memory.budget_gib={:.17g}", budget_gib));
  const TrainedRun run = train_tiny("auto", sets);
  const int64_t kept = int64_t(arena_bytes(
      layer_activation_specs(pin.model, pin.micro_batch, pin.seq_len, pin.mlp_chunk_tokens,
                             Checkpointing::kFull, pin.activation_dtype)
          .kept));
  EXPECT_EQ(host_checkpoint_bytes(run), 3 * kept);
  EXPECT_EQ(run.memory["peak_bytes"]["device"].get<int64_t>(), device);
  EXPECT_EQ(run.losses, train_tiny("auto_ref", full).losses);
}

}  // namespace
}  // namespace shardlm
