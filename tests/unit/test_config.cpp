// Tests of the JSON run-config loader (src/config/config.cpp): round trip through
// run_config_to_json, presets with overrides, --set, relative data paths, the configs that
// compose and the file errors (malformed configs: test_config_errors.cpp).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardlm/config/config.h"
#include "shardlm/core/check.h"
#include "shardlm/model/layout.h"
#include "shardlm/planner/plan_inputs.h"

#include "test_util.h"
#include "unit/run_config_samples.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

using test::kFullConfig;
using test::kMinimalConfig;
using test::parse;
using test::with;

TEST(RunConfig, FullConfigParsesEveryKey) {
  const RunConfig c = parse(kFullConfig);
  EXPECT_EQ(c.model_preset, "tiny");
  EXPECT_EQ(c.model.dim, 96);
  EXPECT_EQ(c.model.n_layers, 3);
  EXPECT_EQ(c.model.n_heads, 6);
  EXPECT_EQ(c.model.n_kv_heads, 3);
  EXPECT_EQ(c.model.ffn_dim, 256);
  EXPECT_EQ(c.model.vocab_size, 300);
  EXPECT_DOUBLE_EQ(c.model.rope_theta, 50000.5);
  EXPECT_EQ(c.model.rope_scaling.type, "llama3");
  EXPECT_DOUBLE_EQ(c.model.rope_scaling.factor, 4.0);
  EXPECT_DOUBLE_EQ(c.model.rope_scaling.low_freq_factor, 1.5);
  EXPECT_DOUBLE_EQ(c.model.rope_scaling.high_freq_factor, 3.5);
  EXPECT_EQ(c.model.rope_scaling.original_max_position, 1024);
  EXPECT_DOUBLE_EQ(c.model.norm_eps, 1e-6);
  EXPECT_TRUE(c.model.tie_embeddings);
  EXPECT_TRUE(c.model.attn_bias);
  EXPECT_EQ(c.model.explicit_head_dim, 24);
  EXPECT_EQ(c.model.q_dim(), 6 * 24);  // wider than dim: heads of their own width
  EXPECT_TRUE(c.model.qk_norm);
  EXPECT_EQ(c.data.train, "/data/train.txt");
  EXPECT_EQ(c.data.valid, "/data/valid.txt");
  EXPECT_DOUBLE_EQ(c.data.valid_fraction, 0.1);
  EXPECT_EQ(c.data.seq_len, 64);
  EXPECT_EQ(c.train.micro_batch, 4);
  EXPECT_EQ(c.train.grad_accum, 2);
  EXPECT_EQ(c.train.epochs, 0);
  EXPECT_EQ(c.train.max_steps, 100);
  EXPECT_DOUBLE_EQ(c.train.lr, 0.001);
  EXPECT_DOUBLE_EQ(c.train.min_lr, 0.0001);
  EXPECT_EQ(c.train.warmup_steps, 5);
  EXPECT_DOUBLE_EQ(c.train.weight_decay, 0.05);
  EXPECT_DOUBLE_EQ(c.train.beta1, 0.8);
  EXPECT_DOUBLE_EQ(c.train.beta2, 0.99);
  EXPECT_DOUBLE_EQ(c.train.eps, 1e-7);
  EXPECT_DOUBLE_EQ(c.train.grad_clip, 0.5);
  EXPECT_EQ(c.train.seed, 18446744073709551615ull);
  EXPECT_EQ(c.train.eval_every, 10);
  EXPECT_EQ(c.train.eval_batches, 3);
  EXPECT_EQ(c.precision.param, "bf16");
  EXPECT_EQ(c.parallel.cp_kind, "hybrid");
  EXPECT_EQ(c.parallel.cp_ulysses, 1);
  EXPECT_FALSE(c.parallel.sequence_parallel);
  EXPECT_FALSE(c.zero.overlap_comm);
  EXPECT_EQ(c.zero.reduce_bucket_bytes, 1000);
  EXPECT_EQ(c.zero.allgather_bucket_bytes, 2000);
  EXPECT_EQ(c.zero.prefetch_layers, 2);
  EXPECT_EQ(c.zero.reduce_dtype, "f32");  // the first name of fp32, still accepted
  EXPECT_EQ(c.memory.checkpointing, "selective");
  EXPECT_EQ(c.memory.offload_checkpoints, (CheckpointOffload{1.0, false}));
  EXPECT_EQ(c.memory.loss_chunk_tokens, 512);
  EXPECT_EQ(c.memory.mlp_chunk_tokens, 200);
  EXPECT_DOUBLE_EQ(c.memory.budget_gib, 1.5);
  EXPECT_EQ(c.log.dir, "/runs/x");
  EXPECT_EQ(c.log.every_steps, 7);
  EXPECT_EQ(c.sample.prompt, "Once upon");
  EXPECT_EQ(c.sample.max_new_tokens, 50);
  EXPECT_DOUBLE_EQ(c.sample.temperature, 0.0);
  EXPECT_EQ(c.sample.top_k, 5);
  EXPECT_EQ(c.sample.count, 1);
}

