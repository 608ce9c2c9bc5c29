// Byte-level BPE from tokenizer.json (io/bpe.h) against Hugging Face `tokenizers`: two
// tokenizers trained by the reference at test time (GPT-2 style: ByteLevel with GPT-2's regex;
// Llama-3 style: a Split with Llama-3's regex, ByteLevel without one, ignore_merges; Qwen2
// style: NFC, a Split with Qwen2's regex, ByteLevel without one; Qwen3 style: Qwen2's with a
// ByteLevel post-processor and Qwen3's added tokens, <think> and the tool-call markers not
// special) encode
// 3000 varied strings (contractions, numbers, whitespace runs, CJK, emoji, combining marks,
// random code points, special tokens) to the same ids, and decode gives every string back.
// Without the venv those comparisons skip; the round trip of arbitrary bytes (invalid UTF-8
// included) and the errors for unsupported files run everywhere they can build a tokenizer.
#include "shardlm/io/bpe.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "shardlm/core/check.h"
#include "shardlm/io/tokenize.h"
#include "test_util.h"
#include "tokenizer_reference.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string script() { return std::string(SHARDLM_SOURCE_DIR) + "/tests/unit/bpe_reference.py"; }

using test::run_command;

// A tokenizer of `kind` trained by the reference in a fresh directory ("" without the venv).
fs::path reference_tokenizer(const std::string& python, const std::string& kind) {
  return test::reference_tokenizer_dir(python, script(), "bpe_" + kind, kind);
}

using test::expect_threads_give_the_same_shards;

class BpeParity : public ::testing::TestWithParam<const char*> {};

TEST_P(BpeParity, SameIdsAsTokenizersAndDecodeGivesTheTextBack) {
  const std::string python = test::venv_python("tokenizers");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("tokenizers"));
  const fs::path dir = reference_tokenizer(python, GetParam());
  const fs::path strings_file = dir / "strings.json";
  const std::string strings =
      run_command(python + " " + script() + " strings 3000 11", strings_file);
  const std::vector<std::string> texts = json::parse(strings).get<std::vector<std::string>>();
  const json ref = json::parse(
      run_command(python + " " + script() + " encode " + dir.string() + " " + strings_file.string(),
                  dir / "ids.json"));
  const auto want = ref["ids"].get<std::vector<std::vector<int32_t>>>();
  // What decoding gives back: the text as the normalizer leaves it (NFC for qwen2).
  const auto normalized = ref["normalized"].get<std::vector<std::string>>();
  ASSERT_EQ(texts.size(), want.size());
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(dir.string());  // the directory form
  const auto& bpe = dynamic_cast<const BpeTokenizer&>(*tok);
  int mismatches = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::vector<int32_t> got = tok->encode(texts[i]);
    if (got != want[i] && ++mismatches <= 5)
      ADD_FAILURE() << "string " << i << " " << json(texts[i]).dump() << ": ids "
                    << json(got).dump() << ", tokenizers " << json(want[i]).dump();
    // Special tokens are dropped from decoded text; everything else comes back.
    std::string text = normalized[i];
    for (const char* special : {"<|endoftext|>", "<|begin_of_text|>", "<|end_of_text|>",
                                "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"}) {
      if (bpe.token_id(special) < 0 || bpe.encode(special).size() != 1) continue;
      for (size_t at; (at = text.find(special)) != std::string::npos;)
        text.erase(at, std::string(special).size());
    }
    EXPECT_EQ(tok->decode(got), text) << "string " << i;
  }
  EXPECT_EQ(mismatches, 0);
  EXPECT_GE(tok->vocab_size(), 700);
  EXPECT_GE(tok->eos_id(), 0);
  // The tokenizer is shared by tokenize's threads.
  expect_threads_give_the_same_shards(texts, *tok, dir);
}

INSTANTIATE_TEST_SUITE_P(Styles, BpeParity, ::testing::Values("gpt2", "llama3", "qwen2", "qwen3"));

