// The GLM presets against the published config.json files: read_hf_config on
// THUDM/glm-4-9b-chat-hf's file (the transformers-format GLM-4 upload; no partial_rotary_factor
// in it, so GlmConfig's 0.5 applies) and on THUDM/GLM-4-9B-0414's gives glm4-9b's and
// glm4-9b-0414's model, field by field. And GLM's heads without head_dim: GlmConfig's default
// (128) whatever hidden_size / num_attention_heads is, as transformers reads such a file.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "shardlm/hf/hf.h"
#include "shardlm/model/config.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// The model config.json `j` describes, read from a directory of its own.
ModelConfig read_config(const std::string& name, const json& j) {
  const fs::path dir = test::scratch_root() / ("hf_presets_" + name);
  fs::create_directories(dir);
  std::ofstream(dir / "config.json") << j.dump(2);
  return read_hf_config(dir.string()).config;
}

void expect_same_model(const ModelConfig& a, const ModelConfig& b) {
  EXPECT_EQ(a.dim, b.dim);
  EXPECT_EQ(a.n_layers, b.n_layers);
  EXPECT_EQ(a.n_heads, b.n_heads);
  EXPECT_EQ(a.n_kv_heads, b.n_kv_heads);
  EXPECT_EQ(a.head_dim(), b.head_dim());
  EXPECT_EQ(a.rotary_dim(), b.rotary_dim());
  EXPECT_EQ(a.ffn_dim, b.ffn_dim);
  EXPECT_EQ(a.vocab_size, b.vocab_size);
  EXPECT_DOUBLE_EQ(a.norm_eps, b.norm_eps);
  EXPECT_DOUBLE_EQ(a.rope_theta, b.rope_theta);
  EXPECT_DOUBLE_EQ(a.rope_partial_factor, b.rope_partial_factor);
  EXPECT_EQ(a.rope_interleaved, b.rope_interleaved);
  EXPECT_EQ(a.rope_scaling.type, b.rope_scaling.type);
  EXPECT_EQ(a.attn_bias, b.attn_bias);
  EXPECT_EQ(a.tie_embeddings, b.tie_embeddings);
  EXPECT_EQ(a.post_norms, b.post_norms);
  EXPECT_EQ(a.post_norm_names, b.post_norm_names);
  EXPECT_EQ(make_param_layout(a).total, make_param_layout(b).total);
}

// THUDM/glm-4-9b-chat-hf's config.json (model_type glm).
const json kGlm4Chat = {{"architectures", {"GlmForCausalLM"}},
                        {"attention_bias", true},
                        {"attention_dropout", 0.0},
                        {"eos_token_id", {151329, 151336, 151338}},
                        {"head_dim", 128},
                        {"hidden_act", "silu"},
                        {"hidden_size", 4096},
                        {"initializer_range", 0.02},
                        {"intermediate_size", 13696},
                        {"max_position_embeddings", 131072},
                        {"model_type", "glm"},
                        {"num_attention_heads", 32},
                        {"num_hidden_layers", 40},
                        {"num_key_value_heads", 2},
                        {"pad_token_id", 151329},
                        {"rms_norm_eps", 1.5625e-07},
                        {"rope_theta", 10000.0},
                        {"tie_word_embeddings", false},
                        {"torch_dtype", "bfloat16"},
                        {"use_cache", true},
                        {"vocab_size", 151552}};

TEST(HfPresets, Glm4IsGlm4ChatHfsConfig) {
  expect_same_model(read_config("glm4_chat", kGlm4Chat), model_preset("glm4-9b"));
}

TEST(HfPresets, Glm40414IsGlm49b0414sConfig) {
  // THUDM/GLM-4-9B-0414's config.json (model_type glm4): the chat model's sizes with a 32K
  // context, a norm epsilon of 1e-5 and the rotary fraction written out.
  json j = kGlm4Chat;
  j["architectures"] = {"Glm4ForCausalLM"};
  j["model_type"] = "glm4";
  j["max_position_embeddings"] = 32768;
  j["partial_rotary_factor"] = 0.5;
  j["rms_norm_eps"] = 1e-05;
  expect_same_model(read_config("glm4_0414", j), model_preset("glm4-9b-0414"));
}

TEST(HfPresets, GlmHeadsWithoutHeadDimAreGlmConfigsDefault) {
  json j = {{"architectures", {"GlmForCausalLM"}},
            {"hidden_size", 100},
            {"num_hidden_layers", 1},
            {"num_attention_heads", 3},
            {"num_key_value_heads", 1},
            {"intermediate_size", 8},
            {"vocab_size", 10}};
  const ModelConfig glm = read_config("glm_no_head_dim", j);
  EXPECT_EQ(glm.head_dim(), 128);
  EXPECT_EQ(glm.q_dim(), 384);
  EXPECT_EQ(glm.rotary_dim(), 64);
  j["architectures"] = {"Glm4ForCausalLM"};
  j["num_attention_heads"] = 4;  // 100 / 4 = 25 would be Llama's; GLM's is still 128
  EXPECT_EQ(read_config("glm4_no_head_dim", j).head_dim(), 128);
  j["architectures"] = {"LlamaForCausalLM"};
  j["num_attention_heads"] = 3;
  test::expect_config_error([&] { read_config("llama_no_head_dim", j); },
                            {"config.json", "hidden_size 100", "num_attention_heads 3"});
}

}  // namespace
}  // namespace shardlm
