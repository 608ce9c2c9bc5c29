// QLoRA from a Hugging Face directory bitsandbytes saved in 4 bits (transformers'
// save_pretrained of a BitsAndBytesConfig(load_in_4bit, nf4) model; tests/integration/
// bnb4bit_reference.py, with and without double quantization): an NF4 base holds the saved codes
// as they are and computes with bitsandbytes' dequantized values, bit for bit; a dense base
// reads those values; the merged export's round trip through NF4 leaves them unchanged; and
// the binary trains over such a directory, an NF4 base and a dense f32 one alike; the merged
// export's logits are PeftModel's over transformers' 4-bit base. Skips without the venv's
// bitsandbytes, transformers and peft (CI requires them).
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "integration/hf_logits.h"
#include "integration/tiny_runs.h"
#include "shardlm/backend/backend.h"
#include "shardlm/hf/hf.h"
#include "shardlm/io/safetensors.h"
#include "shardlm/model/llama.h"
#include "shardlm/model/nf4_base.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// The reference directories, made once per process ("" without the venv).
const fs::path& reference_root() {
  static const fs::path root = [] {
    const std::string python = test::venv_python("bitsandbytes");
    if (python.empty() || test::venv_python("peft").empty()) return fs::path();
    const fs::path d = test::scratch_root() / "bnb4bit";
    fs::create_directories(d);
    test::run_command(python + " " + test::source_dir() +
                          "/tests/integration/bnb4bit_reference.py make " + d.string(),
                      d / "log.txt", true);
    return d;
  }();
  return root;
}

bool same_bits(const float* a, const float* b, int64_t n) {
  return std::memcmp(a, b, size_t(n) * 4) == 0;
}

class Bnb4bitDir : public ::testing::TestWithParam<const char*> {};

TEST_P(Bnb4bitDir, Nf4BaseHoldsTheSavedCodesAndComputesWithBitsandbytesValues) {
  if (reference_root().empty())
    SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("bitsandbytes") + " (or peft)");
  const fs::path dir = reference_root() / GetParam();
  const HfModelInfo info = read_hf_config(dir.string());
  EXPECT_TRUE(info.bnb_4bit);
  EXPECT_FALSE(read_hf_config((reference_root() / "dense").string()).bnb_4bit);
  const ParamLayout L = make_param_layout(info.config);
  const Nf4BaseLayout N = make_nf4_base_layout(L);
  const SafetensorsDir st(dir.string()), dense_st((reference_root() / "dense").string());
  const SafetensorsFile ref((dir / "reference.safetensors").string());
  auto be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  ModelOptions opt;
  opt.activations = false;
  opt.lora.rank = 2;
  opt.lora.targets = lora_targets_from_string("all");
  opt.lora.nf4_base = true;
  for (const bool on_host : {false, true}) {
    SCOPED_TRACE(on_host ? "base in host memory" : "base on the device");
    opt.lora.offload_base = on_host;
    LlamaModel model(info.config, opt, *be, ledger);
    std::vector<float> values(size_t(L.max_unit)), held(values.size()), dense(values.size());
    std::vector<Nf4Matrix> nf4;
    int64_t matrices = 0;
    for (int u = 0; u < int(L.units.size()); ++u) {
      nf4.clear();
      read_hf_unit(st, L, u, values.data(), &nf4);
      read_hf_unit(dense_st, L, u, dense.data());
      model.set_base_unit(u, values.data(), nf4);
      model.read_base_unit(u, held.data());
      matrices += int64_t(nf4.size());
      for (const ParamEntry& e : L.entries) {
        if (e.offset < L.units[u].begin || e.offset >= L.units[u].end) continue;
        const int64_t at = e.offset - L.units[u].begin, n = e.shape.numel();
        if (!ref.contains(e.name + ".values")) {  // not quantized: as saved
          EXPECT_TRUE(same_bits(held.data() + at, dense.data() + at, n)) << e.name;
          continue;
        }
        std::vector<float> want(static_cast<size_t>(n));
        ref.read_f32(e.name + ".values", want.data());
        EXPECT_TRUE(same_bits(values.data() + at, want.data(), n)) << e.name << " as read";
        EXPECT_TRUE(same_bits(held.data() + at, want.data(), n)) << e.name << " as held";
        const auto m = std::find_if(nf4.begin(), nf4.end(),
                                    [&](const Nf4Matrix& x) { return x.begin == e.offset; });
        ASSERT_NE(m, nf4.end()) << e.name;
        const StTensorInfo& codes = ref.info(e.name + ".codes");
        ASSERT_EQ(int64_t(m->codes.size()), codes.numel()) << e.name;
        EXPECT_EQ(std::memcmp(m->codes.data(), ref.data(e.name + ".codes"), m->codes.size()), 0)
            << e.name << ": the codes differ from bitsandbytes'";
      }
      // The merged export rounds the base through NF4 again: the saved values stay as they are.
      std::vector<float> again = values;
      nf4_round_trip_unit(L, N, u, again.data());
      EXPECT_TRUE(same_bits(again.data(), values.data(), L.unit_size(u))) << L.unit_name(u);
    }
    EXPECT_EQ(matrices, 7 * info.config.n_layers);
  }
}

