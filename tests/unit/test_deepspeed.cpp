// Tests of the DeepSpeed ds_config mapping (src/config/deepspeed.cpp, deepspeed_load.cpp): the
// realistic configs of tests/data/deepspeed/ map to the right shardlm keys; the train_batch_size
// arithmetic over world sizes; "auto"; the warnings; and the whole load (file, then DeepSpeed,
// then --set). The errors: test_deepspeed_errors.cpp.
#include "shardlm/config/deepspeed.h"

#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardlm/config/config.h"
#include "shardlm/core/check.h"

#include "test_util.h"
#include "unit/deepspeed_samples.h"

namespace shardlm {
namespace {

using nlohmann::json;

using test::base_config;
using test::data_path;
using test::expect_config_error;
using test::kShardlmConfig;
using test::read_ds;
using test::TempDir;

// key -> value (JSON text) of the overrides; a key set twice keeps its last value.
std::map<std::string, std::string> by_key(const DeepSpeedMapping& m) {
  std::map<std::string, std::string> out;
  for (const auto& o : m.overrides) out[o.substr(0, o.find('='))] = o.substr(o.find('=') + 1);
  return out;
}

double number_of(const DeepSpeedMapping& m, const std::string& key) {
  const auto keys = by_key(m);
  const auto it = keys.find(key);
  EXPECT_NE(it, keys.end()) << key;
  return it == keys.end() ? -1 : json::parse(it->second).get<double>();
}

// How many warnings contain `text`.
int warned(const DeepSpeedMapping& m, const std::string& text) {
  int n = 0;
  for (const auto& w : m.warnings) n += w.find(text) != std::string::npos;
  return n;
}

std::string all_warnings(const DeepSpeedMapping& m) {
  std::string out;
  for (const auto& w : m.warnings) out += "  " + w + "\n";
  return out;
}

// ---- the realistic configs ------------------------------------------------------------------

TEST(DeepSpeed, Zero2HuggingFaceAutoConfigMaps) {
  const DeepSpeedMapping m =
      map_deepspeed_config(read_ds("zero2_bf16_auto.json"), base_config(), 1);
  const std::map<std::string, std::string> want = {
      {"precision.param", "\"bf16\""},
      {"zero.stage", "2"},
      {"zero.offload_optimizer", "\"none\""},
      {"zero.overlap_comm", "true"},
      // 2e8 elements x 4 bytes per f32 gradient element.
      {"zero.reduce_bucket_bytes", "800000000"},
      {"zero.allgather_bucket_bytes", "800000000"},
      {"log.every_steps", "2000"},
  };
  EXPECT_EQ(by_key(m), want);  // "auto" everywhere else: shardlm's values stay
  EXPECT_EQ(m.overrides.size(), m.sources.size());
  EXPECT_EQ(m.train_batch_size, 0);
  // fp16 "auto", wall_clock_breakdown false, contiguous_gradients true and the offload's
  // pin_memory (device none) ask for nothing; these three do.
  EXPECT_EQ(m.warnings.size(), 3u) << all_warnings(m);
  EXPECT_EQ(warned(m, "zero_optimization.round_robin_gradients (true) is ignored"), 1);
  EXPECT_EQ(warned(m, "WarmupDecayLR decays linearly; shardlm decays along a cosine"), 1);
  EXPECT_EQ(warned(m, "warmup_type is not set"), 1);
}

TEST(DeepSpeed, Zero3CpuOffloadMaps) {
  const DeepSpeedMapping m =
      map_deepspeed_config(read_ds("zero3_cpu_offload.json"), base_config(), 1);
  const auto keys = by_key(m);
  EXPECT_EQ(keys.at("zero.stage"), "3");
  EXPECT_EQ(keys.at("zero.offload_optimizer"), "\"cpu\"");
  EXPECT_EQ(keys.at("zero.offload_params"), "\"cpu\"");
  EXPECT_EQ(keys.at("precision.param"), "\"bf16\"");
  EXPECT_EQ(keys.at("train.micro_batch"), "8");
  EXPECT_EQ(keys.at("train.grad_accum"), "4");
  EXPECT_EQ(keys.at("train.warmup_steps"), "100");
  EXPECT_EQ(keys.at("log.every_steps"), "10");
  EXPECT_EQ(keys.count("zero.reduce_bucket_bytes"), 0u);  // "auto"
  EXPECT_DOUBLE_EQ(number_of(m, "train.lr"), 2e-5);
  EXPECT_DOUBLE_EQ(number_of(m, "train.min_lr"), 0.1 * 2e-5);  // cos_min_ratio x lr
  EXPECT_DOUBLE_EQ(number_of(m, "train.beta1"), 0.9);
  EXPECT_DOUBLE_EQ(number_of(m, "train.beta2"), 0.999);
  EXPECT_DOUBLE_EQ(number_of(m, "train.eps"), 1e-8);
  EXPECT_DOUBLE_EQ(number_of(m, "train.weight_decay"), 0.0);
  EXPECT_DOUBLE_EQ(number_of(m, "train.grad_clip"), 1.0);
  EXPECT_EQ(m.train_batch_size, 32);  // 8 x 4 x 1: consistent
  EXPECT_EQ(m.warnings.size(), 6u) << all_warnings(m);
  EXPECT_EQ(warned(m, "zero_optimization.offload_optimizer.pin_memory (true) is ignored"), 1);
  EXPECT_EQ(warned(m, "zero_optimization.offload_param.pin_memory (true) is ignored"), 1);
  EXPECT_EQ(warned(m,
                   "zero_optimization.sub_group_size (1000000000.0) is ignored: it is not "
                   "needed: shardlm's optimizer steps run per arena range"),
            1)
      << all_warnings(m);
  EXPECT_EQ(warned(m, "zero_optimization.stage3_max_live_parameters"), 1);
  EXPECT_EQ(warned(m, "zero_optimization.stage3_max_reuse_distance"), 1);
  EXPECT_EQ(warned(m, "zero_optimization.stage3_gather_16bit_weights_on_model_save"), 1);

  // On two processes the same numbers no longer multiply out.
  expect_config_error(
      [] { map_deepspeed_config(read_ds("zero3_cpu_offload.json"), base_config(), 2); },
      {"train_batch_size (32) must equal train_micro_batch_size_per_gpu (8) x "
       "gradient_accumulation_steps (4) x data-parallel size (2) = 64"});
}

TEST(DeepSpeed, Fp16IsAnErrorSayingUseBf16) {
  expect_config_error(
      [] { map_deepspeed_config(read_ds("fp16_dynamic_loss_scale.json"), base_config(), 1); },
      {"fp16.enabled is true", "loss scaling is not supported", "use bf16"});
}

TEST(DeepSpeed, NvmeOffloadIsAnError) {
  expect_config_error(
      [] { map_deepspeed_config(read_ds("zero3_nvme_offload.json"), base_config(), 1); },
      {"zero_optimization.offload_optimizer.device \"nvme\" is not supported", "use \"cpu\""});
}

TEST(DeepSpeed, Stage0AdamWarmupLrMapsAndLoads) {
  const DeepSpeedMapping m =
      map_deepspeed_config(read_ds("stage0_adam_warmuplr.json"), base_config(), 1);
  const auto keys = by_key(m);
  EXPECT_EQ(keys.at("zero.stage"), "0");
  EXPECT_EQ(keys.at("train.grad_accum"), "2");
  EXPECT_EQ(keys.at("train.micro_batch"), "4");  // derived: 8 / (2 x 1)
  EXPECT_EQ(keys.at("train.warmup_steps"), "10");
  EXPECT_EQ(keys.at("log.every_steps"), "5");
  EXPECT_DOUBLE_EQ(number_of(m, "train.lr"), 0.0015);
  EXPECT_DOUBLE_EQ(number_of(m, "train.min_lr"), 0.0015);  // WarmupLR: constant after warmup
  EXPECT_DOUBLE_EQ(number_of(m, "train.beta2"), 0.98);
  EXPECT_DOUBLE_EQ(number_of(m, "train.eps"), 1e-9);
  EXPECT_DOUBLE_EQ(number_of(m, "train.weight_decay"), 0.01);
  EXPECT_DOUBLE_EQ(number_of(m, "train.grad_clip"), 0.5);
  EXPECT_TRUE(m.warnings.empty()) << all_warnings(m);

  TempDir dir;
  const std::string cfg_path = dir.write("run.json", kShardlmConfig);
  std::vector<std::string> warnings;
  const RunConfig cfg = load_run_config_with_deepspeed(
      cfg_path, data_path("stage0_adam_warmuplr.json"), {}, 1, warnings);
  EXPECT_TRUE(warnings.empty());
  EXPECT_EQ(cfg.train.micro_batch, 4);
  EXPECT_EQ(cfg.train.grad_accum, 2);
  EXPECT_DOUBLE_EQ(cfg.train.lr, 0.0015);
  EXPECT_DOUBLE_EQ(cfg.train.min_lr, 0.0015);
  EXPECT_EQ(cfg.train.warmup_steps, 10);
  EXPECT_EQ(cfg.log.every_steps, 5);
  EXPECT_EQ(cfg.zero.stage, 0);
  EXPECT_EQ(cfg.train.max_steps, 10);  // from the shardlm file
  const json summary = run_config_to_json(cfg);
  EXPECT_EQ(summary["zero"]["stage"], 0);
}

// The realistic stage-2 and stage-3 configs load whole (file, mapping, validation), with the
// warnings for what shardlm does its own way; the user's --set comes last and wins.
TEST(DeepSpeed, WholeLoadOfZeroStages) {
  TempDir dir;
  const std::string cfg_path = dir.write("run.json", kShardlmConfig);
  std::vector<std::string> warnings;
  RunConfig cfg =
      load_run_config_with_deepspeed(cfg_path, data_path("zero2_bf16_auto.json"), {}, 1, warnings);
  EXPECT_EQ(cfg.zero.stage, 2);
  EXPECT_EQ(cfg.precision.param, "bf16");
  EXPECT_EQ(cfg.zero.reduce_bucket_bytes, 800000000);
  EXPECT_EQ(warnings.size(), 3u);

  warnings.clear();
  cfg = load_run_config_with_deepspeed(cfg_path, data_path("zero3_cpu_offload.json"), {}, 1,
                                       warnings);
  EXPECT_EQ(cfg.zero.stage, 3);
  EXPECT_EQ(cfg.zero.offload_optimizer, "cpu");
  EXPECT_EQ(cfg.zero.offload_params, "cpu");
  EXPECT_TRUE(cfg.zero.overlap_comm);
  EXPECT_EQ(cfg.precision.param, "bf16");
  EXPECT_EQ(cfg.train.micro_batch, 8);
  EXPECT_EQ(cfg.train.grad_accum, 4);
  EXPECT_DOUBLE_EQ(cfg.train.grad_clip, 1.0);
  EXPECT_FALSE(warnings.empty());

  warnings.clear();
  cfg = load_run_config_with_deepspeed(cfg_path, data_path("zero2_bf16_auto.json"),
                                       {"zero.stage=0"}, 1, warnings);
  EXPECT_EQ(cfg.zero.stage, 0);
  EXPECT_EQ(cfg.precision.param, "bf16");
  EXPECT_EQ(cfg.log.every_steps, 2000);
}

// ---- train_batch_size -----------------------------------------------------------------------

struct BatchCase {
  const char* name;
  const char* ds;
  int64_t world;
  int64_t tp = 1;
  int64_t micro = 8, accum = 1;  // the shardlm config's
  int64_t want_micro = 0, want_accum = 0;
  std::vector<std::string> error = {};
};

void PrintTo(const BatchCase& c, std::ostream* os) { *os << c.name; }

class DeepSpeedBatch : public ::testing::TestWithParam<BatchCase> {};

TEST_P(DeepSpeedBatch, DerivesOrChecks) {
  const BatchCase& c = GetParam();
  RunConfig base = base_config();  // a RunConfig is not validated by the mapping
  base.parallel.tp = c.tp;
  base.train.micro_batch = c.micro;
  base.train.grad_accum = c.accum;
  if (!c.error.empty()) {
    expect_config_error([&] { map_deepspeed_config(json::parse(c.ds), base, c.world); }, c.error);
    return;
  }
  const DeepSpeedMapping m = map_deepspeed_config(json::parse(c.ds), base, c.world);
  const auto keys = by_key(m);
  const int64_t micro = keys.count("train.micro_batch") ? std::stoll(keys.at("train.micro_batch"))
                                                        : base.train.micro_batch;
  const int64_t accum = keys.count("train.grad_accum") ? std::stoll(keys.at("train.grad_accum"))
                                                       : base.train.grad_accum;
  EXPECT_EQ(micro, c.want_micro);
  EXPECT_EQ(accum, c.want_accum);
  if (m.train_batch_size > 0) {
    const int64_t cp = keys.count("parallel.cp") ? std::stoll(keys.at("parallel.cp")) : 1;
    EXPECT_EQ(micro * accum * (c.world / (c.tp * cp)), m.train_batch_size);
    RunConfig final_cfg = base;
    final_cfg.train.micro_batch = micro;
    final_cfg.train.grad_accum = accum;
    final_cfg.parallel.cp = cp;
    check_deepspeed_batch(m, final_cfg);  // consistent: no throw
  }
}

INSTANTIATE_TEST_SUITE_P(
    DeepSpeed, DeepSpeedBatch,
    ::testing::Values(
        BatchCase{"AccumFromTotalAndMicro",
                  R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8})", 4, 1, 8, 1, 8,
                  2},
        BatchCase{"MicroFromTotalAndAccum",
                  R"({"train_batch_size": 64, "gradient_accumulation_steps": 2})", 4, 1, 3, 1, 8,
                  2},
        BatchCase{"AccumFromShardlmMicro", R"({"train_batch_size": 64})", 2, 1, 8, 1, 8, 4},
        BatchCase{"AutoFactorsUseShardlm",
                  R"({"train_batch_size": 48, "train_micro_batch_size_per_gpu": "auto",
                      "gradient_accumulation_steps": "auto"})",
                  3, 1, 2, 5, 2, 8},
        BatchCase{"AllThreeConsistent",
                  R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
                      "gradient_accumulation_steps": 2})",
                  4, 1, 1, 1, 8, 2},
        BatchCase{"AutoTotalIsNoConstraint",
                  R"({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                      "gradient_accumulation_steps": 3})",
                  5, 1, 8, 1, 4, 3},
        BatchCase{"NoBatchKeysKeepShardlm", R"({})", 7, 1, 6, 5, 6, 5},
        BatchCase{"TensorParallelShrinksDp",
                  R"({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4})", 8, 2, 8, 1, 4,
                  2},
        BatchCase{"SequenceParallelShrinksDp",
                  R"({"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
                      "sequence_parallel_size": 2})",
                  4, 1, 8, 1, 2, 2},
        BatchCase{"InconsistentNamesTheThreeNumbers",
                  R"({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
                      "gradient_accumulation_steps": 2})",
                  2,
                  1,
                  8,
                  1,
                  0,
                  0,
                  {"train_batch_size (64) must equal train_micro_batch_size_per_gpu (8) x "
                   "gradient_accumulation_steps (2) x data-parallel size (2) = 32",
                   "\"auto\""}},
        BatchCase{"TotalNotAMultipleOfMicro",
                  R"({"train_batch_size": 60, "train_micro_batch_size_per_gpu": 8})",
                  1,
                  1,
                  8,
                  1,
                  0,
                  0,
                  {"train_batch_size (60) is not a multiple of train_micro_batch_size_per_gpu (8) "
                   "x data-parallel size (1) = 8",
                   "gradient_accumulation_steps cannot be derived"}},
        BatchCase{"TotalNotAMultipleOfShardlmMicro",
                  R"({"train_batch_size": 30})",
                  2,
                  1,
                  4,
                  1,
                  0,
                  0,
                  {"train_batch_size (30)", "(4, shardlm's train.micro_batch)",
                   "data-parallel size (2) = 8"}},
        BatchCase{"TotalNotAMultipleOfAccum",
                  R"({"train_batch_size": 10, "gradient_accumulation_steps": 4})",
                  1,
                  1,
                  8,
                  1,
                  0,
                  0,
                  {"train_batch_size (10) is not a multiple of gradient_accumulation_steps (4)",
                   "train_micro_batch_size_per_gpu cannot be derived"}},
        BatchCase{"TopologyNotDividingWorld",
                  R"({"train_batch_size": 8})",
                  6,
                  4,
                  8,
                  1,
                  0,
                  0,
                  {"parallel.tp (4)", "does not divide the world size 6"}}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(DeepSpeed, SetAfterDeepSpeedIsCheckedAgainstTrainBatchSize) {
  TempDir dir;
  const std::string cfg_path = dir.write("run.json", kShardlmConfig);
  const std::string ds_path =
      dir.write("ds.json", R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4})");
  std::vector<std::string> warnings;
  // micro 4 from DeepSpeed, accum 4 derived; then --set train.micro_batch=2 breaks the product.
  expect_config_error(
      [&] {
        load_run_config_with_deepspeed(cfg_path, ds_path, {"train.micro_batch=2"}, 1, warnings);
      },
      {"train_batch_size (16) must equal train.micro_batch (2) x train.grad_accum (4) x "
       "data-parallel size (1) = 8"});
  // With micro "auto" the --set value is the one the derivation uses.
  const std::string auto_path = dir.write(
      "ds_auto.json", R"({"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto"})");
  const RunConfig cfg =
      load_run_config_with_deepspeed(cfg_path, auto_path, {"train.micro_batch=2"}, 1, warnings);
  EXPECT_EQ(cfg.train.micro_batch, 2);
  EXPECT_EQ(cfg.train.grad_accum, 8);
}

