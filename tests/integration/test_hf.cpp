// Hugging Face interop (hf/hf.h, checkpoint/hf_convert.h) against transformers itself: for a tiny
// random model of each family (Llama with GQA and Llama-3 rope scaling, Mistral, Qwen2 with q/k/v
// biases and tied embeddings, Qwen3 with q/k norms and a head_dim of its own) made and saved by
// transformers, shardlm's logits at every position equal transformers'; `shardlm convert hf-import`
// then `hf-export` gives back the same config.json and the same tensors, and transformers gives the
// exported directory the same logits; one training step's loss and gradients equal transformers'; a
// training run starts from the directory's weights (model.hf_dir). Config errors name the file and
// field. Needs the venv with torch and transformers (skips saying so without it).
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "integration/hf_logits.h"
#include "shardlm/backend/backend.h"
#include "shardlm/config/config.h"
#include "shardlm/core/check.h"
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

std::string reference_script() {
  return std::string(SHARDLM_SOURCE_DIR) + "/tests/integration/hf_reference.py";
}

// The logits [T][V] that hf_reference.py printed last (libraries may print warnings before).
std::vector<std::vector<float>> printed_logits(const std::string& out) {
  const size_t at = out.rfind("[[");
  EXPECT_NE(at, std::string::npos) << out;
  if (at == std::string::npos) return {};
  return json::parse(out.substr(at)).get<std::vector<std::vector<float>>>();
}

// transformers' logits [T][V] for kTokens.
std::vector<std::vector<float>> hf_logits(const std::string& python, const fs::path& model,
                                          const fs::path& scratch) {
  return printed_logits(run(python + " " + reference_script() + " logits " + model.string() + " '" +
                                json(kTokens).dump() + "'",
                            scratch / "logits.txt"));
}

// shardlm's logits [T][V] for kTokens: the model built from the directory.
std::vector<std::vector<float>> shardlm_logits(const fs::path& dir) {
  const HfModelInfo info = read_hf_config(dir.string());
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  ModelOptions opt;
  opt.max_seq = int64_t(kTokens.size());
  LlamaModel model(info.config, opt, *be, ledger);
  const SafetensorsDir st(dir.string());
  const ParamLayout& L = model.layout();
  for (int u = 0; u < int(L.units.size()); ++u)
    read_hf_unit(st, L, u, model.params().f32() + L.units[u].begin);
  return test::prefix_logits(model, kTokens);
}

using test::expect_logits_near;

class HfFamily : public ::testing::TestWithParam<const char*> {};

TEST_P(HfFamily, LogitsMatchTransformersAndTheRoundTripIsExact) {
  const std::string python = test::venv_python("transformers");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("transformers"));
  const std::string family = GetParam();
  const fs::path root = test::scratch_root() / ("hf_" + family);
  fs::remove_all(root);
  fs::create_directories(root);
  const fs::path src = root / "src";
  // Made and its logits printed by one process.
  const std::vector<std::vector<float>> ref =
      printed_logits(run(python + " " + reference_script() + " make " + src.string() + " " +
                             family + " '" + json(kTokens).dump() + "'",
                         root / "make.txt"));
  ASSERT_EQ(ref.size(), kTokens.size());
  const ModelConfig cfg = read_hf_config(src.string()).config;
  expect_logits_near(shardlm_logits(src), ref, cfg, family + ": shardlm vs transformers");

  // import -> export: the same config.json and tensors, and transformers' logits again.
  const fs::path ck = root / "ck", out = root / "out";
  run(std::string(SHARDLM_BINARY) + " convert hf-import " + src.string() + " --output " +
          ck.string() + " --dtype fp32",
      root / "import.txt");
  run(std::string(SHARDLM_BINARY) + " convert hf-export " + ck.string() + " --output " +
          out.string(),
      root / "export.txt");
  EXPECT_EQ(json::parse(test::slurp(src / "config.json")),
            json::parse(test::slurp(out / "config.json")));
  const SafetensorsDir a(src.string()), b(out.string());
  EXPECT_EQ(a.names(), b.names());
  for (const std::string& n : a.names()) {
    const StTensorInfo& ta = a.file_of(n).info(n);
    const StTensorInfo& tb = b.file_of(n).info(n);
    ASSERT_EQ(ta.shape, tb.shape) << n;
    ASSERT_EQ(ta.dtype, tb.dtype) << n;
    EXPECT_EQ(std::memcmp(a.file_of(n).data(n), b.file_of(n).data(n), ta.end - ta.begin), 0) << n;
  }
  expect_logits_near(hf_logits(python, out, root), ref, cfg,
                     family + ": exported, in transformers");
}

