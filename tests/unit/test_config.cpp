// Tests of the JSON run-config loader (src/train/config.cpp): round trip through
// run_config_to_json, presets with overrides, --set, relative data paths, one case per kind of
// malformed config (kConfig naming the key), and a seeded mutation test that only
// shardlm::Error ever comes out.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "shardlm/core/check.h"
#include "shardlm/model/layout.h"
#include "shardlm/train/config.h"
#include "shardlm/train/plan_inputs.h"

#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Every key set away from its default, so that a key dropped by to_json or parse shows up.
const char* kFullConfig = R"({
  "model": {
    "preset": "tiny", "dim": 96, "n_layers": 3, "n_heads": 6, "n_kv_heads": 3,
    "ffn_dim": 256, "vocab_size": 300, "rope_theta": 50000.5,
    "rope_scaling": {"type": "llama3", "factor": 4.0, "low_freq_factor": 1.5,
                     "high_freq_factor": 3.5, "original_max_position": 1024},
    "norm_eps": 1e-6, "tie_embeddings": true, "attn_bias": true, "head_dim": 24, "qk_norm": true
  },
  "data": {"train": "/data/train.txt", "valid": "/data/valid.txt", "valid_fraction": 0.1,
           "seq_len": 64},
  "train": {"micro_batch": 4, "grad_accum": 2, "epochs": 0, "max_steps": 100, "lr": 0.001,
            "min_lr": 0.0001, "warmup_steps": 5, "weight_decay": 0.05, "beta1": 0.8,
            "beta2": 0.99, "eps": 1e-7, "grad_clip": 0.5, "seed": 18446744073709551615,
            "eval_every": 10, "eval_batches": 3},
  "precision": {"param": "bf16"},
  "parallel": {"tp": 1, "pp": 1, "cp": 1, "cp_kind": "hybrid", "cp_ulysses": 1,
               "sequence_parallel": false},
  "zero": {"stage": 0, "offload_optimizer": "none", "offload_params": "none",
           "overlap_comm": false, "reduce_bucket_bytes": 1000, "allgather_bucket_bytes": 2000,
           "prefetch_layers": 2, "reduce_dtype": "f32"},
  "memory": {"checkpointing": "selective", "offload_checkpoints": true, "loss_chunk_tokens": 512,
             "mlp_chunk_tokens": 200, "budget_gib": 1.5},
  "log": {"dir": "/runs/x", "every_steps": 7},
  "sample": {"prompt": "Once upon", "max_new_tokens": 50, "temperature": 0.0, "top_k": 5,
             "count": 1}
})";

const char* kMinimalConfig = R"({"data": {"train": "t.txt"}, "train": {"max_steps": 10}})";

RunConfig parse(const std::string& text, const std::vector<std::string>& overrides = {}) {
  return parse_run_config(text, overrides, "");
}

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

// ---- malformed configs: each is kConfig, and the message names the key ----------------------

struct BadCase {
  const char* name;
  std::string text;
  std::vector<std::string> overrides;
  std::vector<std::string> expect;  // substrings of the message
};

std::string with(const std::string& section_json) {
  // kMinimalConfig plus extra sections; a later duplicate key replaces the earlier.
  json base = json::parse(kMinimalConfig);
  base.merge_patch(json::parse(section_json));
  return base.dump();
}

// LoRA under tensor parallelism is a valid config (the adapters split with their base).
TEST(RunConfig, TensorParallelTakesLora) {
  const RunConfig c = parse(with(R"({"parallel": {"tp": 2}, "lora": {"rank": 4}})"));
  EXPECT_EQ(c.parallel.tp, 2);
  EXPECT_EQ(c.lora_config().rank, 4);
}