// ---- "auto" and warnings --------------------------------------------------------------------

TEST(DeepSpeed, AutoEverywhereKeepsShardlmValues) {
  const json ds = json::parse(R"({
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": "auto",
    "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto", "loss_scale": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "zero_optimization": {"stage": "auto", "overlap_comm": "auto", "reduce_bucket_size": "auto",
                          "allgather_bucket_size": "auto", "offload_optimizer": {"device": "auto"},
                          "stage3_prefetch_bucket_size": "auto", "sub_group_size": "auto"}
  })");
  const RunConfig base = base_config({"train.lr=0.002", "train.micro_batch=3"});
  const DeepSpeedMapping m = map_deepspeed_config(ds, base, 1);
  EXPECT_TRUE(m.overrides.empty()) << m.overrides.front();
  EXPECT_TRUE(m.warnings.empty()) << all_warnings(m);

  TempDir dir;
  const std::string cfg_path = dir.write("run.json", kShardlmConfig);
  const std::string ds_path = dir.write("ds.json", ds.dump());
  std::vector<std::string> warnings;
  const RunConfig cfg = load_run_config_with_deepspeed(
      cfg_path, ds_path, {"train.lr=0.002", "train.micro_batch=3"}, 1, warnings);
  EXPECT_EQ(run_config_to_json(cfg), run_config_to_json(base));
}