// mistral_swa and qwen2_swa: sliding windows (4 on every layer; 3 on layer 1 only, Qwen2's
// max_window_layers) shorter than the tokens, as real masks.
INSTANTIATE_TEST_SUITE_P(Families, HfFamily,
                         ::testing::Values("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3",
                                           "glm", "glm4", "mistral_swa", "qwen2_swa"));

// GLM's fused gate_up_proj [2F, D] for a layout's gate or up projection, else "".
std::string fused_name(const std::string& name) {
  for (const std::string tail : {"mlp.gate_proj.weight", "mlp.up_proj.weight"})
    if (name.size() > tail.size() &&
        name.compare(name.size() - tail.size(), tail.size(), tail) == 0)
      return name.substr(0, name.size() - tail.size()) + "mlp.gate_up_proj.weight";
  return "";
}

// How many of the layout's gate/up pairs the reference holds fused.
size_t fused_gate_ups(const SafetensorsFile& ref, const ParamLayout& L) {
  size_t n = 0;
  for (const ParamEntry& e : L.entries)
    n += e.name.find("mlp.gate_proj.weight") != std::string::npos && !ref.contains(e.name) &&
         ref.contains(fused_name(e.name));
  return n;
}

// Entry e's reference gradient with e's shape: the tensor of its name, or its rows of GLM's
// fused gate_up_proj (gate first).
std::vector<float> reference_gradient(const SafetensorsFile& ref, const ParamEntry& e) {
  std::vector<int64_t> shape;
  for (int d = 0; d < e.shape.rank(); ++d) shape.push_back(e.shape[d]);
  const size_t n = size_t(e.shape.numel());
  if (!ref.contains(e.name) && !fused_name(e.name).empty() && ref.contains(fused_name(e.name))) {
    const std::string f = fused_name(e.name);
    EXPECT_EQ(ref.info(f).shape, (std::vector<int64_t>{2 * shape[0], shape[1]})) << f;
    std::vector<float> both(2 * n);
    ref.read_f32(f, both.data());
    const size_t at = e.name.find("up_proj") != std::string::npos ? n : 0;
    return {both.begin() + long(at), both.begin() + long(at + n)};
  }
  EXPECT_TRUE(ref.contains(e.name)) << e.name << " has no gradient in transformers";
  if (!ref.contains(e.name)) return std::vector<float>(n, 0.f);
  EXPECT_EQ(ref.info(e.name).shape, shape) << e.name;
  std::vector<float> want(size_t(ref.info(e.name).numel()));
  ref.read_f32(e.name, want.data());
  if (want.size() != n) want.assign(n, 0.f);
  return want;
}

