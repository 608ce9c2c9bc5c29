// Tests of the DeepSpeed ds_config mapping (src/config/deepspeed.cpp, deepspeed_load.cpp) on bad
// input: each unsupported or malformed key fails naming the DeepSpeed key, the whole load's
// validation and file errors name their source, and a mutation test that only Error comes out.
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "shardlm/config/config.h"
#include "shardlm/config/deepspeed.h"
#include "shardlm/core/check.h"
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

// ---- errors ----------------------------------------------------------------------------------

struct DsError {
  const char* name;
  const char* ds;
  std::vector<std::string> expect;
};

void PrintTo(const DsError& c, std::ostream* os) { *os << c.name; }

class DeepSpeedError : public ::testing::TestWithParam<DsError> {};

TEST_P(DeepSpeedError, NamesTheKey) {
  const DsError& c = GetParam();
  expect_config_error([&] { map_deepspeed_config(json::parse(c.ds), base_config(), 1); }, c.expect);
}

INSTANTIATE_TEST_SUITE_P(
    DeepSpeed, DeepSpeedError,
    ::testing::Values(
        DsError{"NotAnObject", "[1, 2]", {"must be a JSON object", "array"}},
        DsError{"OptimizerLamb",
                R"({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}})",
                {"optimizer.type \"Lamb\" is not supported", "AdamW"}},
        DsError{"OptimizerNoType", R"({"optimizer": {"params": {}}})", {"optimizer.type"}},
        DsError{"AdamL2",
                R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false,
                                                               "weight_decay": 0.1}}})",
                {"optimizer.params.adam_w_mode is false", "(L2)", "\"AdamW\""}},
        DsError{"AdamL2ShardlmDecay",
                R"({"optimizer": {"type": "Adam", "params": {"adam_w_mode": false}}})",
                {"adam_w_mode is false", "weight decay (0.1)"}},
        DsError{"Amsgrad",
                R"({"optimizer": {"type": "AdamW", "params": {"amsgrad": true}}})",
                {"optimizer.params.amsgrad is true", "AMSGrad"}},
        DsError{"NoBiasCorrection",
                R"({"optimizer": {"type": "AdamW", "params": {"bias_correction": false}}})",
                {"optimizer.params.bias_correction is false"}},
        DsError{"UnknownOptimizerParam",
                R"({"optimizer": {"type": "AdamW", "params": {"momentum": 0.9}}})",
                {"optimizer.params.momentum is not a parameter of shardlm's AdamW"}},
        DsError{"BetasOne",
                R"({"optimizer": {"type": "AdamW", "params": {"betas": [0.9]}}})",
                {"optimizer.params.betas must be [beta1, beta2]"}},
        DsError{"LrString",
                R"({"optimizer": {"type": "AdamW", "params": {"lr": "fast"}}})",
                {"optimizer.params.lr must be a number or \"auto\", got \"fast\""}},
        DsError{"SchedulerOneCycle",
                R"({"scheduler": {"type": "OneCycle", "params": {}}})",
                {"scheduler.type \"OneCycle\" is not supported", "WarmupCosineLR"}},
        DsError{"SchedulerNoType", R"({"scheduler": {}})", {"scheduler.type (missing)"}},
        DsError{"WarmupTypeBad",
                R"({"scheduler": {"type": "WarmupLR", "params": {"warmup_type": "cubic"}}})",
                {"scheduler.params.warmup_type must be \"log\" or \"linear\""}},
        DsError{"CosMinRatioBad",
                R"({"scheduler": {"type": "WarmupCosineLR", "params": {"cos_min_ratio": 2}}})",
                {"cos_min_ratio must be in [0, 1]"}},
        DsError{"StageFive",
                R"({"zero_optimization": {"stage": 5}})",
                {"zero_optimization.stage must be 0, 1, 2 or 3, got 5"}},
        DsError{"StageString",
                R"({"zero_optimization": {"stage": "two"}})",
                {"zero_optimization.stage must be an integer >= 0 or \"auto\", got \"two\""}},
        DsError{"ZeroNotObject",
                R"({"zero_optimization": 2})",
                {"zero_optimization must be a JSON object"}},
        DsError{"BucketNegative",
                R"({"zero_optimization": {"reduce_bucket_size": -1}})",
                {"zero_optimization.reduce_bucket_size must be an integer >= 1"}},
        DsError{"BucketHuge",
                R"({"zero_optimization": {"allgather_bucket_size": 5e15}})",
                {"zero_optimization.allgather_bucket_size", "larger than any bucket"}},
        DsError{"OffloadGpu",
                R"({"zero_optimization": {"offload_param": {"device": "gpu"}}})",
                {"zero_optimization.offload_param.device must be \"cpu\" or \"none\""}},
        DsError{"NvmeParams",
                R"({"zero_optimization": {"offload_param": {"device": "nvme"}}})",
                {"zero_optimization.offload_param.device \"nvme\" is not supported"}},
        DsError{"QuantizedGradients",
                R"({"zero_optimization": {"zero_quantized_gradients": true}})",
                {"zero_optimization.zero_quantized_gradients (true) is not supported",
                 "full precision"}},
        DsError{"Amp",
                R"({"amp": {"enabled": true, "opt_level": "O1"}})",
                {"amp", "is not supported", "bf16"}},
        DsError{"Elasticity",
                R"({"elasticity": {"enabled": true, "max_train_batch_size": 64}})",
                {"elasticity", "elastic training"}},
        DsError{"Curriculum",
                R"({"curriculum_learning": {"enabled": true}})",
                {"curriculum_learning", "which tokens are trained"}},
        DsError{"SparseAttention",
                R"({"sparse_attention": {"mode": "fixed"}})",
                {"sparse_attention", "dense causal"}},
        DsError{"Bf16NotBool",
                R"({"bf16": {"enabled": "yes"}})",
                {"bf16.enabled must be true, false or \"auto\", got \"yes\""}},
        DsError{"Fp16NotObject", R"({"fp16": true})", {"fp16 must be a JSON object"}},
        DsError{"MicroZero",
                R"({"train_micro_batch_size_per_gpu": 0})",
                {"train_micro_batch_size_per_gpu must be an integer >= 1"}},
        DsError{"MicroFraction",
                R"({"train_micro_batch_size_per_gpu": 2.5})",
                {"train_micro_batch_size_per_gpu must be an integer"}},
        DsError{"ClipString",
                R"({"gradient_clipping": "yes"})",
                {"gradient_clipping must be a number"}}),
    [](const auto& info) { return std::string(info.param.name); });