INSTANTIATE_TEST_SUITE_P(DoubleQuantization, Bnb4bitDir, ::testing::Values("nf4", "nf4_dq"));

// The merged export's logits in transformers against PeftModel(adapter) over transformers'
// bitsandbytes-loaded base (bnb4bit_reference.py logits; needs peft too).
void expect_merged_is_peft_over_bnb(const fs::path& merged, const fs::path& adapter,
                                    const fs::path& root) {
  const std::string python = test::venv_python("peft");
  const std::vector<int> tokens = {1, 17, 100, 250, 33, 7, 64, 300, 5, 211};
  const std::string out = test::run_command(
      python + " " + test::source_dir() + "/tests/integration/bnb4bit_reference.py logits " +
          (reference_root() / "nf4_dq").string() + " " + adapter.string() + " " + merged.string() +
          " '" + json(tokens).dump() + "'",
      root / "reference.txt", true);
  const test::PeftLogits ref = test::peft_logits_from(out);
  test::expect_logits_near(ref.merged, ref.peft,
                           read_hf_config((reference_root() / "nf4_dq").string()).config,
                           "merged export in transformers vs PeftModel over the 4-bit base");
  test::expect_adapter_changes_logits(ref);
}

// root/train.json: 3 steps of LoRA (rank 4 on every target, AdamW's eps kBoundedAdamEps) over
// the double-quantized bitsandbytes directory, logging to root/run; `patch` (a JSON merge patch)
// adds the run's own keys.
void write_bnb_lora_run(const fs::path& root, const json& patch) {
  json config = {{"data",
                  {{"train", std::string(SHARDLM_SOURCE_DIR) + "/tests/data/genesis_1_12.txt"},
                   {"seq_len", 32}}},
                 {"model", {{"hf_dir", (reference_root() / "nf4_dq").string()}}},
                 {"precision", {{"param", "fp32"}}},
                 {"train",
                  {{"max_steps", 3},
                   {"lr", 2e-2},
                   {"warmup_steps", 0},
                   {"eps", std::stod(test::kBoundedAdamEps)},
                   {"eval_every", 0},
                   {"eval_batches", 1}}},
                 {"lora", {{"rank", 4}, {"alpha", 8}, {"targets", "all"}}},
                 {"sample", {{"count", 0}}},
                 {"log", {{"dir", (root / "run").string()}}}};
  config.merge_patch(patch);
  std::ofstream(root / "train.json") << config;
}