TEST(RunConfig, RoundTripsThroughToJson) {
  const RunConfig a = parse(kFullConfig);
  const json ja = run_config_to_json(a);
  // Written and read back as text, the way summary.json would be.
  const RunConfig b = parse(ja.dump(2));
  EXPECT_EQ(run_config_to_json(b), ja);
  EXPECT_EQ(b.train.seed, a.train.seed);
  EXPECT_EQ(b.train.lr, a.train.lr);  // exact: doubles must survive the text form bit for bit
  EXPECT_EQ(b.model.norm_eps, a.model.norm_eps);
  EXPECT_EQ(b.model.rope_scaling.factor, a.model.rope_scaling.factor);
  EXPECT_EQ(b.sample.prompt, a.sample.prompt);
}

TEST(RunConfig, ToJsonHasEverySectionAndResolvedModel) {
  const json j = run_config_to_json(parse(kMinimalConfig));
  for (const char* section :
       {"model", "data", "train", "precision", "parallel", "zero", "memory", "log", "sample"})
    EXPECT_TRUE(j.contains(section) && j[section].is_object()) << section;
  const ModelConfig tiny = model_preset("tiny");
  EXPECT_EQ(j["model"]["preset"], "tiny");
  EXPECT_EQ(j["model"]["dim"], tiny.dim);
  EXPECT_EQ(j["model"]["vocab_size"], tiny.vocab_size);
  EXPECT_EQ(j["model"]["rope_scaling"]["type"], "none");
  EXPECT_EQ(j["model"]["rope_scaling"]["original_max_position"], 8192);
  EXPECT_EQ(j["train"]["max_steps"], 10);
  EXPECT_EQ(j["train"]["micro_batch"], 8);  // default
  EXPECT_EQ(j["sample"]["count"], 2);
  EXPECT_EQ(j["memory"]["checkpointing"], "none");
  EXPECT_EQ(j["memory"]["offload_checkpoints"], false);
  EXPECT_EQ(j["memory"]["mlp_chunk_tokens"], 1024);
  EXPECT_EQ(j["parallel"], json::parse(R"({"tp": 1, "pp": 1, "cp": 1, "cp_kind": "ulysses",
                                          "cp_ulysses": 0, "cp_keep_gathered": false,
                                          "sequence_parallel": true,
                                          "device_comm": "nccl",
                                          "device_comm_staging_kib": 16384})"));
  EXPECT_EQ(j["zero"], json::parse(R"({"stage": 0, "offload_optimizer": "none",
      "offload_params": "none", "overlap_comm": true, "reduce_bucket_bytes": 25000000,
      "allgather_bucket_bytes": 25000000, "prefetch_layers": 1, "reduce_dtype": "fp32"})"));
}

TEST(RunConfig, Bf16ReductionsFromStage2) {
  for (const char* stage : {"2", "3"}) {
    const RunConfig c =
        parse(kFullConfig, {std::string("zero.stage=") + stage, "zero.reduce_dtype=bf16"});
    EXPECT_EQ(c.zero.reduce_dtype, "bf16");
    EXPECT_EQ(zero_options_for(c).reduce_dtype, DType::kBF16);
  }
  EXPECT_EQ(zero_options_for(parse(kFullConfig)).reduce_dtype, DType::kF32);
}