// GPT-2's vocab.json + merges.txt, and tiktoken rank files: the same tokenizer in those forms
// gives the reference's ids (tokenizers for the first, tiktoken for the second).
TEST(Bpe, VocabMergesAndTiktokenFilesGiveTheReferenceIds) {
  const std::string python = test::venv_python("tiktoken");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("tiktoken"));
  const fs::path dir = reference_tokenizer(python, "gpt2");
  run_command(python + " " + script() + " vocabmerges " + dir.string(), dir / "vm.txt");
  const fs::path strings_file = dir / "strings.json";
  run_command(python + " " + script() + " strings 2000 12", strings_file);
  const auto texts = json::parse(test::slurp(strings_file)).get<std::vector<std::string>>();
  const json ref = json::parse(
      run_command(python + " " + script() + " encode " + dir.string() + " " + strings_file.string(),
                  dir / "ids.json"));
  const auto hf = ref["ids"].get<std::vector<std::vector<int32_t>>>();
  // vocab.json + merges.txt (the directory form picks tokenizer.json first: name the files).
  const auto vm =
      BpeTokenizer::from_vocab_merges((dir / "vocab.json").string(), (dir / "merges.txt").string());
  int bad = 0;
  for (size_t i = 0; i < texts.size(); ++i)
    if (vm->encode(texts[i]) != hf[i] && ++bad <= 3)
      ADD_FAILURE() << "vocab/merges, string " << json(texts[i]).dump();
  EXPECT_EQ(bad, 0);
  // tiktoken: ranks written from the same vocabulary, ids from tiktoken itself.
  const auto tk_ids = json::parse(run_command(python + " " + script() + " tiktoken " +
                                                  dir.string() + " " + strings_file.string(),
                                              dir / "tk_ids.json"))
                          .get<std::vector<std::vector<int32_t>>>();
  const std::unique_ptr<Tokenizer> tk = load_tokenizer((dir / "ranks.tiktoken").string());
  bad = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::vector<int32_t> got = tk->encode(texts[i]);
    if (got != tk_ids[i] && ++bad <= 3)
      ADD_FAILURE() << "tiktoken, string " << json(texts[i]).dump() << ": " << json(got).dump()
                    << " vs " << json(tk_ids[i]).dump();
    EXPECT_EQ(tk->decode(got), texts[i]);
  }
  EXPECT_EQ(bad, 0);
}

// GPT-2's real ranks (gpt2.tiktoken, as the openai-whisper package ships them; setup-venv.sh
// puts them in the venv): loaded as a tiktoken file (50256 ranks: GPT-2's regex and
// <|endoftext|>), they give tiktoken's ids on 3000 varied strings, and decode gives each back.
TEST(Bpe, Gpt2RealRanksGiveTiktokensIds) {
  const std::string python = test::venv_python("tiktoken");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("tiktoken"));
  const fs::path ranks = test::venv_dir() / "assets/gpt2.tiktoken";
  if (!fs::exists(ranks))
    SHARDLM_MISSING_REFERENCE(
        ranks.string() + " is missing (bash scripts/setup-venv.sh fetches it from openai-whisper)");
  const fs::path dir = test::scratch_root() / "bpe_gpt2_ranks";
  fs::create_directories(dir);
  const fs::path strings_file = dir / "strings.json";
  run_command(python + " " + script() + " strings 3000 13", strings_file);
  const auto texts = json::parse(test::slurp(strings_file)).get<std::vector<std::string>>();
  const auto want = json::parse(run_command(python + " " + script() + " gpt2 " + ranks.string() +
                                                " " + strings_file.string(),
                                            dir / "ids.json"))
                        .get<std::vector<std::vector<int32_t>>>();
  ASSERT_EQ(want.size(), texts.size());
  const std::unique_ptr<Tokenizer> tok = load_tokenizer(ranks.string());
  EXPECT_EQ(tok->vocab_size(), 50257);
  EXPECT_EQ(tok->eos_id(), 50256);
  int mismatches = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    const std::vector<int32_t> got = tok->encode(texts[i]);
    if (got != want[i] && ++mismatches <= 5)
      ADD_FAILURE() << "string " << i << " " << json(texts[i]).dump() << ": ids "
                    << json(got).dump() << ", tiktoken " << json(want[i]).dump();
    std::string text = texts[i];  // <|endoftext|> is special: decoding drops it
    for (size_t at; (at = text.find("<|endoftext|>")) != std::string::npos;) text.erase(at, 13);
    EXPECT_EQ(tok->decode(got), text) << "string " << i;
  }
  EXPECT_EQ(mismatches, 0);
  // Known ids of GPT-2's vocabulary, independent of either implementation.
  EXPECT_EQ(tok->encode("Hello world"), (std::vector<int32_t>{15496, 995}));
}

