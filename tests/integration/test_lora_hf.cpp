// LoRA against Hugging Face peft + transformers: a random Llama and a random Qwen3 (q/k norms
// after the adapted q and k projections, heads wider than hidden / heads) made by transformers
// are each fine-tuned with adapters by `shardlm train` (model.hf_dir, every target, dropout) on
// an alpaca instruction file given as data.train (README's worked example), exported with `shardlm
// convert hf-export` as a PEFT adapter and with --merge; PeftModel(base, adapter) and transformers
// on the merged directory give shardlm's logits (base
// + adapters, computed here from the exported files) at every position within fp32 tolerance. Needs
// the venv with torch, transformers and peft (skips saying so without it).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "integration/hf_logits.h"
#include "shardlm/backend/backend.h"
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

// shardlm's logits [T][V]: the base from its directory, the adapters from the exported PEFT file.
std::vector<std::vector<float>> shardlm_logits(const fs::path& base, const fs::path& adapter,
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
  const SafetensorsFile a((adapter / "adapter_model.safetensors").string());
  for (const ParamEntry& e : model.lora_layout().params.entries)
    a.read_f32(e.name, model.lora_params().f32() + e.offset);
  return test::prefix_logits(model, kTokens);
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
  const std::string ck = (run_dir / "checkpoints").string();
  run(std::string(SHARDLM_BINARY) + " convert hf-export " + ck + " --output " + adapter.string(),
      root / "export.txt");
  run(std::string(SHARDLM_BINARY) + " convert hf-export " + ck + " --output " + merged.string() +
          " --merge",
      root / "merge.txt");

  const json ac = json::parse(test::slurp(adapter / "adapter_config.json"));
  EXPECT_EQ(ac["peft_type"], "LORA");
  EXPECT_EQ(ac["r"], 4);
  EXPECT_EQ(ac["target_modules"].size(), 7u);
  EXPECT_EQ(ac["base_model_name_or_path"], fs::absolute(base).lexically_normal().string());
  LoraConfig lora;
  lora.rank = 4;
  lora.alpha = 8;
  lora.targets = lora_targets_from_string("all");
  {  // trained: B moved away from PEFT's zero init
    const SafetensorsFile a((adapter / "adapter_model.safetensors").string());
    const std::string b_name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight";
    std::vector<float> b(size_t(a.info(b_name).shape[0] * a.info(b_name).shape[1]));
    a.read_f32(b_name, b.data());
    double norm = 0;
    for (float x : b) norm += double(x) * x;
    EXPECT_GT(norm, 1e-6) << "lora_B did not train";
  }
  const auto ours = shardlm_logits(base, adapter, lora);
  const std::string out =
      run(python + " " + src_dir + "lora_reference.py logits " + base.string() + " " +
              adapter.string() + " " + merged.string() + " '" + json(kTokens).dump() + "'",
          root / "reference.txt");
  const test::PeftLogits ref = test::peft_logits_from(out);
  const ModelConfig cfg = read_hf_config(base.string()).config;
  expect_logits_near(ours, ref.peft, cfg, "shardlm base + adapters vs PeftModel");
  expect_logits_near(ref.merged, ref.peft, cfg, "merged export in transformers vs PeftModel");
  test::expect_adapter_changes_logits(ref);
}

// gemma2: the adapters under Gemma 2's soft caps on the scores and the logits.
INSTANTIATE_TEST_SUITE_P(Families, LoraHf, ::testing::Values("llama", "qwen3", "gemma2", "gemma3"));

}  // namespace
}  // namespace shardlm