// memory.offload_checkpoints: true, false, a fraction or "auto", written back as given.
TEST(RunConfig, OffloadCheckpointsTakesAFractionOrAuto) {
  for (const auto& [text, want] : {std::pair<std::string, CheckpointOffload>{"true", {1, false}},
                                   {"false", {0, false}},
                                   {"0.25", {0.25, false}},
                                   {"auto", {0, true}},
                                   {"\"auto\"", {0, true}}}) {
    SCOPED_TRACE(text);
    const RunConfig c =
        parse(kFullConfig, {"memory.checkpointing=full", "memory.offload_checkpoints=" + text});
    EXPECT_EQ(c.memory.offload_checkpoints, want);
    const RunConfig again = parse(run_config_to_json(c).dump());
    EXPECT_EQ(again.memory.offload_checkpoints, want);
  }
  const RunConfig every =
      parse(kFullConfig, {"memory.checkpointing=full", "memory.checkpoint_every=4"});
  EXPECT_EQ(every.memory.checkpoint_every, 4);
  EXPECT_EQ(run_config_to_json(every)["memory"]["checkpoint_every"], 4);
}

TEST(RunConfig, DefaultsToTinyPreset) {
  const RunConfig c = parse(kMinimalConfig);
  const ModelConfig tiny = model_preset("tiny");
  EXPECT_EQ(c.model_preset, "tiny");
  EXPECT_EQ(c.model.dim, tiny.dim);
  EXPECT_EQ(c.model.n_layers, tiny.n_layers);
  EXPECT_EQ(c.model.vocab_size, tiny.vocab_size);
  EXPECT_EQ(c.train.micro_batch, 8);
  EXPECT_EQ(c.precision.param, "fp32");
}

TEST(RunConfig, PresetThenOverrides) {
  const RunConfig c = parse(R"({"model": {"n_layers": 2, "preset": "llama3.2-1b",
                                          "rope_scaling": {"factor": 16}},
                                "data": {"train": "t.txt"}, "train": {"epochs": 1}})");
  const ModelConfig ref = model_preset("llama3.2-1b");
  EXPECT_EQ(c.model_preset, "llama3.2-1b");
  EXPECT_EQ(c.model.n_layers, 2);  // overridden, although written before the preset
  EXPECT_EQ(c.model.dim, ref.dim);
  EXPECT_EQ(c.model.n_heads, ref.n_heads);
  EXPECT_EQ(c.model.vocab_size, ref.vocab_size);
  EXPECT_TRUE(c.model.tie_embeddings);
  EXPECT_EQ(c.model.rope_scaling.type, "llama3");  // kept from the preset
  EXPECT_DOUBLE_EQ(c.model.rope_scaling.factor, 16.0);
  EXPECT_DOUBLE_EQ(c.model.rope_scaling.high_freq_factor, ref.rope_scaling.high_freq_factor);
  const json j = run_config_to_json(c);
  EXPECT_EQ(j["model"]["dim"], ref.dim);
  EXPECT_EQ(j["model"]["n_layers"], 2);
}

TEST(RunConfig, SetOverridesEveryType) {
  const RunConfig c = parse(kFullConfig, {
                                             "train.micro_batch=16",
                                             "train.lr=1e-4",
                                             "model.tie_embeddings=false",
                                             "data.train=other.txt",
                                             "data.valid=\"quoted.txt\"",
                                             "sample.prompt=",
                                             "log.dir=2024",
                                             "model.rope_scaling.factor=8",
                                             "train.seed=7",
                                             " train.grad_accum =3",
                                         });
  EXPECT_EQ(c.train.micro_batch, 16);
  EXPECT_DOUBLE_EQ(c.train.lr, 1e-4);
  EXPECT_FALSE(c.model.tie_embeddings);
  EXPECT_EQ(c.data.train, "other.txt");
  EXPECT_EQ(c.data.valid, "quoted.txt");
  EXPECT_EQ(c.sample.prompt, "");
  EXPECT_EQ(c.log.dir, "2024");  // a string key takes the text even when it reads as a number
  EXPECT_DOUBLE_EQ(c.model.rope_scaling.factor, 8.0);
  EXPECT_EQ(c.model.rope_scaling.type, "llama3");
  EXPECT_EQ(c.train.seed, 7u);
  EXPECT_EQ(c.train.grad_accum, 3);
}

