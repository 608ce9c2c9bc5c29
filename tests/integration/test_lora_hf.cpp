// LoRA against Hugging Face peft + transformers: a random Llama, a random Qwen3 (q/k norms
// after the adapted q and k projections, heads wider than hidden / heads), Gemma 2 and 3, and
// GLM-4 and GLM-4-0414 (whose base fuses the gate and up projections into gate_up_proj) made by
// transformers are each fine-tuned with adapters by `shardlm train` (model.hf_dir, every
// target, dropout) on an alpaca instruction file given as data.train (README's worked example),
// exported with `shardlm convert hf-export` as a PEFT adapter and with --merge;
// PeftModel(base, adapter) and transformers on the merged directory give shardlm's logits (the
// base with the checkpoint's own adapters) at every position within fp32 tolerance. GLM's gate
// and up adapters export as one adapter on gate_up_proj of twice the rank (peft_adapter.cpp).
// Needs the venv with torch, transformers and peft (skips saying so without it).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "integration/hf_logits.h"
#include "shardlm/backend/backend.h"
#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/hf/hf.h"
#include "shardlm/io/safetensors.h"
#include "shardlm/model/llama.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::vector<int32_t> kTokens = {5, 77, 123, 9, 250, 31, 299, 0, 42, 42, 17, 180};

// The command's stdout and stderr, together.
std::string run(const std::string& cmd, const fs::path& out) {
  return test::run_command(cmd, out, /*merge_stderr=*/true);
}

// shardlm's logits [T][V]: the base from its directory, the adapters the run trained from its
// latest checkpoint (the f32 arena as the model's adapter layout orders it).
std::vector<std::vector<float>> shardlm_logits(const fs::path& base, const fs::path& checkpoints,
                                               const LoraConfig& lora) {
  const HfModelInfo info = read_hf_config(base.string());
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  ModelOptions opt;
  opt.max_seq = int64_t(kTokens.size());
  opt.lora = lora;
  LlamaModel model(info.config, opt, *be, ledger);
  const SafetensorsDir st(base.string());
  const ParamLayout& L = model.layout();
  for (int u = 0; u < int(L.units.size()); ++u)
    read_hf_unit(st, L, u, model.params().f32() + L.units[u].begin);
  const CheckpointReader ck(checkpoints.string());
  const Tensor adapters = model.lora_params();
  EXPECT_EQ(ck.vector_bytes("params"), size_t(adapters.numel()) * 4);
  ck.read_vector("params", 0, adapters.f32(), size_t(adapters.numel()) * 4);
  return test::prefix_logits(model, kTokens);
}

// GLM's exported gate_up_proj adapter of one layer: A [2r, D] stacks the gate's A over the up's,
// B [2F, 2r] is block-diagonal, the gate's B top left and the up's bottom right; both equal the
// checkpoint's adapters exactly (f32 export).
void expect_fused_gate_up(const fs::path& adapter, const fs::path& checkpoints,
                          const ModelConfig& cfg, const LoraConfig& lora, int layer) {
  const LoraLayout A = make_lora_layout(cfg, lora);
  const CheckpointReader ck(checkpoints.string());
  const SafetensorsFile f((adapter / "adapter_model.safetensors").string());
  const std::string m = "base_model.model.model.layers." + std::to_string(layer) + ".mlp.";
  EXPECT_FALSE(f.contains(m + "gate_proj.lora_A.weight"));
  const int64_t r = lora.rank, D = cfg.dim, F = cfg.ffn_dim;
  ASSERT_EQ(f.info(m + "gate_up_proj.lora_A.weight").shape, (std::vector<int64_t>{2 * r, D}));
  ASSERT_EQ(f.info(m + "gate_up_proj.lora_B.weight").shape, (std::vector<int64_t>{2 * F, 2 * r}));
  std::vector<float> fa(size_t(2 * r * D)), fb(size_t(4 * F * r));
  f.read_f32(m + "gate_up_proj.lora_A.weight", fa.data());
  f.read_f32(m + "gate_up_proj.lora_B.weight", fb.data());
  std::vector<float> a(size_t(r * D)), b(size_t(F * r));
  for (int half = 0; half < 2; ++half) {
    const LoraTarget t = half == 0 ? LoraTarget::kGate : LoraTarget::kUp;
    ck.read_vector("params", uint64_t(A.a[size_t(layer)][size_t(t)]) * 4, a.data(), a.size() * 4);
    ck.read_vector("params", uint64_t(A.b[size_t(layer)][size_t(t)]) * 4, b.data(), b.size() * 4);
    for (int64_t i = 0; i < r * D; ++i) ASSERT_EQ(fa[size_t(half * r * D + i)], a[size_t(i)]);
    for (int64_t i = 0; i < F; ++i)
      for (int64_t j = 0; j < 2 * r; ++j) {
        const bool own = j / r == half;
        ASSERT_EQ(fb[size_t((half * F + i) * 2 * r + j)], own ? b[size_t(i * r + j % r)] : 0.f)
            << lora_target_name(t) << " row " << i << " column " << j;
      }
  }
}

