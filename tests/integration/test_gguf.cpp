// `shardlm convert gguf-export` (checkpoint/gguf_export.h) against llama.cpp's own Python
// package and transformers' GGUF loader: for a tiny random model of each family that
// transformers loads from GGUF (Llama with GQA and an untied head, Qwen2 with q/k/v biases and
// tied embeddings, Qwen3 with q/k norms, Gemma 2 and Gemma 3 with their post-norms and windows),
// each with a byte-level BPE tokenizer (and Gemma 3 also with a SentencePiece one), imported with
// hf-import and exported as f16, bf16 and q8_0, gguf's GGUFReader finds every metadata key and
// tensor llama.cpp's converter writes for the same directory, with the same values and bytes;
// transformers loads the f16 file (model and tokenizer) as the directory's model (the same
// logits), its tokenizer encodes the prompt as the directory's does, and its greedy
// continuation is shardlm's `generate`, byte for byte. A LoRA checkpoint exports merged: its
// file is the hf-export --merge directory's model, and transformers continues as shardlm's
// generate on the LoRA checkpoint. The byte tokenizer is refused. Needs the venv with torch,
// transformers, sentencepiece and gguf (skips saying so without them).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr const char* kPrompt = "And God said";
constexpr int kNewTokens = 16;

std::string run(const std::string& cmd, const fs::path& out, bool merge_stderr = true) {
  return test::run_command(cmd, out, merge_stderr);
}

std::string shardlm(const std::string& args) { return std::string(SHARDLM_BINARY) + " " + args; }

std::string script() {
  return std::string(SHARDLM_SOURCE_DIR) + "/tests/integration/gguf_reference.py";
}

std::string corpus() { return std::string(SHARDLM_SOURCE_DIR) + "/tests/data/genesis_1_12.txt"; }

std::string hex(const std::string& bytes) {
  std::string h;
  for (unsigned char c : bytes) h += fmt::format("{:02x}", c);
  return h;
}

// shardlm's greedy continuation of kPrompt, as the bytes it prints (the prompt, then each
// token), in hex.
std::string shardlm_greedy_hex(const fs::path& checkpoint, const fs::path& out) {
  std::string text = run(shardlm(fmt::format("generate --checkpoint {} --prompt '{}' "
                                             "--max-new-tokens {} --temperature 0",
                                             checkpoint.string(), kPrompt, kNewTokens)),
                         out, /*merge_stderr=*/false);
  if (!text.empty() && text.back() == '\n') text.pop_back();
  return hex(text);
}

// One model to check: `reference` is a Hugging Face directory of the model in `checkpoint`.
struct Case {
  std::string name;
  fs::path reference, checkpoint;
  double tolerance;        // of transformers' logits from the file, relative to their largest
  std::string greedy_hex;  // shardlm's
};

// The file types the first test reads back; llama.cpp runs the f16 file alone.
const std::vector<std::string> kAllTypes = {"f16", "bf16", "q8_0"};

// The checkpoint exported in each of `types` (root/NAME.TYPE.gguf), and shardlm's greedy text.
void export_case(const fs::path& root, Case& c, const std::vector<std::string>& types) {
  for (const std::string& type : types) {
    const fs::path file = root / fmt::format("{}.{}.gguf", c.name, type);
    run(shardlm(fmt::format("convert gguf-export {} --output {} --type {}", c.checkpoint.string(),
                            file.string(), type)),
        root / fmt::format("{}.export.{}.txt", c.name, type));
    EXPECT_TRUE(fs::exists(file)) << file;
    EXPECT_FALSE(fs::exists(file.string() + ".tmp"));
  }
  c.greedy_hex = shardlm_greedy_hex(c.checkpoint, root / (c.name + ".generate.txt"));
}

// A LoRA fine-tune (3 steps, every projection) of the directory `base`; its checkpoints.
fs::path train_lora(const fs::path& root, const fs::path& base) {
  const fs::path run_dir = root / "lora_run";
  std::ofstream(root / "lora.json")
      << json{{"data", {{"train", corpus()}, {"seq_len", 32}}},
              {"model", {{"hf_dir", base.string()}}},
              {"train",
               {{"micro_batch", 2},
                {"max_steps", 3},
                {"lr", 5e-2},
                {"warmup_steps", 0},
                {"eval_every", 0},
                {"eval_batches", 1}}},
              {"lora", {{"rank", 4}, {"alpha", 8}, {"targets", "all"}}},
              {"sample", {{"count", 0}}},
              {"log", {{"dir", run_dir.string()}}}};
  run(shardlm("train --config " + (root / "lora.json").string()), root / "lora_train.txt");
  return run_dir / "checkpoints";
}