TEST(RunConfig, SetNestedObjectAndLaterWins) {
  const RunConfig c =
      parse(kMinimalConfig, {
                                R"(model.rope_scaling={"type": "llama3", "factor": 2})",
                                R"(train={"lr": 0.01, "min_lr": 0.001})",
                                "train.lr=0.02",
                            });
  EXPECT_EQ(c.model.rope_scaling.type, "llama3");
  EXPECT_DOUBLE_EQ(c.model.rope_scaling.factor, 2.0);
  EXPECT_DOUBLE_EQ(c.train.lr, 0.02);
  EXPECT_DOUBLE_EQ(c.train.min_lr, 0.001);
  EXPECT_EQ(c.train.max_steps, 10);  // the file's other train keys stay
}

TEST(RunConfig, SetPresetKeepsFileModelOverrides) {
  const RunConfig c = parse(R"({"model": {"n_layers": 1}, "data": {"train": "t.txt"},
                                "train": {"max_steps": 1}})",
                            {"model.preset=qwen2.5-0.5b"});
  EXPECT_EQ(c.model_preset, "qwen2.5-0.5b");
  EXPECT_EQ(c.model.dim, model_preset("qwen2.5-0.5b").dim);
  EXPECT_TRUE(c.model.attn_bias);
  EXPECT_EQ(c.model.n_layers, 1);
}

// The Qwen3 presets: the published configs' shapes, heads of 128 whatever the width, q/k norms.
TEST(RunConfig, Qwen3Presets) {
  const RunConfig c = parse(kMinimalConfig, {"model.preset=qwen3-8b"});
  EXPECT_EQ(c.model.dim, 4096);
  EXPECT_EQ(c.model.n_layers, 36);
  EXPECT_EQ(c.model.n_heads, 32);
  EXPECT_EQ(c.model.n_kv_heads, 8);
  EXPECT_EQ(c.model.ffn_dim, 12288);
  EXPECT_EQ(c.model.vocab_size, 151936);
  EXPECT_EQ(c.model.head_dim(), 128);
  EXPECT_TRUE(c.model.qk_norm);
  EXPECT_FALSE(c.model.attn_bias);
  EXPECT_FALSE(c.model.tie_embeddings);
  const ModelConfig small = model_preset("qwen3-0.6b"), large = model_preset("qwen3-32b");
  EXPECT_EQ(small.q_dim(), 2048);  // 16 heads of 128 over a width of 1024
  EXPECT_TRUE(small.tie_embeddings);
  EXPECT_EQ(large.q_dim(), 8192);  // 64 heads of 128 over a width of 5120
  EXPECT_EQ(large.n_layers, 64);
  EXPECT_EQ(large.ffn_dim, 25600);
  // About the published sizes: 0.6B (0.44B without the tied embedding), 8.2B, 32.8B.
  auto params = [](const ModelConfig& m) { return double(make_param_layout(m).total); };
  EXPECT_NEAR(params(small), 0.596e9, 0.01e9);
  EXPECT_NEAR(params(c.model), 8.19e9, 0.02e9);
  EXPECT_NEAR(params(large), 32.76e9, 0.05e9);
}