std::vector<BadCase> bad_cases() {
  return {
      {"UnknownKeySuggests",
       with(R"({"train": {"learning_rate": 0.1}})"),
       {},
       {"unknown key 'train.learning_rate'", "did you mean 'train.lr'?"}},
      {"UnknownKeyTypo",
       with(R"({"train": {"micro_bach": 2}})"),
       {},
       {"'train.micro_bach'", "did you mean 'train.micro_batch'?"}},
      {"UnknownKeyOtherSection",
       with(R"({"train": {"seq_len": 2}})"),
       {},
       {"'train.seq_len'", "did you mean 'data.seq_len'?"}},
      {"UnknownKeyAlias",
       with(R"({"model": {"num_hidden_layers": 2}})"),
       {},
       {"'model.num_hidden_layers'", "did you mean 'model.n_layers'?"}},
      {"UnknownNestedKey",
       with(R"({"model": {"rope_scaling": {"facter": 2}}})"),
       {},
       {"'model.rope_scaling.facter'", "did you mean 'model.rope_scaling.factor'?"}},
      {"UnknownKeyHuge",
       with("{\"train\": {\"" + std::string(100000, 'x') + "\": 1}}"),
       {},
       {"unknown key 'train.xxxx", "valid keys in 'train'"}},
      {"UnknownKeyFarListsValid",
       with(R"({"train": {"zzzzzzzz": 1}})"),
       {},
       {"unknown key 'train.zzzzzzzz'", "valid keys in 'train'", "micro_batch"}},
      {"UnknownSectionSuggests",
       with(R"({"trian": {"lr": 1}})"),
       {},
       {"unknown section 'trian'", "did you mean 'train'?"}},
      {"UnknownSectionFar",
       with(R"({"qqqqqqqqq": {}})"),
       {},
       {"unknown section 'qqqqqqqqq'", "valid sections", "model"}},
      {"PlannedKey",
       with(R"({"lora": {"rank": 8, "bias": "all"}})"),
       {},
       {"'lora.bias'", "not supported"}},
      {"LoraTargets",
       with(R"({"lora": {"rank": 8, "targets": "q,qkv"}})"),
       {},
       {"lora.targets", "'qkv'", "q, k, v, o, gate, up, down"}},
      {"LoraRank", with(R"({"lora": {"rank": -2}})"), {}, {"lora.rank", ">= 0"}},
      {"LoraDropout",
       with(R"({"lora": {"rank": 4, "dropout": 1.5}})"),
       {},
       {"lora.dropout", "[0, 1)"}},
      {"ZeroStageRange", with(R"({"zero": {"stage": 4}})"), {}, {"zero.stage", "0, 1, 2 or 3"}},
      {"OffloadParamsNeedsOptimizerOffload",
       with(R"({"zero": {"stage": 3, "offload_params": "cpu"}})"),
       {},
       {"zero.offload_params \"cpu\" requires zero.offload_optimizer = \"cpu\""}},
      {"OffloadNvme",
       with(R"({"zero": {"offload_optimizer": "nvme"}})"),
       {},
       {"zero.offload_optimizer must be one of \"none\", \"cpu\"", "\"nvme\""}},
      {"OffloadParamsNeedsStage3",
       with(R"({"zero": {"stage": 2, "offload_params": "cpu"}})"),
       {},
       {"zero.offload_params \"cpu\" requires zero.stage = 3 (got 2)"}},
      {"NegativePrefetch",
       with(R"({"zero": {"prefetch_layers": -1}})"),
       {},
       {"zero.prefetch_layers must be >= 0"}},
      {"ZeroBucket",
       with(R"({"zero": {"reduce_bucket_bytes": 0}})"),
       {},
       {"zero.reduce_bucket_bytes must be >= 1"}},
      {"ReduceDtype",
       with(R"({"zero": {"stage": 2, "reduce_dtype": "fp16"}})"),
       {},
       {"zero.reduce_dtype must be one of \"fp32\", \"bf16\"", "\"fp16\""}},
      {"Bf16ReductionsNeedStage2",
       with(R"({"zero": {"stage": 1, "reduce_dtype": "bf16"}})"),
       {},
       {"zero.reduce_dtype \"bf16\" requires zero.stage >= 2 (got 1)"}},
      {"OverlapCommNotBool",
       with(R"({"zero": {"overlap_comm": "yes"}})"),
       {},
       {"zero.overlap_comm must be true or false"}},
      {"TensorParallelHeadsDoNotSplit",
       with(R"({"parallel": {"tp": 3}})"),
       {},
       {"parallel.tp = 3 does not divide model.n_heads"}},
      {"SequenceParallelRowsDoNotSplit",
       with(R"({"parallel": {"tp": 2}, "train": {"micro_batch": 1}, "data": {"seq_len": 101}})"),
       {},
       {"1 x 101 / 1 = 101 rows across parallel.tp = 2", "train.micro_batch or data.seq_len",
        "parallel.sequence_parallel = false"}},
      {"PipelineMoreStagesThanLayers",
       with(R"({"model": {"n_layers": 2}, "parallel": {"pp": 4}})"),
       {},
       {"parallel.pp = 4", "model.n_layers = 2"}},
      {"ContextParallelSeqLenNotSplittable",
       with(R"({"parallel": {"cp": 8, "cp_kind": "ring"}, "data": {"seq_len": 100}})"),
       {},
       {"data.seq_len (100) must be a multiple of 2 x parallel.cp = 16"}},
      {"UlyssesHeadsDoNotSplit",
       with(R"({"parallel": {"cp": 8, "cp_kind": "ulysses"}, "data": {"seq_len": 256}})"),
       {},
       {"model.n_heads", "parallel.cp_kind = \"ring\""}},
      {"ZeroTp", with(R"({"parallel": {"tp": 0}})"), {}, {"parallel.tp must be in [1,"}},
      {"BadCpKind",
       with(R"({"parallel": {"cp_kind": "star"}})"),
       {},
       {"parallel.cp_kind must be one of \"ulysses\", \"ring\", \"hybrid\"", "\"star\""}},
      {"BadDeviceComm",
       with(R"({"parallel": {"device_comm": "gloo"}})"),
       {},
       {"parallel.device_comm must be one of \"nccl\", \"host\", \"mpi\"", "\"gloo\""}},
      {"NoStagingMemory",
       with(R"({"parallel": {"device_comm": "mpi", "device_comm_staging_kib": 0}})"),
       {},
       {"parallel.device_comm_staging_kib must be in [1, 4194304]"}},
      {"CpUlyssesWithoutHybrid",
       with(R"({"parallel": {"cp_ulysses": 2}})"),
       {},
       {"parallel.cp_ulysses (2) only applies to parallel.cp_kind \"hybrid\""}},
      {"CpKeepGatheredOnARing",
       with(R"({"parallel": {"cp": 2, "cp_kind": "ring", "cp_keep_gathered": true}})"),
       {},
       {"parallel.cp_keep_gathered", "\"ring\" has no all-to-all"}},
      {"CpUlyssesNotDividing",
       with(R"({"parallel": {"cp": 6, "cp_kind": "hybrid", "cp_ulysses": 4}})"),
       {},
       {"parallel.cp_ulysses (4) must divide parallel.cp (6)"}},
      {"DpIsNotAKey",
       with(R"({"parallel": {"dp": 2}})"),
       {},
       {"'parallel.dp' is not a key", "derived"}},
      {"ZeroKeySuggests",
       with(R"({"zero": {"offload_param": "cpu"}})"),
       {},
       {"'zero.offload_param'", "did you mean 'zero.offload_params'?"}},
      {"HfDirMissing",
       with(R"({"model": {"hf_dir": "/nonexistent-hf-dir"}})"),
       {},
       {"/nonexistent-hf-dir/config.json", "cannot read"}},
      {"StringForInt",
       with(R"({"train": {"micro_batch": "8"}})"),
       {},
       {R"(train.micro_batch must be an integer, got "8" (string))"}},
      {"FloatForInt",
       with(R"({"train": {"micro_batch": 8.5}})"),
       {},
       {"train.micro_batch must be an integer, got 8.5"}},
      {"IntOutOfRange",
       with(R"({"train": {"max_steps": 1e30}})"),
       {},
       {"train.max_steps", "out of range"}},
      {"UnsignedOverflowsInt",
       with(R"({"train": {"max_steps": 18446744073709551615}})"),
       {},
       {"train.max_steps", "out of range"}},
      {"StringForDouble",
       with(R"({"train": {"lr": "fast"}})"),
       {},
       {"train.lr must be a number", "\"fast\""}},
      {"IntForBool",
       with(R"({"model": {"tie_embeddings": 1}})"),
       {},
       {"model.tie_embeddings must be true or false"}},
      {"NumberForString",
       with(R"({"precision": {"param": 16}})"),
       {},
       {"precision.param must be a string"}},
      {"NullForString",
       R"({"data": {"train": null}, "train": {"max_steps": 1}})",
       {},
       {"data.train must be a string"}},
      {"NegativeGradAccum", with(R"({"train": {"grad_accum": -1}})"), {}, {"train.grad_accum"}},
      {"NegativeSeed",
       with(R"({"train": {"seed": -1}})"),
       {},
       {"train.seed must be a non-negative integer"}},
      {"NegativeTemperature",
       with(R"({"sample": {"temperature": -0.5}})"),
       {},
       {"sample.temperature"}},
      {"ZeroLr", with(R"({"train": {"lr": 0}})"), {}, {"train.lr must be > 0"}},
      {"SampleWithoutFinalCheckpoint",
       with(R"({"sample": {"prompt": "In the", "count": 1}, "checkpoint": {"at_end": false}})"),
       {},
       {"sample.prompt", "checkpoint.at_end = false", "sample.count = 0"}},
      {"MinLrAboveLr",
       with(R"({"train": {"lr": 0.001, "min_lr": 0.01}})"),
       {},
       {"train.min_lr", "train.lr"}},
      {"BetaOne", with(R"({"train": {"beta2": 1.0}})"), {}, {"train.beta2"}},
      {"SeqLenOne", with(R"({"data": {"seq_len": 1}})"), {}, {"data.seq_len"}},
      {"ZeroLossChunk",
       with(R"({"memory": {"loss_chunk_tokens": 0}})"),
       {},
       {"memory.loss_chunk_tokens"}},
      {"BadPrecisionEnum",
       with(R"({"precision": {"param": "fp16"}})"),
       {},
       {"precision.param", "\"fp32\"", "\"bf16\"", "fp16"}},
      {"CheckpointingUnknown",
       with(R"({"memory": {"checkpointing": "some"}})"),
       {},
       {"memory.checkpointing", "\"none\"", "\"selective\"", "\"full\"", "some"}},
      {"OffloadCheckpointsNeedsCheckpointing",
       with(R"({"memory": {"offload_checkpoints": true}})"),
       {},
       {"memory.offload_checkpoints", "memory.checkpointing", "\"selective\" or \"full\""}},
      {"OffloadCheckpointsNotBool",
       with(R"({"memory": {"checkpointing": "full", "offload_checkpoints": "yes"}})"),
       {},
       {"memory.offload_checkpoints", "true, false, a fraction in [0, 1] or \"auto\"", "yes"}},
      {"OffloadCheckpointsFractionOutOfRange",
       with(R"({"memory": {"checkpointing": "full", "offload_checkpoints": 1.5}})"),
       {},
       {"memory.offload_checkpoints", "a fraction in [0, 1]", "1.5"}},
      {"CheckpointEveryNeedsFull",
       with(R"({"memory": {"checkpointing": "selective", "checkpoint_every": 2}})"),
       {},
       {"memory.checkpoint_every", "memory.checkpointing = \"full\"", "selective"}},
      {"OffloadBaseWithoutLora",
       with(R"({"lora": {"offload_base": true}})"),
       {},
       {"lora.offload_base", "lora.rank > 0"}},
      {"CheckpointEveryZero",
       with(R"({"memory": {"checkpointing": "full", "checkpoint_every": 0}})"),
       {},
       {"memory.checkpoint_every", ">= 1"}},
      {"ZeroMlpChunk",
       with(R"({"memory": {"mlp_chunk_tokens": 0}})"),
       {},
       {"memory.mlp_chunk_tokens", ">= 1"}},
      {"BadRopeType",
       with(R"({"model": {"rope_scaling": {"type": "yarn"}}})"),
       {},
       {"model.rope_scaling.type"}},
      {"RopeFreqFactorsEqual",
       with(R"({"model": {"rope_scaling": {"type": "llama3", "high_freq_factor": 1.0}}})"),
       {},
       {"model.rope_scaling.high_freq_factor", "model.rope_scaling.low_freq_factor"}},
      {"BadPreset",
       with(R"({"model": {"preset": "gpt5"}})"),
       {},
       {"model.preset", "gpt5", "tiny", "llama3.1-8b", "qwen2.5-0.5b"}},
      {"HeadsNotDividingDim",
       with(R"({"model": {"n_heads": 3}})"),
       {},
       {"model.dim", "model.n_heads"}},
      {"OddHeadDim", with(R"({"model": {"head_dim": 15}})"), {}, {"model.head_dim", "15"}},
      {"NegativeHeadDim", with(R"({"model": {"head_dim": -2}})"), {}, {"model.head_dim", "-2"}},
      {"KvHeadsNotDividingHeads",
       with(R"({"model": {"n_kv_heads": 3}})"),
       {},
       {"model.n_kv_heads"}},
      {"ZeroVocab", with(R"({"model": {"vocab_size": 0}})"), {}, {"model.vocab_size"}},
      {"BadDevice", with(R"({"train": {"device": "gpu"}})"), {}, {"train.device", "cuda"}},
      {"BadAttention",
       with(R"({"train": {"attention": "flash"}})"),
       {},
       {"train.attention", "auto", "cudnn", "own"}},
      {"BothEpochsAndSteps",
       with(R"({"train": {"epochs": 2, "max_steps": 10}})"),
       {},
       {"train.epochs", "train.max_steps", "only one"}},
      {"NeitherEpochsNorSteps",
       with(R"({"train": {"max_steps": 0}})"),
       {},
       {"train.epochs", "train.max_steps"}},
      {"NoTrainData",
       R"({"train": {"max_steps": 1}})",
       {},
       {"data.train is required: the text file to train on"}},
      {"SyntaxError", R"({"train": {"lr": }})", {}, {"<config text>", "invalid JSON at byte 18"}},
      {"TrailingComma", R"({"train": {"lr": 1},})", {}, {"invalid JSON at byte"}},
      {"NumberOverflow", R"({"train": {"lr": 1e999}})", {}, {"<config text>", "number overflow"}},
      {"EmptyText", "", {}, {"invalid JSON at byte"}},
      {"TopLevelArray", "[1, 2]", {}, {"must be a JSON object", "array"}},
      {"SectionNotObject", with(R"({"train": 5})"), {}, {"'train' must be a JSON object"}},
      {"RopeScalingNotObject",
       with(R"({"model": {"rope_scaling": "llama3"}})"),
       {},
       {"'model.rope_scaling' must be a JSON object"}},
      {"DottedKeyInFile", with(R"({"train.lr": 1})"), {}, {"'train.lr'", "nest it"}},
      {"SetMissingEquals", kMinimalConfig, {"train.lr"}, {"train.lr", "key.path=value"}},
      {"SetEmptyKey", kMinimalConfig, {"=3"}, {"'=3'"}},
      {"SetDoubleDot", kMinimalConfig, {"train..lr=3"}, {"train..lr"}},
      {"SetUnknownKey",
       kMinimalConfig,
       {"train.lrr=0.1"},
       {"--set train.lrr=0.1", "unknown key 'train.lrr'", "did you mean 'train.lr'?"}},
      {"SetUnknownSection", kMinimalConfig, {"foo=1"}, {"--set foo=1", "'foo'"}},
      {"SetWrongType",
       kMinimalConfig,
       {"train.micro_batch=abc"},
       {"--set train.micro_batch=abc", R"(train.micro_batch must be an integer, got "abc")"}},
      {"SetSectionWithNumberForString",
       kMinimalConfig,
       {R"(data={"train": 5})"},
       {"data.train must be a string, got 5"}},
      {"SetSectionToScalar", kMinimalConfig, {"train=3"}, {"'train' must be a JSON object"}},
      {"SetNegative", kMinimalConfig, {"train.micro_batch=0"}, {"train.micro_batch"}},
  };
}