// One training step's gradients against transformers: for a random model of each family
// (GQA; Llama and Mistral untied, Qwen2 tied with q/k/v biases, Qwen3 untied with q/k norms
// and heads wider than hidden_size / num_attention_heads) written by transformers and
// read by shardlm, two rows of 12 tokens (row 0 two packed documents of 7 and 5, row 1 one
// document; the last token of each document and one more per row ignored), the mean
// next-token cross-entropy and the gradient of every parameter equal transformers' loss and
// `loss.backward()` over the three documents run as separate sequences (with sliding windows of
// 4 and 3 tokens, shorter than every document, for mistral_swa and qwen2_swa; Gemma 2's local
// layer of 4 tokens with its attention scores and final logits soft-capped). Per tensor the
// largest difference is at most 1e-4 of the reference's largest value (f32 reassociation
// gives about 1e-6; a weight moved by 1e-3 or a document boundary dropped break it).
TEST(Hf, OneStepsGradientsMatchTransformers) {
  const std::string python = test::venv_python("transformers");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("transformers"));
  const fs::path root = test::scratch_root() / "hf_grads";
  fs::remove_all(root);
  fs::create_directories(root);
  constexpr int64_t B = 2, T = 12;
  const std::vector<int32_t> tokens = {5,  77, 123, 9,  250, 31,  299, 0,  42, 42,  17, 180,
                                       64, 3,  3,   18, 211, 140, 7,   96, 2,  255, 30, 111};
  // Documents as [row, first, end) and the extra ignored target per row.
  const std::vector<std::array<int64_t, 3>> docs = {{0, 0, 7}, {0, 7, 12}, {1, 0, 12}};
  const int64_t ignored[B] = {3, 5};
  std::vector<int32_t> targets(B * T), positions(B * T), seg_start(B * T);
  json docs_json = json::array();
  for (const auto& [row, first, end] : docs) {
    json d = {{"tokens", json::array()}, {"targets", json::array()}};
    for (int64_t t = first; t < end; ++t) {
      const int64_t i = row * T + t;
      targets[i] = t + 1 < end && t != ignored[row] ? tokens[i + 1] : kIgnoreIndex;
      positions[i] = int32_t(t - first);
      seg_start[i] = int32_t(first);
      d["tokens"].push_back(tokens[i]);
      d["targets"].push_back(targets[i]);
    }
    docs_json.push_back(d);
  }
  run(python + " " + reference_script() + " grads " + root.string() + " '" + docs_json.dump() + "'",
      root / "grads.txt");

  for (const std::string family : {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "glm",
                                   "glm4", "mistral_swa", "qwen2_swa"}) {
    SCOPED_TRACE(family);
    const fs::path dir = root / family;
    const HfModelInfo info = read_hf_config(dir.string());
    const std::unique_ptr<Backend> be = make_backend(DeviceKind::kCpu);
    MemoryLedger ledger;
    ModelOptions opt;
    opt.max_batch = B;
    opt.max_seq = T;
    LlamaModel model(info.config, opt, *be, ledger);
    const SafetensorsDir st(dir.string());
    const ParamLayout& L = model.layout();
    for (int u = 0; u < int(L.units.size()); ++u)
      read_hf_unit(st, L, u, model.params().f32() + L.units[u].begin);
    BatchInputs in = model.inputs(B, T);
    std::copy(tokens.begin(), tokens.end(), in.tokens.i32());
    std::copy(targets.begin(), targets.end(), in.targets.i32());
    std::copy(positions.begin(), positions.end(), in.positions.i32());
    std::copy(seg_start.begin(), seg_start.end(), in.seg_start.i32());
    int64_t n_valid = 0;
    for (int32_t t : targets) n_valid += t != kIgnoreIndex;
    model.zero_grads();
    const LossResult loss = model.forward_backward(B, T, 1.0f / float(n_valid));
    ASSERT_EQ(loss.n_valid, n_valid);

    const SafetensorsFile ref((dir / "grads.safetensors").string());
    const double ref_loss = std::stod(ref.metadata().at("loss"));
    const double got_loss = loss.loss_sum / double(loss.n_valid);
    // transformers' kernels and shardlm's sum in other orders (tests/tolerance.h).
    const double tol = test::reorder_tolerance(test::reduction_chain(info.config, T, B));
    EXPECT_NEAR(got_loss, ref_loss, tol * ref_loss) << "mean loss";
    // Every parameter of the layout has its reference gradient (the head's is in the tied
    // embedding's; GLM's gate and up are the halves of gate_up_proj's), and no other.
    EXPECT_EQ(ref.tensors().size(), L.entries.size() - fused_gate_ups(ref, L));
    double worst = 0;
    for (const ParamEntry& e : L.entries) {
      const std::vector<float> want = reference_gradient(ref, e);
      const float* got = model.grads().f32() + e.offset;
      double scale = 0, diff = 0;
      for (size_t i = 0; i < want.size(); ++i) {
        scale = std::max(scale, std::abs(double(want[i])));
        diff = std::max(diff, std::abs(double(got[i]) - double(want[i])));
      }
      EXPECT_GT(scale, 0.0) << e.name << ": the reference gradient is zero";
      EXPECT_LE(diff, tol * scale) << e.name << ": gradient differs by " << diff
                                   << " (largest reference value " << scale << ")";
      worst = std::max(worst, diff / scale);
    }
    std::printf("%s: loss %.8f vs %.8f, worst gradient difference %.3g of the tensor's max\n",
                family.c_str(), got_loss, ref_loss, worst);
  }
}