// The Gemma 3 presets: the published text configs' shapes and layer switches; the 1B's
// parameter count is the published 999,885,952 exactly (tied, 4 norms and q/k norms a layer).
TEST(RunConfig, Gemma3Presets) {
  const RunConfig c = parse(kMinimalConfig, {"model.preset=gemma3-1b", "data.seq_len=512"});
  const ModelConfig& m = c.model;
  EXPECT_EQ(m.dim, 1152);
  EXPECT_EQ(m.n_layers, 26);
  EXPECT_EQ(m.head_dim(), 256);
  EXPECT_EQ(m.q_dim(), 1024);
  EXPECT_TRUE(m.qk_norm && m.post_norms && m.norm_one_plus_weight && m.embed_scale &&
              m.tie_embeddings);
  EXPECT_EQ(m.mlp_activation, "gelu_tanh");
  EXPECT_EQ(m.global_layer_every, 6);
  EXPECT_TRUE(m.local_layer(0) && !m.local_layer(5) && m.local_layer(6));
  EXPECT_EQ(m.sliding_window, 512);
  EXPECT_EQ(m.rope_scaling.type, "none");
  EXPECT_EQ(make_param_layout(m).total, 999885952);
  const ModelConfig large = model_preset("gemma3-27b");
  EXPECT_EQ(large.head_dim(), 128);
  EXPECT_DOUBLE_EQ(large.query_pre_attn_scalar, 168);
  EXPECT_EQ(large.rope_scaling.type, "linear");
  EXPECT_DOUBLE_EQ(large.rope_scaling.factor, 8);
  for (const char* name : {"gemma3-4b", "gemma3-12b", "gemma3-27b"})
    EXPECT_EQ(model_preset(name).vocab_size, 262208) << name;
  // About the published text models' sizes: 3.88B, 11.77B, 27.0B.
  auto params = [](const char* name) {
    return double(make_param_layout(model_preset(name)).total);
  };
  EXPECT_NEAR(params("gemma3-4b"), 3.88e9, 0.02e9);
  EXPECT_NEAR(params("gemma3-12b"), 11.77e9, 0.05e9);
  EXPECT_NEAR(params("gemma3-27b"), 27.0e9, 0.2e9);
}

// The GLM presets: glm-4-9b-chat-hf's and GLM-4-9B-0414's shapes (heads of 128, 2 k/v heads,
// q/k/v biases, half of each head rotated in interleaved pairs, untied); their parameter counts
// are the published ones (GLM-4-0414: two more norms a layer).
TEST(RunConfig, GlmPresets) {
  const RunConfig c = parse(kMinimalConfig, {"model.preset=glm4-9b", "data.seq_len=512"});
  const ModelConfig& m = c.model;
  EXPECT_EQ(m.head_dim(), 128);
  EXPECT_EQ(m.rotary_dim(), 64);
  EXPECT_TRUE(m.rope_interleaved && m.attn_bias && !m.tie_embeddings && !m.post_norms);
  EXPECT_DOUBLE_EQ(m.norm_eps, 1.5625e-07);
  EXPECT_EQ(rope_inv_freq(m).size(), 32u);
  EXPECT_EQ(make_param_layout(m).total, 9399951360);
  const ModelConfig m0414 = model_preset("glm4-9b-0414");
  EXPECT_TRUE(m0414.post_norms && m0414.post_norm_names == "glm4");
  EXPECT_EQ(make_param_layout(m0414).total, 9399951360 + 40 * 2 * 4096);
  // The rotary fraction is a config key, refused naming it when it rotates an odd count
  // (int(128 x 0.2) = 25 dims).
  test::expect_config_error(
      [] {
        parse(kMinimalConfig, {"model.preset=glm4-9b", "model.rope_partial_factor=0.2"});
      },
      {"model.rope_partial_factor"});
  test::expect_config_error(
      [] {
        parse(kMinimalConfig, {"model.preset=glm4-9b", "model.post_norm_names=\"llama\""});
      },
      {"model.post_norm_names"});
}