void PrintTo(const BadCase& bc, std::ostream* os) { *os << bc.name; }

class BadConfig : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadConfig, IsConfigErrorNamingTheKey) {
  const BadCase& bc = GetParam();
  try {
    parse(bc.text, bc.overrides);
    FAIL() << "accepted: " << bc.text;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig) << e.what();
    for (const auto& s : bc.expect)
      EXPECT_NE(std::string(e.what()).find(s), std::string::npos)
          << "message: " << e.what() << "\nmissing: " << s;
  }
}

INSTANTIATE_TEST_SUITE_P(RunConfig, BadConfig, ::testing::ValuesIn(bad_cases()),
                         [](const auto& info) { return std::string(info.param.name); });

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

// ---- robustness: no input may produce anything but shardlm::Error ----------------------------

TEST(RunConfig, RandomMutationsOnlyThrowConfigErrors) {
  const std::string base = kFullConfig;
  const std::vector<std::string> base_sets = {"train.lr=0.002", "model.rope_scaling.factor=2",
                                              "data.train=x.txt"};
  const std::string structural = "{}[]\":,.-+eE0123456789 tfnul\\";
  std::mt19937_64 rng(20240611);
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % std::max<size_t>(n, 1)); };
  auto mutate = [&](std::string s) {
    const int edits = 1 + static_cast<int>(pick(4));
    for (int e = 0; e < edits; ++e) {
      const size_t pos = pick(s.size() + 1);
      const char byte = pick(2) ? structural[pick(structural.size())] : static_cast<char>(rng());
      switch (pick(5)) {
        case 0:
          if (pos < s.size()) s[pos] = byte;
          break;
        case 1:
          s.insert(s.begin() + pos, byte);
          break;
        case 2:
          if (pos < s.size()) s.erase(pos, 1 + pick(8));
          break;
        case 3:
          s.resize(pos);
          break;
        default:
          if (pos < s.size()) s.insert(pos, s.substr(pick(s.size()), pick(16)));
          break;
      }
    }
    return s;
  };
  int accepted = 0, rejected = 0;
  for (int i = 0; i < 2000; ++i) {
    const bool mutate_sets = i % 4 == 3;
    const std::string text = mutate_sets ? base : mutate(base);
    std::vector<std::string> sets = base_sets;
    if (mutate_sets) sets[pick(sets.size())] = mutate(sets[pick(sets.size())]);
    try {
      const RunConfig c = parse(text, sets);
      (void)run_config_to_json(c).dump();
      ++accepted;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kConfig) << e.what();
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "non-shardlm exception " << e.what() << " for input:\n" << text;
    } catch (...) {
      ADD_FAILURE() << "unknown exception for input:\n" << text;
    }
  }
  EXPECT_EQ(accepted + rejected, 2000);
  EXPECT_GT(rejected, 500);  // the mutations do reach the error paths
}

}  // namespace
}  // namespace shardlm