// bf16 export, sharded: transformers loads the shards through the index, and the logits are
// those of the bf16-rounded weights (close to the f32 ones).
TEST(Hf, Bf16ShardedExportLoadsInTransformers) {
  const std::string python = test::venv_python("transformers");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("transformers"));
  const fs::path root = test::scratch_root() / "hf_bf16";
  fs::remove_all(root);
  fs::create_directories(root);
  const fs::path src = root / "src", ck = root / "ck", out = root / "out";
  // Made and its logits printed by one process.
  const auto ref = printed_logits(run(python + " " + reference_script() + " make " + src.string() +
                                          " llama '" + json(kTokens).dump() + "'",
                                      root / "make.txt"));
  run(std::string(SHARDLM_BINARY) + " convert hf-import " + src.string() + " --output " +
          ck.string() + " --dtype bf16",
      root / "import.txt");
  run(std::string(SHARDLM_BINARY) + " convert hf-export " + ck.string() + " --output " +
          out.string() + " --max-shard-size 0.00002",
      root / "export.txt");
  EXPECT_TRUE(fs::exists(out / "model.safetensors.index.json"));
  EXPECT_TRUE(fs::exists(out / "model-00001-of-00005.safetensors") ||
              !fs::exists(out / "model.safetensors"));
  EXPECT_EQ(json::parse(test::slurp(out / "config.json"))["dtype"], "bfloat16");
  const auto got = hf_logits(python, out, root);
  ASSERT_EQ(got.size(), ref.size());
  double worst = 0;
  for (size_t t = 0; t < ref.size(); ++t)
    for (size_t v = 0; v < ref[t].size(); ++v)
      worst = std::max(worst, double(std::abs(got[t][v] - ref[t][v])));
  EXPECT_LT(worst, 0.05) << "bf16 weights moved the logits by " << worst;
}

// A training run from model.hf_dir starts from the directory's weights: with a learning rate
// of 1e-30 (no f32 weight of this model moves) the checkpoint it writes exports back (as the
// model's own architecture, by default) to exactly the directory's tensors, and
// `shardlm generate` samples from it. Qwen2, Qwen3, Gemma 2 (soft caps in the loss and in
// generate's logits) and Gemma 3.
class HfTraining : public ::testing::TestWithParam<const char*> {};

TEST_P(HfTraining, StartsFromTheDirectorysWeights) {
  const std::string python = test::venv_python("transformers");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("transformers"));
  const std::string family = GetParam();
  const fs::path root = test::scratch_root() / ("hf_train_" + family);
  fs::remove_all(root);
  fs::create_directories(root);
  const fs::path src = root / "src", out = root / "out", run_dir = root / "run";
  run(python + " " + reference_script() + " make " + src.string() + " " + family,
      root / "make.txt");
  std::ofstream(root / "train.json")
      << json{{"data",
               {{"train", std::string(SHARDLM_SOURCE_DIR) + "/tests/data/genesis_1_12.txt"},
                {"seq_len", 32}}},
              {"model", {{"hf_dir", src.string()}}},
              {"train",
               {{"micro_batch", 2},
                {"max_steps", 1},
                {"lr", 1e-30},
                {"min_lr", 1e-30},
                {"warmup_steps", 0},
                {"eval_every", 0},
                {"eval_batches", 1}}},
              {"sample", {{"count", 0}}},
              {"log", {{"dir", run_dir.string()}}}};
  run(std::string(SHARDLM_BINARY) + " train --config " + (root / "train.json").string(),
      root / "train.txt");
  run(std::string(SHARDLM_BINARY) + " convert hf-export " + (run_dir / "checkpoints").string() +
          " --output " + out.string(),
      root / "export.txt");
  EXPECT_EQ(json::parse(test::slurp(out / "config.json"))["architectures"],
            json::parse(test::slurp(src / "config.json"))["architectures"]);
  const SafetensorsDir a(src.string()), b(out.string());
  ASSERT_EQ(a.names(), b.names());
  for (const std::string& n : a.names())
    EXPECT_EQ(std::memcmp(a.file_of(n).data(n), b.file_of(n).data(n),
                          a.file_of(n).info(n).end - a.file_of(n).info(n).begin),
              0)
        << n;
  const std::string gen = run(std::string(SHARDLM_BINARY) + " generate --checkpoint " +
                                  (run_dir / "checkpoints").string() +
                                  " --prompt In --max-new-tokens 4 --temperature 0",
                              root / "generate.txt");
  EXPECT_NE(gen.find("In"), std::string::npos) << gen;
}