// The Gemma 2 presets: the published configs' shapes, layer switches and soft caps; their
// parameter counts are the published ones exactly (tied, 4 norms a layer, no q/k norms).
TEST(RunConfig, Gemma2Presets) {
  const RunConfig c = parse(kMinimalConfig, {"model.preset=gemma2-2b", "data.seq_len=512"});
  const ModelConfig& m = c.model;
  EXPECT_EQ(m.dim, 2304);
  EXPECT_EQ(m.head_dim(), 256);
  EXPECT_TRUE(!m.qk_norm && m.post_norms && m.norm_one_plus_weight && m.embed_scale &&
              m.tie_embeddings);
  EXPECT_EQ(m.mlp_activation, "gelu_tanh");
  EXPECT_EQ(m.window_of_layer(0), 4096);
  EXPECT_EQ(m.window_of_layer(1), 0);
  EXPECT_DOUBLE_EQ(m.rope_local_theta, m.rope_theta);
  EXPECT_DOUBLE_EQ(m.attn_softcap, 50);
  EXPECT_DOUBLE_EQ(m.final_softcap, 30);
  EXPECT_EQ(make_param_layout(m).total, 2614341888);
  EXPECT_EQ(make_param_layout(model_preset("gemma2-9b")).total, 9241705984);
  const ModelConfig large = model_preset("gemma2-27b");
  EXPECT_EQ(make_param_layout(large).total, 27227128320);
  EXPECT_EQ(large.head_dim(), 128);
  EXPECT_DOUBLE_EQ(large.query_pre_attn_scalar, 144);
  // The caps are config keys; a negative one is refused naming its key.
  test::expect_config_error(
      [] {
        parse(kMinimalConfig, {"model.preset=gemma2-2b", "model.attn_softcap=-1"});
      },
      {"model.attn_softcap"});
  test::expect_config_error(
      [] {
        parse(kMinimalConfig, {"model.preset=gemma2-2b", "model.final_softcap=-1"});
      },
      {"model.final_softcap"});
  EXPECT_DOUBLE_EQ(parse(kMinimalConfig, {"model.preset=gemma2-2b", "model.final_softcap=0"})
                       .model.final_softcap,
                   0);
}

// An asynchronous checkpoint's snapshot exists only with periodic saves (a stop's and the end's
// save synchronously): without checkpoint.every_steps nothing is planned or held for it.
TEST(RunConfig, AsyncSnapshotOnlyWithPeriodicSaves) {
  EXPECT_FALSE(parse(kMinimalConfig, {"checkpoint.async=true"}).checkpoint.async_snapshot());
  EXPECT_TRUE(parse(kMinimalConfig, {"checkpoint.async=true", "checkpoint.every_steps=10"})
                  .checkpoint.async_snapshot());
  EXPECT_FALSE(parse(kMinimalConfig, {"checkpoint.every_steps=10"}).checkpoint.async_snapshot());
}

// Gemma's local layers mask a sliding window: any sequence length trains; the global layers
// (every global_layer_every-th) see their whole document.
TEST(RunConfig, Gemma3LocalLayersHaveTheSlidingWindow) {
  const RunConfig c = parse(kMinimalConfig, {"model.preset=gemma3-1b", "data.seq_len=1024"});
  EXPECT_EQ(c.model.window_of_layer(0), 512);
  EXPECT_EQ(c.model.window_of_layer(5), 0);
  EXPECT_EQ(c.model.window_of_layer(6), 512);
  EXPECT_TRUE(c.model.has_sliding_window());
  const RunConfig global =
      parse(kMinimalConfig, {"model.preset=gemma3-1b", "model.global_layer_every=1"});
  EXPECT_FALSE(global.model.has_sliding_window());
  // Post-norms run under tensor parallelism, with and without sequence parallelism.
  for (const char* sp : {"parallel.sequence_parallel=true", "parallel.sequence_parallel=false"}) {
    const RunConfig tp = parse(kMinimalConfig, {"model.preset=gemma3-4b", "parallel.tp=2", sp});
    EXPECT_EQ(tp.parallel.tp, 2);
    EXPECT_TRUE(tp.model.post_norms);
  }
}

TEST(RunConfig, IntegralFloatAcceptedForInteger) {
  const RunConfig c = parse(kMinimalConfig, {"train.max_steps=1e3", "data.seq_len=32.0"});
  EXPECT_EQ(c.train.max_steps, 1000);
  EXPECT_EQ(c.data.seq_len, 32);
}