// Chat templates: a 3-turn chat through shardlm's Llama-3 and ChatML templates gives the ids
// of the reference rendering (the templates' Jinja, encoded by tokenizers), and the mask covers
// the assistant's content and its end-of-turn token only.
TEST(Bpe, ChatTemplatesMatchTheReferenceRendering) {
  const std::string python = test::venv_python("tokenizers");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("tokenizers"));
  const std::vector<ChatMessage> chat = {{"system", "You are terse."},
                                         {"user", "What's 2+2? 日本語 ok"},
                                         {"assistant", " Four.  "},
                                         {"user", "And Straße?\n"},
                                         {"assistant", "Eine Straße 😀"}};
  json messages = json::array();
  for (const auto& m : chat) messages.push_back({{"role", m.role}, {"content", m.content}});
  for (const auto& [kind, tmpl, eot] : {std::tuple{"llama3", "llama3", "<|eot_id|>"},
                                        std::tuple{"chatml", "chatml", "<|im_end|>"}}) {
    SCOPED_TRACE(kind);
    const fs::path dir = reference_tokenizer(python, kind);
    std::ofstream(dir / "chat.json") << messages.dump();
    const std::vector<int32_t> want =
        json::parse(run_command(python + " " + script() + " chat " + dir.string() + " " + tmpl +
                                    " " + (dir / "chat.json").string(),
                                dir / "chat_ids.json"))
            .get<std::vector<int32_t>>();
    const auto tok = BpeTokenizer::from_file((dir / "tokenizer.json").string());
    EXPECT_EQ(chat_template_for(*tok),
              std::string(tmpl) == "llama3" ? ChatTemplate::kLlama3 : ChatTemplate::kChatml);
    const DocumentTokens doc = encode_chat(chat, *tok);
    ASSERT_EQ(doc.tokens.size(), doc.mask.size());
    // The rendering, then the end of the document (eos, unmasked).
    std::vector<int32_t> rendered(doc.tokens.begin(), doc.tokens.end() - 1);
    EXPECT_EQ(rendered, want);
    EXPECT_EQ(doc.tokens.back(), tok->eos_id());
    EXPECT_EQ(doc.mask.back(), 0);
    // Masked: the assistants' content and their end-of-turn markers, nothing else.
    std::vector<int32_t> masked;
    int markers = 0;
    for (size_t i = 0; i < doc.tokens.size(); ++i)
      if (doc.mask[i]) {
        masked.push_back(doc.tokens[i]);
        markers += doc.tokens[i] == tok->special_token(eot);
      }
    EXPECT_EQ(markers, 2);
    const std::string text = tok->decode(masked);
    EXPECT_EQ(text, std::string(tmpl) == "llama3" ? "Four.Eine Straße 😀" : " Four.  Eine Straße 😀");
    // The generation prompt ends with the assistant's header.
    const DocumentTokens prompt = encode_chat({chat[0], chat[1]}, *tok, true);
    const std::string ending = std::string(tmpl) == "llama3" ? "assistant\n\n" : "assistant\n";
    EXPECT_TRUE(tok->decode(prompt.tokens).ends_with(ending)) << tok->decode(prompt.tokens);
  }
}

// A hand-written tokenizer.json: a tiny vocabulary over the byte alphabet.
fs::path tiny_tokenizer(const json& overrides = json::object()) {
  const fs::path dir = test::scratch_root() / "bpe_tiny";
  fs::create_directories(dir);
  // GPT-2's byte alphabet: printable ASCII maps to itself, space to U+0120 (Ġ), 0x00.. upwards.
  json vocab = json::object();
  int id = 0;
  auto cp = [](uint32_t c) {
    std::string s;
    if (c < 0x80) {
      s += char(c);
    } else if (c < 0x800) {
      s += char(0xc0 | (c >> 6));
      s += char(0x80 | (c & 0x3f));
    }
    return s;
  };
  // Every byte's character: rebuild the alphabet the way the format defines it.
  std::vector<uint32_t> chars(256);
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool kept =
        (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
    chars[b] = kept ? uint32_t(b) : next++;
  }
  for (int b = 0; b < 256; ++b) vocab[cp(chars[b])] = id++;
  vocab["he"] = id++;
  vocab["hel"] = id++;
  vocab[cp(chars[' ']) + "w"] = id++;
  json doc = {
      {"version", "1.0"},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"added_tokens", {{{"id", id}, {"content", "<|endoftext|>"}, {"special", true}}}},
      {"model",
       {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"h e", "he l", cp(chars[' ']) + " w"}}}}};
  doc.merge_patch(overrides);
  std::ofstream(dir / "tokenizer.json") << doc.dump();
  return dir / "tokenizer.json";
}

TEST(Bpe, MergesByRankAndRoundTripsAnyBytes) {
  const auto tok = BpeTokenizer::from_file(tiny_tokenizer().string());
  const int32_t he = tok->token_id("he"), hel = tok->token_id("hel");
  ASSERT_GE(he, 0);
  ASSERT_GE(hel, 0);
  EXPECT_EQ(tok->encode("hel"), (std::vector<int32_t>{hel}));
  EXPECT_EQ(tok->encode("he"), (std::vector<int32_t>{he}));
  const int32_t eot = tok->token_id("<|endoftext|>");
  EXPECT_EQ(tok->eos_id(), eot);
  const std::vector<int32_t> ids = tok->encode("hel<|endoftext|>hel");
  EXPECT_EQ(ids, (std::vector<int32_t>{hel, eot, hel}));
  EXPECT_EQ(tok->decode(ids), "helhel");  // special tokens are dropped from the text
  std::mt19937 rng(5);
  for (int trial = 0; trial < 500; ++trial) {
    std::string s(size_t(rng() % 40), '\0');
    for (char& c : s) c = char(rng() % 256);  // invalid UTF-8 included
    EXPECT_EQ(tok->decode(tok->encode(s)), s) << json::binary({s.begin(), s.end()}).dump();
  }
}

