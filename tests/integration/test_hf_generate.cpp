// `shardlm generate` against transformers' generate: a tiny random model of a family made by
// transformers, with a byte-level BPE tokenizer of exactly its vocabulary trained on the test
// corpus, is imported (f32) and continued greedily by shardlm's KV-cache decoder; the text it
// prints is transformers' greedy continuation of the same prompt (tokenized by the same
// tokenizer.json), byte for byte. Two f32 forwards agree within the bound of tests/tolerance.h
// relative to the largest logit; every step's choice in the reference leads the runner-up by
// more than twice that, so the same tokens are the only correct outcome. GLM-4
// (partial interleaved rotary, q/k/v biases, fused gate_up_proj) and GLM-4-0414 (its post-norms),
// and Llama as the harness's control. Needs the venv with torch, transformers and tokenizers
// (skips saying so without it).
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>

#include "shardlm/hf/hf.h"
#include "test_util.h"
#include "tolerance.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kPrompt = "And God said";
constexpr int kNewTokens = 24;

std::string run(const std::string& cmd, const fs::path& out, bool merge_stderr = true) {
  return test::run_command(cmd, out, merge_stderr);
}

std::string hex(const std::string& bytes) {
  std::string h;
  for (unsigned char c : bytes) h += fmt::format("{:02x}", c);
  return h;
}

// The JSON line hf_reference.py generate printed last (libraries may print around it).
json printed_continuation(const std::string& out) {
  const size_t at = out.rfind("{\"ids\"");
  EXPECT_NE(at, std::string::npos) << out;
  if (at == std::string::npos) return json::object();
  return json::parse(out.substr(at, out.find('\n', at) - at));
}

class HfGenerate : public ::testing::TestWithParam<const char*> {};

TEST_P(HfGenerate, GreedyTextEqualsTransformers) {
  const std::string python = test::venv_python("transformers,tokenizers");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("transformers, tokenizers"));
  const std::string family = GetParam();
  const fs::path root = test::scratch_root() / ("hf_generate_" + family);
  fs::remove_all(root);
  fs::create_directories(root);
  const std::string script = std::string(SHARDLM_SOURCE_DIR) + "/tests/integration/hf_reference.py";
  const fs::path src = root / "src", ck = root / "ck";
  // The model, its tokenizer and transformers' continuation in one process (importing
  // transformers is most of its time).
  const json ref = printed_continuation(
      run(fmt::format("{} {} make_generate {} {} {}/tests/data/genesis_1_12.txt '{}' {}", python,
                      script, src.string(), family, SHARDLM_SOURCE_DIR, kPrompt, kNewTokens),
          root / "reference.txt"));
  ASSERT_TRUE(ref.contains("hex")) << ref.dump();
  ASSERT_GE(ref["ids"].size(), 4u) << "a continuation too short to compare: " << ref.dump();
  run(std::string(SHARDLM_BINARY) + " convert hf-import " + src.string() + " --output " +
          ck.string() + " --dtype fp32",
      root / "import.txt");

  // The bound on two f32 forwards over the longest sequence decoded (the prompt's tokens are
  // fewer than its bytes), relative to a position's largest logit: every step's choice leads
  // the runner-up by more than twice it, so two forwards within it pick the same token.
  const ModelConfig cfg = read_hf_config(src.string()).config;
  const double tol = test::reorder_tolerance(
      test::reduction_chain(cfg, int64_t(std::string(kPrompt).size()) + kNewTokens, 1));
  EXPECT_GT(ref["min_margin"].get<double>(), 2 * tol) << "a near tie: " << ref.dump();

  std::string text = run(fmt::format("{} generate --checkpoint {} --prompt '{}' "
                                     "--max-new-tokens {} --temperature 0",
                                     SHARDLM_BINARY, ck.string(), kPrompt, kNewTokens),
                         root / "generate.txt", /*merge_stderr=*/false);
  if (!text.empty() && text.back() == '\n') text.pop_back();
  EXPECT_EQ(hex(text), ref["hex"].get<std::string>()) << "transformers' tokens: " << ref.dump();
}

// glm: GLM-4 (GlmForCausalLM); glm4: GLM-4-0414 (Glm4ForCausalLM).
INSTANTIATE_TEST_SUITE_P(Families, HfGenerate, ::testing::Values("llama", "glm", "glm4"));

}  // namespace
}  // namespace shardlm