// A model with shardlm's byte tokenizer (the directory without its tokenizer) is refused
// before anything is written, saying why.
void expect_byte_tokenizer_refused(const fs::path& root, const fs::path& src) {
  const fs::path dir = root / "byte", ck = root / "byte_ck", file = root / "byte.gguf";
  fs::create_directories(dir);
  for (const char* f : {"config.json", "model.safetensors"}) fs::copy(src / f, dir / f);
  run(shardlm("convert hf-import " + dir.string() + " --output " + ck.string()),
      root / "byte_import.txt");
  const fs::path out = root / "byte_export.txt";
  const std::string cmd =
      shardlm("convert gguf-export " + ck.string() + " --output " + file.string()) + " > " +
      out.string() + " 2>&1";
  EXPECT_NE(std::system(cmd.c_str()), 0);
  EXPECT_NE(test::slurp(out).find("byte tokenizer"), std::string::npos) << test::slurp(out);
  EXPECT_FALSE(fs::exists(file));
  EXPECT_FALSE(fs::exists(file.string() + ".tmp"));
}

// The cases' lines of a reference's output ({"dir", "hex", ...}; libraries may print other
// lines), each checked to be its case's and to continue the prompt as shardlm does.
void expect_greedy_as_shardlm(const std::string& out, const std::vector<Case>& cases,
                              const char* who) {
  std::istringstream lines(out);
  size_t seen = 0;
  for (std::string line; std::getline(lines, line);) {
    const json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("hex")) continue;
    ASSERT_LT(seen, cases.size());
    const Case& c = cases[seen++];
    SCOPED_TRACE(c.name);
    EXPECT_EQ(j.value("dir", ""), c.reference.string());
    EXPECT_EQ(c.greedy_hex, j.value("hex", "")) << who << "'s tokens: " << j.dump();
  }
  EXPECT_EQ(seen, cases.size()) << out;
}

// The reference's `files` check of each case's three files (it fails naming what differs from
// the converter's keys and tensors), a line per case.
void expect_files_as_converter(const std::string& python, const fs::path& root,
                               const std::vector<Case>& cases) {
  std::string args;
  for (const Case& c : cases)
    args += fmt::format(" {}:{}", c.reference.string(), (root / c.name).string());
  std::istringstream lines(
      run(fmt::format("{} {} files{}", python, script(), args), root / "files.txt"));
  size_t seen = 0;
  for (std::string line; std::getline(lines, line);) {
    const json j = json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("dir")) continue;
    ASSERT_LT(seen, cases.size());
    EXPECT_EQ(j["dir"], cases[seen++].reference.string());
    for (const char* type : {"f16", "bf16", "q8_0"})
      EXPECT_GT(j[type].value("tensors", 0), 0) << j.dump();
  }
  EXPECT_EQ(seen, cases.size());
}

// gemma3_sp: Gemma 3 with a SentencePiece tokenizer.model (Gemma's own kind of tokenizer).
const std::vector<std::string> kFamilies = {"llama",  "qwen2",  "qwen3",
                                            "gemma2", "gemma3", "gemma3_sp"};
// GlmForCausalLM (llama.cpp's chatglm) and Glm4ForCausalLM (glm4), which transformers' GGUF
// loader does not read: their files are checked against the converter's keys and tensors, and
// llama.cpp runs them.
const std::vector<std::string> kGlmFamilies = {"glm", "glm4"};