TEST(DeepSpeed, AutoInSchedulerResolvesFromShardlm) {
  // WarmupCosineLR with lr "auto": the floor is cos_min_ratio x shardlm's train.lr.
  const json ds = json::parse(R"({
    "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
    "scheduler": {"type": "WarmupCosineLR",
                  "params": {"warmup_num_steps": "auto", "cos_min_ratio": 0.25,
                             "warmup_type": "linear", "total_num_steps": "auto"}}
  })");
  const DeepSpeedMapping m = map_deepspeed_config(ds, base_config({"train.lr=0.004"}), 1);
  EXPECT_EQ(by_key(m).count("train.lr"), 0u);
  EXPECT_EQ(by_key(m).count("train.warmup_steps"), 0u);
  EXPECT_DOUBLE_EQ(number_of(m, "train.min_lr"), 0.001);
  EXPECT_TRUE(m.warnings.empty()) << all_warnings(m);
}

TEST(DeepSpeed, WarningsNameEachIgnoredKey) {
  const json ds = json::parse(R"({
    "wall_clock_breakdown": true,
    "flops_profiler": {"enabled": true, "profile_step": 1},
    "tensorboard": {"enabled": false, "output_path": "tb/"},
    "communication_data_type": "fp32",
    "prescale_gradients": false,
    "activation_checkpointing": {"partition_activations": true, "cpu_checkpointing": true},
    "zero_allow_untested_optimizer": true,
    "my_custom_key": 3,
    "zero_optimization": {
      "stage": 0, "contiguous_gradients": false, "sub_group_size": 1e9,
      "stage3_param_persistence_threshold": 1e5, "reduce_scatter": true, "foo_bar": 1,
      "zero_quantized_gradients": false, "mics_shard_size": -1
    },
    "optimizer": {"type": "adamw", "params": {"lr": 1e-3, "fused": true}},
    "bf16": {"enabled": true, "immediate_grad_update": true}
  })");
  const DeepSpeedMapping m = map_deepspeed_config(ds, base_config(), 1);
  const std::vector<std::string> expected = {
      "wall_clock_breakdown (true) is ignored: shardlm writes metrics.jsonl",
      "flops_profiler ({\"enabled\":true,\"profile_step\":1}) is ignored",
      "activation_checkpointing",
      "memory.checkpointing",
      "zero_allow_untested_optimizer (true) is ignored: shardlm always runs its own AdamW",
      "'my_custom_key' is not a DeepSpeed key shardlm knows; it is ignored",
      "zero_optimization.contiguous_gradients (false) is ignored: shardlm's gradients always "
      "live in one contiguous arena",
      "zero_optimization.sub_group_size (1000000000.0) is ignored: it is not needed",
      "zero_optimization.stage3_param_persistence_threshold (100000.0) is ignored: stage 3 "
      "shards every parameter",
      "'zero_optimization.foo_bar' is not a ZeRO key shardlm knows; it is ignored",
      "optimizer.params.fused (true) is ignored",
      "bf16.immediate_grad_update (true) is ignored: shardlm keeps f32 master weights",
  };
  for (const auto& text : expected)
    EXPECT_EQ(warned(m, text), 1) << text << "\n" << all_warnings(m);
  EXPECT_EQ(m.warnings.size(), 11u) << all_warnings(m);
  // Values that ask for nothing give no warning.
  for (const char* quiet : {"tensorboard", "communication_data_type", "prescale_gradients",
                            "reduce_scatter", "zero_quantized_gradients", "mics_shard_size"})
    EXPECT_EQ(warned(m, quiet), 0) << quiet << "\n" << all_warnings(m);
  EXPECT_EQ(by_key(m).at("precision.param"), "\"bf16\"");
}