INSTANTIATE_TEST_SUITE_P(Families, HfTraining,
                         ::testing::Values("qwen2", "qwen3", "gemma2", "gemma3"));

// Config errors name the file and the field; model.* keys beside model.hf_dir must agree with
// its config.json, and a sliding window bounds data.seq_len.
TEST(Hf, ConfigErrorsNameTheFileAndField) {
  const fs::path root = test::scratch_root() / "hf_errors";
  fs::remove_all(root);
  fs::create_directories(root);
  auto write_cfg = [&](const json& j) { std::ofstream(root / "config.json") << j.dump(); };
  const json base = {{"architectures", {"LlamaForCausalLM"}},
                     {"hidden_size", 64},
                     {"num_hidden_layers", 2},
                     {"num_attention_heads", 4},
                     {"num_key_value_heads", 2},
                     {"intermediate_size", 160},
                     {"vocab_size", 300}};
  write_cfg(base);
  EXPECT_EQ(read_hf_config(root.string()).config.dim, 64);
  {  // weights that do not match config.json: the directory and the tensor are named
    SafetensorsWriter w((root / "model.safetensors").string(), {{"other", StDType::kF32, {1}}});
    const float x = 0;
    w.write("other", &x, 4);
    w.commit();
    const SafetensorsDir st(root.string());
    const ParamLayout L = make_param_layout(read_hf_config(root.string()).config);
    std::vector<float> out(size_t(L.max_unit));
    try {
      read_hf_unit(st, L, 0, out.data());
      ADD_FAILURE() << "no error";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kData);
      EXPECT_NE(std::string(e.what()).find(root.string()), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("'model.embed_tokens.weight'"), std::string::npos)
          << e.what();
    }
  }
  auto expect = [&](json j, const std::vector<std::string>& parts) {
    write_cfg(j);
    test::expect_config_error([&] { read_hf_config(root.string()); }, parts);
  };
  json j = base;
  j["architectures"] = {"GPT2LMHeadModel"};
  expect(j, {"config.json", "GPT2LMHeadModel", "not supported"});
  j = base;
  j.erase("hidden_size");
  expect(j, {"config.json", "'hidden_size' is missing"});
  j = base;
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  expect(j, {"rope_scaling", "yarn"});
  j = base;
  j["hidden_act"] = "gelu";
  expect(j, {"hidden_act", "gelu"});
  j = base;
  j["head_dim"] = 32;  // wider heads than 64 / 4: q and o are [128, 64] and [64, 128]
  write_cfg(j);
  EXPECT_EQ(read_hf_config(root.string()).config.q_dim(), 128);
  j["head_dim"] = 15;
  expect(j, {"head_dim", "= 15", "even"});
  j = base;
  j["attention_bias"] = true;
  expect(j, {"attention_bias"});
  j["architectures"] = {"Qwen3ForCausalLM"};  // Qwen3's bias is on o_proj too
  expect(j, {"attention_bias"});
  // Gemma 3: soft-capping (Gemma 2's) and layer types without one period are refused.
  j = base;
  j["architectures"] = {"Gemma3ForCausalLM"};
  j["head_dim"] = 16;
  j["final_logit_softcapping"] = 30.0;
  expect(j, {"final_logit_softcapping", "30"});
  j.erase("final_logit_softcapping");
  j["hidden_activation"] = "gelu";
  expect(j, {"hidden_activation", "gelu_pytorch_tanh"});
  j.erase("hidden_activation");
  j["layer_types"] = {"full_attention", "sliding_attention"};
  expect(j, {"layer_types", "repeating pattern"});
  j["layer_types"] = {"sliding_attention", "full_attention"};
  write_cfg(j);
  EXPECT_EQ(read_hf_config(root.string()).config.global_layer_every, 2);
  // Gemma 2: the caps' defaults (50, 30) when absent, none when null, a bad one refused; the
  // default layer pattern alternates from a local layer 0; no rope scaling.
  j = base;
  j["architectures"] = {"Gemma2ForCausalLM"};
  j["head_dim"] = 16;
  write_cfg(j);
  {
    const ModelConfig g2 = read_hf_config(root.string()).config;
    EXPECT_DOUBLE_EQ(g2.attn_softcap, 50);
    EXPECT_DOUBLE_EQ(g2.final_softcap, 30);
    EXPECT_EQ(g2.window_of_layer(0), 4096);
    EXPECT_EQ(g2.window_of_layer(1), 0);
    EXPECT_FALSE(g2.qk_norm);
  }
  j["attn_logit_softcapping"] = nullptr;
  j["final_logit_softcapping"] = nullptr;
  write_cfg(j);
  EXPECT_EQ(read_hf_config(root.string()).config.attn_softcap, 0);
  EXPECT_EQ(read_hf_config(root.string()).config.final_softcap, 0);
  j["final_logit_softcapping"] = -3;
  expect(j, {"final_logit_softcapping", "positive number or null"});
  j.erase("final_logit_softcapping");
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  expect(j, {"rope scaling 'llama3'", "Gemma2ForCausalLM"});

  write_cfg(base);
  const std::string hf = "\"" + root.string() + "\"";
  const std::string run_cfg =
      R"({"data": {"train": "x.txt", "seq_len": 64}, "train": {"max_steps": 1}, "model": {"hf_dir": )" +
      hf;
  EXPECT_EQ(parse_run_config(run_cfg + "}}", {}, ".").model.dim, 64);
  test::expect_config_error([&] { parse_run_config(run_cfg + R"(, "dim": 128}})", {}, "."); },
                            {"model.dim = 128", "config.json says 64"});
  // A sliding window shorter than data.seq_len is a mask, not a bound; Qwen's windows start at
  // max_window_layers; layer_types must list every layer.
  j = base;
  j["architectures"] = {"MistralForCausalLM"};
  j["sliding_window"] = 32;
  write_cfg(j);
  const ModelConfig mistral = parse_run_config(run_cfg + "}}", {}, ".").model;
  EXPECT_EQ(mistral.sliding_window, 32);
  EXPECT_TRUE(mistral.layer_windows.empty());
  EXPECT_EQ(mistral.window_of_layer(1), 32);
  j = base;
  j["architectures"] = {"Qwen2ForCausalLM"};
  j["use_sliding_window"] = true;
  j["sliding_window"] = 16;
  j["max_window_layers"] = 1;
  write_cfg(j);
  const ModelConfig qwen = parse_run_config(run_cfg + "}}", {}, ".").model;
  ASSERT_EQ(qwen.layer_windows.size(), size_t(qwen.n_layers));
  EXPECT_EQ(qwen.window_of_layer(0), 0);
  EXPECT_EQ(qwen.window_of_layer(1), 16);
  j["layer_types"] = {"sliding_attention"};
  write_cfg(j);
  test::expect_config_error([&] { parse_run_config(run_cfg + "}}", {}, "."); },
                            {"layer_types lists 1 layers", "num_hidden_layers"});
  // Llama writes no window and Mistral one for every layer: a model they cannot express is a
  // config error, not a silently different model; without a choice, a windowed Llama-shaped
  // model is written as Mistral.
  ModelConfig windowed = mistral;
  EXPECT_EQ(default_hf_architecture(windowed), "MistralForCausalLM");
  test::expect_config_error(
      [&] { hf_config_json(windowed, "LlamaForCausalLM", DType::kF32, json::object()); },
      {"LlamaForCausalLM has no sliding window", "MistralForCausalLM"});
  windowed.layer_windows = {0, 32};
  test::expect_config_error(
      [&] { hf_config_json(windowed, "MistralForCausalLM", DType::kF32, json::object()); },
      {"MistralForCausalLM has one sliding window on every layer"});
  // Qwen without layer_types can window only the last layers (max_window_layers).
  ModelConfig qwen_first = qwen;
  qwen_first.layer_windows = {16, 0};
  test::expect_config_error(
      [&] { hf_config_json(qwen_first, "Qwen2ForCausalLM", DType::kF32, json::object()); },
      {"max_window_layers", "layer 0", "layer_types"});
}