// Each family's model made by the reference under root/FAMILY, imported (fp32), exported in
// `types` and continued by shardlm's generate.
std::vector<Case> prepare_families(const std::string& python, const fs::path& root,
                                   const std::vector<std::string>& families,
                                   const std::vector<std::string>& types) {
  std::string names;
  for (const std::string& f : families) names += " " + f;
  run(fmt::format("{} {} make {} {}{}", python, script(), root.string(), corpus(), names),
      root / "make.txt");
  std::vector<Case> cases;
  for (const std::string& f : families) {
    cases.push_back({f, root / f, root / (f + "_ck"), 1e-4, ""});
    run(shardlm("convert hf-import " + (root / f).string() + " --output " +
                cases.back().checkpoint.string() + " --dtype fp32"),
        root / (f + ".import.txt"));
    export_case(root, cases.back(), types);
  }
  return cases;
}

std::string case_args(const fs::path& root, const std::vector<Case>& cases, double tolerance) {
  std::string args;
  for (const Case& c : cases)
    args += fmt::format(" {}:{}:{}", c.reference.string(), (root / c.name).string(),
                        tolerance > 0 ? tolerance : c.tolerance);
  return args;
}

// Every family, and a LoRA fine-tune of the Llama exported merged: the files read back as
// llama.cpp's converter writes the reference directory (a LoRA checkpoint's is hf-export
// --merge's, whose f16 rounding leaves transformers' logits within 1e-2 of the directory's
// rather than equal), and transformers' greedy text from the f16 file is shardlm's generate
// on the checkpoint. One test: the Python reference loads torch and transformers once.
TEST(Gguf, FilesReadBackAsLlamaCppWritesAndGenerateAsShardlm) {
  const std::string python =
      test::venv_python("transformers,gguf,tokenizers,safetensors,sentencepiece");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("gguf"));
  const fs::path root = test::scratch_root() / "gguf";
  fs::remove_all(root);
  fs::create_directories(root);
  std::vector<std::string> families = kFamilies;
  families.insert(families.end(), kGlmFamilies.begin(), kGlmFamilies.end());
  std::vector<Case> cases = prepare_families(python, root, families, kAllTypes);
  expect_files_as_converter(python, root, {cases.begin() + long(kFamilies.size()), cases.end()});
  cases.resize(kFamilies.size());
  const fs::path lora_ck = train_lora(root, root / "llama");
  run(shardlm("convert hf-export " + lora_ck.string() + " --output " + (root / "merged").string() +
              " --merge --dtype fp32"),
      root / "merge.txt");
  cases.push_back({"lora", root / "merged", lora_ck, 1e-2, ""});
  export_case(root, cases.back(), kAllTypes);
  const std::string out = run(fmt::format("{} {} verify '{}' {}{}", python, script(), kPrompt,
                                          kNewTokens, case_args(root, cases, 0)),
                              root / "verify.txt");
  expect_greedy_as_shardlm(out, cases, "transformers");
  expect_byte_tokenizer_refused(root, root / "qwen2");
}

// llama.cpp itself (llama-cpp-python, when the venv has it) runs each family's f16 file (GLM's
// too, as chatglm and glm4), and a Llama with Llama 3's rope scaling (active past the 16th
// position): its
// tokenizer encodes the prompt as the model's own does; over the prompt and shardlm's greedy
// continuation its logits are the model's within 2e-2 of their largest (it rounds activations
// to f16 against f16 weights) and each continued token is its likeliest up to that margin (a
// near tie may flip in f16, as it does at one step of the Llama's); and its detokenizer gives
// shardlm's text byte for byte.
TEST(Gguf, LlamaCppRunsTheFilesAsShardlm) {
  const std::string python =
      test::venv_python("llama_cpp,transformers,gguf,tokenizers,safetensors,sentencepiece");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("llama_cpp"));
  const fs::path root = test::scratch_root() / "gguf_llamacpp";
  fs::remove_all(root);
  fs::create_directories(root);
  // llama_rope: Llama 3's rope scaling (rope_freqs.weight), which only llama.cpp reads.
  std::vector<std::string> families = kFamilies;
  families.insert(families.end(), kGlmFamilies.begin(), kGlmFamilies.end());
  families.push_back("llama_rope");
  const std::vector<Case> cases = prepare_families(python, root, families, {"f16"});
  const std::string out = run(fmt::format("{} {} llamacpp '{}' {}{}", python, script(), kPrompt,
                                          kNewTokens, case_args(root, cases, 2e-2)),
                              root / "llamacpp.txt");
  expect_greedy_as_shardlm(out, cases, "llama.cpp");
}

}  // namespace
}  // namespace shardlm