TEST(DeepSpeed, ValidationErrorsNameTheDeepSpeedKey) {
  TempDir dir;
  const std::string cfg_path = dir.write("run.json", kShardlmConfig);
  const std::string ds_path =
      dir.write("ds.json", R"({"optimizer": {"type": "AdamW", "params": {"lr": -1}}})");
  std::vector<std::string> warnings;
  expect_config_error(
      [&] { load_run_config_with_deepspeed(cfg_path, ds_path, {}, 1, warnings); },
      {"train.lr must be > 0", "set by the DeepSpeed config", "train.lr from optimizer.params.lr"});
  // A mapping error names the file and the DeepSpeed key.
  const std::string nvme = data_path("zero3_nvme_offload.json");
  expect_config_error([&] { load_run_config_with_deepspeed(cfg_path, nvme, {}, 1, warnings); },
                      {"DeepSpeed config '" + nvme + "'", "offload_optimizer.device \"nvme\""});
  // An error that has nothing to do with the DeepSpeed file is passed on as it is.
  expect_config_error(
      [&] {
        load_run_config_with_deepspeed(cfg_path, data_path("stage0_adam_warmuplr.json"),
                                       {"data.seq_len=1"}, 1, warnings);
      },
      {"data.seq_len"});
}

TEST(DeepSpeed, FileErrorsNameTheFile) {
  TempDir dir;
  const std::string cfg_path = dir.write("run.json", kShardlmConfig);
  std::vector<std::string> warnings;
  expect_config_error(
      [&] { load_run_config_with_deepspeed(cfg_path, "/nonexistent/ds.json", {}, 1, warnings); },
      {"/nonexistent/ds.json"});
  const std::string broken = dir.write("broken.json", "{\"zero_optimization\": {\"stage\": 2,}}");
  expect_config_error([&] { load_run_config_with_deepspeed(cfg_path, broken, {}, 1, warnings); },
                      {broken, "invalid JSON at byte"});
}

// ---- robustness: no input may produce anything but shardlm::Error ----------------------------

TEST(DeepSpeed, RandomMutationsOnlyThrowConfigErrors) {
  const std::string a = read_ds("zero3_cpu_offload.json").dump();
  const std::string b = read_ds("stage0_adam_warmuplr.json").dump();
  const std::string structural = "{}[]\":,.-+eE0123456789 tfnul\"auto";
  std::mt19937_64 rng(20250101);
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % std::max<size_t>(n, 1)); };
  const RunConfig base = base_config();
  int parsed = 0;
  for (int i = 0; i < 3000; ++i) {
    std::string s = i % 2 ? a : b;
    for (int e = 0, edits = 1 + static_cast<int>(pick(3)); e < edits; ++e) {
      const size_t pos = pick(s.size());
      switch (pick(3)) {
        case 0:
          s[pos] = structural[pick(structural.size())];
          break;
        case 1:
          s.insert(s.begin() + pos, structural[pick(structural.size())]);
          break;
        default:
          s.erase(pos, 1 + pick(6));
          break;
      }
    }
    const json ds = json::parse(s, nullptr, /*allow_exceptions=*/false);
    if (ds.is_discarded()) continue;
    ++parsed;
    try {
      const DeepSpeedMapping m = map_deepspeed_config(ds, base, 1 + static_cast<int64_t>(pick(4)));
      EXPECT_EQ(m.overrides.size(), m.sources.size());
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kConfig) << e.what();
    } catch (const std::exception& e) {
      ADD_FAILURE() << "non-shardlm exception " << e.what() << " for input:\n" << s;
    }
  }
  EXPECT_GT(parsed, 300);
}

}  // namespace
}  // namespace shardlm