using test::expect_logits_near;

class LoraHf : public ::testing::TestWithParam<const char*> {};

TEST_P(LoraHf, AdapterAndMergedExportsMatchPeftAndTransformers) {
  std::string python = test::venv_python("peft");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("peft"));
  const std::string family = GetParam();
  const fs::path root = test::scratch_root() / ("lora_hf_" + family);
  fs::remove_all(root);
  fs::create_directories(root);
  const std::string src_dir = std::string(SHARDLM_SOURCE_DIR) + "/tests/integration/";
  const fs::path base = root / "base", run_dir = root / "run", adapter = root / "adapter",
                 merged = root / "merged";
  run(python + " " + src_dir + "hf_reference.py make " + base.string() + " " + family,
      root / "make.txt");
  {  // instruction records, read and packed whole by the run itself
    std::ofstream f(root / "alpaca.jsonl");
    for (int i = 0; i < 12; ++i)
      f << json{{"instruction", "Add " + std::to_string(i) + " and 3."},
                {"input", i % 3 == 0 ? "Show it." : ""},
                {"output", std::to_string(i + 3) + "."}}
               .dump()
        << "\n";
  }
  std::ofstream(root / "train.json")
      << json{{"data", {{"train", (root / "alpaca.jsonl").string()}, {"seq_len", 64}}},
              {"model", {{"hf_dir", base.string()}}},
              {"train",
               {{"micro_batch", 2},
                {"max_steps", 3},
                {"lr", 2e-2},
                {"warmup_steps", 0},
                {"eval_every", 0},
                {"eval_batches", 1}}},
              {"lora", {{"rank", 4}, {"alpha", 8}, {"dropout", 0.05}, {"targets", "all"}}},
              {"sample", {{"count", 0}}},
              {"log", {{"dir", run_dir.string()}}}};
  run(std::string(SHARDLM_BINARY) + " train --config " + (root / "train.json").string(),
      root / "train.txt");
  const fs::path ck = run_dir / "checkpoints";
  run(std::string(SHARDLM_BINARY) + " convert hf-export " + ck.string() + " --output " +
          adapter.string(),
      root / "export.txt");
  run(std::string(SHARDLM_BINARY) + " convert hf-export " + ck.string() + " --output " +
          merged.string() + " --merge",
      root / "merge.txt");

  const json ac = json::parse(test::slurp(adapter / "adapter_config.json"));
  EXPECT_EQ(ac["peft_type"], "LORA");
  EXPECT_EQ(ac["r"], 4);
  EXPECT_EQ(ac["base_model_name_or_path"], fs::absolute(base).lexically_normal().string());
  LoraConfig lora;
  lora.rank = 4;
  lora.alpha = 8;
  lora.targets = lora_targets_from_string("all");
  const ModelConfig cfg = read_hf_config(base.string()).config;
  const bool glm = family.starts_with("glm");
  if (glm) {  // gate and up as one adapter on gate_up_proj: rank 2r, alpha 2 alpha (scale alpha/r)
    EXPECT_EQ(ac["target_modules"],
              json({"q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"}));
    EXPECT_EQ(ac["rank_pattern"], json({{"gate_up_proj", 8}}));
    EXPECT_EQ(ac["alpha_pattern"], json({{"gate_up_proj", 16.0}}));
    for (int l = 0; l < cfg.n_layers; ++l) expect_fused_gate_up(adapter, ck, cfg, lora, l);
  } else {
    EXPECT_EQ(ac["target_modules"].size(), 7u);
    EXPECT_FALSE(ac.contains("rank_pattern"));
  }
  {  // trained: B moved away from PEFT's zero init
    const SafetensorsFile a((adapter / "adapter_model.safetensors").string());
    const std::string b_name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight";
    std::vector<float> b(size_t(a.info(b_name).shape[0] * a.info(b_name).shape[1]));
    a.read_f32(b_name, b.data());
    double norm = 0;
    for (float x : b) norm += double(x) * x;
    EXPECT_GT(norm, 1e-6) << "lora_B did not train";
  }
  const auto ours = shardlm_logits(base, ck, lora);
  const std::string out =
      run(python + " " + src_dir + "lora_reference.py logits " + base.string() + " " +
              adapter.string() + " " + merged.string() + " '" + json(kTokens).dump() + "'",
          root / "reference.txt");
  const test::PeftLogits ref = test::peft_logits_from(out);
  expect_logits_near(ours, ref.peft, cfg, "shardlm base + adapters vs PeftModel");
  expect_logits_near(ref.merged, ref.peft, cfg, "merged export in transformers vs PeftModel");
  test::expect_adapter_changes_logits(ref);
}

// gemma2: the adapters under Gemma 2's soft caps on the scores and the logits; glm and glm4:
// the fused gate_up_proj adapter, under partial interleaved rotary (and GLM-4-0414's post-norms).
INSTANTIATE_TEST_SUITE_P(Families, LoraHf,
                         ::testing::Values("llama", "qwen3", "gemma2", "gemma3", "glm", "glm4"));

}  // namespace
}  // namespace shardlm