// communication_data_type is the gradient reductions' wire format: zero.reduce_dtype.
TEST(DeepSpeed, CommunicationDataTypeSetsTheReductionsWireFormat) {
  const json bf16 = json::parse(R"({"communication_data_type": "bf16",
                                    "zero_optimization": {"stage": 2}})");
  const DeepSpeedMapping m = map_deepspeed_config(bf16, base_config(), 1);
  EXPECT_EQ(by_key(m).at("zero.reduce_dtype"), "\"bf16\"");
  EXPECT_TRUE(m.warnings.empty()) << all_warnings(m);
  const json fp16 = json::parse(R"({"communication_data_type": "fp16"})");
  try {
    map_deepspeed_config(fp16, base_config(), 1);
    ADD_FAILURE() << "fp16 reductions accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("communication_data_type must be \"fp32\" or \"bf16\""),
              std::string::npos)
        << e.what();
  }
}

TEST(DeepSpeed, SchedulerApproximationsWarn) {
  const json ds = json::parse(R"({
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 1e-5, "warmup_max_lr": 2e-3,
                             "warmup_num_steps": 50, "warmup_type": "log",
                             "total_num_steps": 999}}
  })");
  const DeepSpeedMapping m = map_deepspeed_config(ds, base_config(), 1);
  EXPECT_DOUBLE_EQ(number_of(m, "train.lr"), 2e-3);  // warmup_max_lr wins, as in DeepSpeed
  EXPECT_DOUBLE_EQ(number_of(m, "train.min_lr"), 1e-5);
  EXPECT_EQ(warned(m,
                   "optimizer.params.lr (0.001) is replaced by "
                   "scheduler.params.warmup_max_lr (0.002)"),
            1);
  EXPECT_EQ(warned(m, "scheduler.params.warmup_type \"log\" is approximated"), 1);
  EXPECT_EQ(warned(m, "scheduler.params.warmup_min_lr (1e-05) is not the warmup's start"), 1);
  EXPECT_EQ(warned(m, "scheduler.params.total_num_steps (999) is not used"), 1);
  EXPECT_EQ(warned(m, "WarmupDecayLR decays linearly"), 1);
  EXPECT_EQ(m.warnings.size(), 5u) << all_warnings(m);

  // total_num_steps equal to train.max_steps is exactly shardlm's decay length: no warning.
  const json same = json::parse(R"({"scheduler": {"type": "WarmupCosineLR", "params":
      {"total_num_steps": 10, "warmup_type": "linear"}}, "optimizer": {"type": "AdamW",
      "params": {"lr": 0.01}}})");
  const DeepSpeedMapping s = map_deepspeed_config(same, base_config(), 1);
  EXPECT_TRUE(s.warnings.empty()) << all_warnings(s);
  EXPECT_DOUBLE_EQ(number_of(s, "train.min_lr"), 0.01 * 0.0001);  // DeepSpeed's default ratio
}

TEST(DeepSpeed, DeprecatedCpuOffloadAndParallelKeys) {
  const json ds = json::parse(R"({
    "zero_optimization": {"stage": 3, "cpu_offload": true, "cpu_offload_params": true},
    "tensor_parallel": {"autotp_size": 2},
    "sequence_parallel_size": 4
  })");
  const auto keys = by_key(map_deepspeed_config(ds, base_config(), 8));
  EXPECT_EQ(keys.at("zero.offload_optimizer"), "\"cpu\"");
  EXPECT_EQ(keys.at("zero.offload_params"), "\"cpu\"");
  EXPECT_EQ(keys.at("parallel.tp"), "2");
  EXPECT_EQ(keys.at("parallel.cp"), "4");
  EXPECT_EQ(keys.at("parallel.cp_kind"), "\"ulysses\"");
}

}  // namespace
}  // namespace shardlm