// An export never drops a setting the model trained with: Gemma's settings on another
// architecture, a Gemma window pattern its config.json cannot say, and windows that differ
// between layers are config errors; linear rope scaling is written.
TEST(HfConfigWrite, RefusesWhatTheArchitectureCannotSay) {
  ModelConfig llama = model_preset("tiny");
  llama.mlp_activation = "gelu_tanh";
  test::expect_config_error(
      [&] { hf_config_json(llama, "LlamaForCausalLM", DType::kF32, json::object()); },
      {"LlamaForCausalLM cannot express model.mlp_activation", "Gemma3ForCausalLM"});
  llama.mlp_activation = "silu";
  llama.rope_scaling.type = "linear";
  llama.rope_scaling.factor = 4;
  const json j = hf_config_json(llama, "LlamaForCausalLM", DType::kF32, json::object());
  EXPECT_EQ(j["rope_scaling"]["rope_type"], "linear");
  EXPECT_EQ(j["rope_scaling"]["factor"], 4.0);

  ModelConfig gemma = model_preset("gemma3-1b");
  EXPECT_EQ(
      hf_config_json(gemma, "Gemma3ForCausalLM", DType::kBF16, json::object())["layer_types"][5],
      "full_attention");
  gemma.sliding_window = 0;
  test::expect_config_error(
      [&] { hf_config_json(gemma, "Gemma3ForCausalLM", DType::kBF16, json::object()); },
      {"model.sliding_window = 0", "model.global_layer_every"});
  // Gemma 2: its soft caps written (null where off), and no other architecture takes them.
  ModelConfig gemma2 = model_preset("gemma2-2b");
  EXPECT_EQ(default_hf_architecture(gemma2), "Gemma2ForCausalLM");
  gemma2.final_softcap = 0;
  const json g2 = hf_config_json(gemma2, "Gemma2ForCausalLM", DType::kBF16, json::object());
  EXPECT_EQ(g2["attn_logit_softcapping"], 50.0);
  EXPECT_TRUE(g2["final_logit_softcapping"].is_null());
  EXPECT_EQ(g2["layer_types"][0], "sliding_attention");
  EXPECT_EQ(g2["layer_types"][1], "full_attention");
  EXPECT_EQ(g2["query_pre_attn_scalar"], 256);
  test::expect_config_error(
      [&] { hf_config_json(gemma2, "Gemma3ForCausalLM", DType::kBF16, json::object()); },
      {"q/k norms"});
  gemma2.qk_norm = true;  // now Gemma 3's layers, with Gemma 2's cap
  test::expect_config_error(
      [&] { hf_config_json(gemma2, "Gemma3ForCausalLM", DType::kBF16, json::object()); },
      {"Gemma3ForCausalLM cannot express model.attn_softcap", "Gemma2ForCausalLM"});
  test::expect_config_error(
      [&] { hf_config_json(gemma2, "Gemma2ForCausalLM", DType::kBF16, json::object()); },
      {"Gemma2ForCausalLM", "q/k norms"});
  ModelConfig capped = model_preset("tiny");
  capped.final_softcap = 30;
  test::expect_config_error(
      [&] { hf_config_json(capped, "LlamaForCausalLM", DType::kF32, json::object()); },
      {"LlamaForCausalLM cannot express model.final_softcap", "Gemma2ForCausalLM"});
  ModelConfig mixed = model_preset("tiny");
  mixed.sliding_window = 8;
  mixed.layer_windows.assign(size_t(mixed.n_layers), 8);
  mixed.layer_windows[0] = 4;
  mixed.attn_bias = true;  // Qwen2's
  test::expect_config_error(
      [&] { hf_config_json(mixed, "Qwen2ForCausalLM", DType::kF32, json::object()); },
      {"one sliding window per model", "layer 0 has 4"});
}

}  // namespace
}  // namespace shardlm