class TempDir {
 public:
  TempDir() {
    path_ = shardlm::test::scratch_root() /
            ("shardlm_test_config_" +
             std::to_string(::testing::UnitTest::GetInstance()->random_seed()) + "_" +
             std::to_string(reinterpret_cast<uintptr_t>(this)));
    fs::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }
  std::string write(const std::string& name, const std::string& text) const {
    const fs::path p = path_ / name;
    std::ofstream(p) << text;
    return p.string();
  }

 private:
  fs::path path_;
};

TEST(RunConfig, LoadResolvesFilePathsAgainstConfigDir) {
  TempDir dir;
  const std::string cfg_path = dir.write("run.json", R"({"data": {"train": "data/train.txt",
      "valid": "/abs/valid.txt"}, "train": {"max_steps": 5}, "log": {"dir": "../runs/a"}})");
  const RunConfig c = load_run_config(cfg_path, {});
  EXPECT_EQ(c.config_dir, dir.path().string());
  EXPECT_EQ(fs::path(c.data.train), dir.path() / "data/train.txt");
  EXPECT_EQ(c.data.valid, "/abs/valid.txt");
  EXPECT_EQ(fs::path(c.log.dir), (dir.path() / "../runs/a").lexically_normal());
  // A --set path is the user's, typed relative to the working directory: kept as given.
  const RunConfig s = load_run_config(cfg_path, {"data.train=here.txt", "log.dir=out"});
  EXPECT_EQ(s.data.train, "here.txt");
  EXPECT_EQ(s.log.dir, "out");
  // A config named without a directory resolves against ".", i.e. stays as written.
  const fs::path cwd = fs::current_path();
  fs::current_path(dir.path());
  const RunConfig local = load_run_config("run.json", {});
  fs::current_path(cwd);
  EXPECT_EQ(local.data.train, "data/train.txt");
}

// LoRA under tensor parallelism is a valid config (the adapters split with their base).
TEST(RunConfig, TensorParallelTakesLora) {
  const RunConfig c = parse(with(R"({"parallel": {"tp": 2}, "lora": {"rank": 4}})"));
  EXPECT_EQ(c.parallel.tp, 2);
  EXPECT_EQ(c.lora_config().rank, 4);
}

using test::expect_config_error;

// Pipeline stages compose with LoRA (also under tp, over a dense or an NF4 base), offloaded
// checkpoints, checkpoint_every and the GPU.
TEST(RunConfig, PipelineComposesWithEveryMemorySetting) {
  for (const char* text :
       {R"({"model": {"n_layers": 4}, "parallel": {"pp": 2}, "lora": {"rank": 4}})",
        R"({"model": {"n_layers": 4}, "parallel": {"pp": 2, "tp": 2}, "lora": {"rank": 4}})",
        R"({"model": {"n_layers": 4}, "parallel": {"pp": 2, "tp": 2}, "train": {"device": "cuda"},
            "lora": {"rank": 4, "base_dtype": "nf4"}})",
        R"({"model": {"n_layers": 4}, "parallel": {"pp": 2}, "train": {"device": "cuda"},
            "memory": {"checkpointing": "full", "offload_checkpoints": true,
                       "checkpoint_every": 2}})"}) {
    SCOPED_TRACE(text);
    EXPECT_NO_THROW(parse(with(text), {}));
  }
}

TEST(RunConfig, MissingFileNamesPath) {
  test::expect_config_error([] { load_run_config("/nonexistent/dir/run.json", {}); },
                            {"/nonexistent/dir/run.json"});
  TempDir dir;
  test::expect_config_error([&] { load_run_config(dir.path().string(), {}); },
                            {dir.path().string(), "directory"});
}

TEST(RunConfig, FileSyntaxErrorNamesFileAndByte) {
  TempDir dir;
  const std::string p = dir.write("broken.json", "{\n  \"train\": {\"lr\": 0.1,}\n}\n");
  test::expect_config_error([&] { load_run_config(p, {}); },
                            {p, "invalid JSON at byte 25", "line 2"});
}

}  // namespace
}  // namespace shardlm