// 3 steps of LoRA over the double-quantized directory: an NF4 base (its codes as saved) and a
// dense f32 base (bitsandbytes' dequantized values) compute with the same weights, so their
// losses agree; config.json's quantization_config is not exported, and the merged export's
// logits in transformers are those of PeftModel with the exported adapter over transformers'
// bitsandbytes-loaded base.
TEST(Bnb4bitDirRuns, TrainsAnNf4OrADenseBaseOverIt) {
  if (reference_root().empty())
    SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("bitsandbytes") + " (or peft)");
  std::vector<double> losses[2];
  int k = 0;
  for (const char* base : {"nf4", "auto"}) {
    const fs::path root = test::scratch_root() / ("bnb4bit_run_" + std::string(base));
    fs::remove_all(root);
    fs::create_directories(root);
    write_bnb_lora_run(root, {{"train", {{"micro_batch", 2}}}, {"lora", {{"base_dtype", base}}}});
    test::run_command(
        std::string(SHARDLM_BINARY) + " train --config " + (root / "train.json").string(),
        root / "train.txt", true);
    losses[k++] = test::metric_series(root / "run", "loss");
    if (std::string(base) != "nf4") continue;
    const std::string ck = (root / "run" / "checkpoints").string();
    const fs::path merged = root / "merged", adapter = root / "adapter";
    test::run_command(std::string(SHARDLM_BINARY) + " convert hf-export " + ck + " --output " +
                          merged.string() + " --merge",
                      root / "merge.txt", true);
    test::run_command(
        std::string(SHARDLM_BINARY) + " convert hf-export " + ck + " --output " + adapter.string(),
        root / "adapter.txt", true);
    const json cfg = json::parse(test::slurp(merged / "config.json"));
    EXPECT_FALSE(cfg.contains("quantization_config")) << cfg.dump();
    EXPECT_FALSE(read_hf_config(merged.string()).bnb_4bit);
    expect_merged_is_peft_over_bnb(merged, adapter, root);
  }
  ASSERT_EQ(losses[0].size(), 3u);
  ASSERT_EQ(losses[1].size(), 3u);
  const double tol =
      test::follow_bounds(test::scratch_root() / "bnb4bit_run_auto" / "run").relative;
  for (size_t i = 0; i < 3; ++i)
    EXPECT_NEAR(losses[0][i], losses[1][i], tol * std::abs(losses[1][i])) << "step " << i + 1;
}

// Over pipeline stages each stage holds its layers' codes as saved (re-based into its arena;
// the store refuses a matrix that is none of its unit's): pp = 2 follows the one-rank run.
TEST(Bnb4bitDirRuns, PipelineStagesHoldTheSavedCodes) {
  if (reference_root().empty())
    SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("bitsandbytes") + " (or peft)");
  std::vector<double> losses[2];
  for (const int pp : {1, 2}) {
    const fs::path root = test::scratch_root() / ("bnb4bit_pp" + std::to_string(pp));
    fs::remove_all(root);
    fs::create_directories(root);
    write_bnb_lora_run(root, {{"parallel", {{"pp", pp}}},
                              {"train", {{"micro_batch", 1}, {"grad_accum", 2}}},
                              {"lora", {{"base_dtype", "nf4"}}}});
    const int code = test::run_shardlm(pp, " train --config " + (root / "train.json").string(),
                                       root / "train.txt");
    ASSERT_EQ(code, 0) << test::slurp(root / "train.txt");
    losses[pp - 1] = test::metric_series(root / "run", "loss");
  }
  ASSERT_EQ(losses[0].size(), 3u);
  ASSERT_EQ(losses[1].size(), 3u);
  const double tol = test::follow_bounds(test::scratch_root() / "bnb4bit_pp1" / "run").relative;
  for (size_t i = 0; i < 3; ++i)
    EXPECT_NEAR(losses[1][i], losses[0][i], tol * std::abs(losses[0][i])) << "step " << i + 1;
}

// A quantization_config shardlm does not read is refused naming the file and the key.
TEST(Bnb4bitConfig, OtherQuantizationConfigsAreRefused) {
  const fs::path dir = test::scratch_root() / "bnb8bit";
  fs::create_directories(dir);
  for (const json& q : {json{{"quant_method", "bitsandbytes"}, {"load_in_8bit", true}},
                        json{{"quant_method", "bitsandbytes"},
                             {"load_in_4bit", true},
                             {"bnb_4bit_quant_type", "fp4"}},
                        json{{"quant_method", "gptq"}, {"bits", 4}}}) {
    SCOPED_TRACE(q.dump());
    const json c = {{"architectures", {"LlamaForCausalLM"}},
                    {"hidden_size", 64},
                    {"num_hidden_layers", 2},
                    {"num_attention_heads", 4},
                    {"num_key_value_heads", 2},
                    {"intermediate_size", 192},
                    {"vocab_size", 320},
                    {"rms_norm_eps", 1e-5},
                    {"rope_theta", 10000.0},
                    {"hidden_act", "silu"},
                    {"quantization_config", q}};
    std::ofstream(dir / "config.json") << c.dump();
    try {
      (void)read_hf_config(dir.string());
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kConfig);
      EXPECT_NE(std::string(e.what()).find("quantization_config"), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace shardlm