// `shardlm tokenize --print-ids` prints what encode gives, one line per input file.
TEST(Bpe, PrintIdsIsEncodeOfEachFile) {
  const fs::path tokfile = tiny_tokenizer();
  const fs::path dir = tokfile.parent_path();
  std::ofstream(dir / "a.txt") << "hel hel<|endoftext|>\nwho";
  std::ofstream(dir / "b.txt") << "he";
  const std::string out = run_command(
      std::string(SHARDLM_BINARY) + " tokenize --print-ids --tokenizer " + tokfile.string() +
          " --input " + (dir / "a.txt").string() + " " + (dir / "b.txt").string(),
      dir / "ids.txt");
  const auto tok = BpeTokenizer::from_file(tokfile.string());
  std::string want;
  for (const char* text : {"hel hel<|endoftext|>\nwho", "he"}) {
    const std::vector<int32_t> ids = tok->encode(text);
    for (size_t i = 0; i < ids.size(); ++i) {
      if (i) want += ' ';
      want += std::to_string(ids[i]);
    }
    want += "\n";
  }
  EXPECT_EQ(out, want);
}

// data.tokenizer: a run tokenizes its text with the tokenizer.json, records it in the
// checkpoint's model.json, samples with it, and `shardlm generate` decodes with it.
TEST(Bpe, TrainsAndGeneratesWithATokenizerJson) {
  const fs::path tokfile = tiny_tokenizer();
  const fs::path dir = test::scratch_root() / "bpe_train";
  fs::remove_all(dir);
  fs::create_directories(dir);
  std::ofstream(dir / "train.json") << json{
      {"data",
       {{"train", std::string(SHARDLM_SOURCE_DIR) + "/tests/data/genesis_1_12.txt"},
        {"seq_len", 32},
        {"tokenizer", tokfile.string()}}},
      {"model", {{"n_layers", 1}}},
      {"train", {{"micro_batch", 2}, {"max_steps", 2}, {"eval_every", 0}, {"eval_batches", 1}}},
      {"sample", {{"prompt", "hel"}, {"count", 1}, {"max_new_tokens", 8}}},
      {"log", {{"dir", (dir / "run").string()}}}};
  const std::string out =
      run_command(std::string(SHARDLM_BINARY) + " train --config " + (dir / "train.json").string(),
                  dir / "train.txt");
  EXPECT_NE(out.find("--- sample 1 ---\nhel"), std::string::npos) << out;
  const json model = json::parse(test::slurp(dir / "run/checkpoints/step_00000002/model.json"));
  EXPECT_EQ(model["tokenizer"], fs::absolute(tokfile).lexically_normal().string());
  const std::string gen =
      run_command(std::string(SHARDLM_BINARY) + " generate --checkpoint " +
                      (dir / "run/checkpoints").string() + " --prompt hel --max-new-tokens 5",
                  dir / "gen.txt");
  EXPECT_EQ(gen.rfind("hel", 0), 0u) << gen;
}

TEST(Bpe, UnsupportedFilesNameTheFileAndField) {
  auto expect = [](const json& overrides, const std::string& part) {
    const std::string path = tiny_tokenizer(overrides).string();
    test::expect_config_error([&] { BpeTokenizer::from_file(path); }, {path, part});
  };
  expect({{"model", {{"type", "WordPiece"}}}}, "model.type");
  expect({{"normalizer", {{"type", "NFKC"}}}}, "normalizer");
  expect({{"model", {{"byte_fallback", true}}}}, "byte_fallback");
  expect({{"pre_tokenizer", {{"type", "Metaspace"}}}}, "Metaspace");
  expect({{"pre_tokenizer",
           {{"type", "Sequence"},
            {"pretokenizers",
             {{{"type", "Split"},
               {"pattern", {{"Regex", "(unclosed"}}},
               {"behavior", "Isolated"},
               {"invert", false}},
              {{"type", "ByteLevel"}, {"use_regex", false}}}}}}},
         "does not compile");
  const fs::path bad = test::scratch_root() / "bpe_bad.json";
  std::ofstream(bad) << "{not json";
  test::expect_config_error([&] { load_tokenizer(bad.string()); }, {bad.string(), "JSON"});
  test::expect_config_error([&] { load_tokenizer("/nonexistent/tok"); }, {"tokenizer.json"});
}

}  // namespace
}  // namespace shardlm
