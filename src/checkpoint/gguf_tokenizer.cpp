// A GGUF export's tokenizer keys (gguf_tokenizer.h): from a Hugging Face tokenizer.json (byte-level
// BPE: the vocabulary by id with llama.cpp's token types, the merges, the pre-tokenizer's name in
// llama.cpp, which picks its split regex by that name) or a SentencePiece tokenizer.model (the
// pieces, scores and types), the special ids and the chat template.
#include "gguf_tokenizer.h"

#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <tuple>
#include <vector>

#include "shardlm/core/check.h"
#include "shardlm/io/bpe.h"
#include "shardlm/io/sentencepiece.h"
#include "shardlm/io/tokenize.h"
#include "shardlm/io/tokenizer.h"

namespace shardlm {

using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

// llama_token_type's values.
enum TokenType : int32_t { kNormal = 1, kControl = 3, kUserDefined = 4, kUnused = 5 };

// The split regexes of the pre-tokenizers llama.cpp knows by name.
constexpr const char* kLlama3Split =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2Split =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// The tokenizer file a checkpoint's tokenizer names (a tokenizer.json or a SentencePiece
// tokenizer.model), or Error(kConfig) for one GGUF export does not write.
std::string tokenizer_file(const std::string& tokenizer) {
  if (tokenizer.empty() || tokenizer == "byte")
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "GGUF export: the checkpoint uses shardlm's byte tokenizer, which llama.cpp "
                 "does not have; train with a Hugging Face tokenizer (data.tokenizer)");
  const std::string file = fs::is_directory(tokenizer) ? find_tokenizer(tokenizer) : tokenizer;
  const fs::path p(file);
  if (!fs::exists(p) || p.filename() == "vocab.json")
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "GGUF export: tokenizer '{}' is neither a tokenizer.json nor a SentencePiece "
                 "tokenizer.model (vocab.json + merges.txt is not written)",
                 file);
  return file;
}

json read_json_file(const std::string& file) {
  std::ifstream f(file);
  json doc;
  try {
    f >> doc;
  } catch (const json::exception& e) {
    SHARDLM_FAIL(ErrorKind::kData, "{}: not valid JSON: {}", file, e.what());
  }
  if (!doc.is_object()) SHARDLM_FAIL(ErrorKind::kData, "{}: not a JSON object", file);
  return doc;
}

bool is_glm(const std::string& arch) { return arch == "chatglm" || arch == "glm4"; }

// llama.cpp's name of tokenizer.json's pre-tokenizer: GPT-2's ByteLevel with its regex, or a
// Split by Llama 3's or Qwen2's regex before a ByteLevel without one. GLM-4's tokenizers split
// by Llama 3's regex; llama.cpp knows them by the names its converter gives them ("chatglm-bpe"
// for GLM-4-9B-chat, "glm4" for GLM-4-0414: the same split, merges applied to every word, no
// BOS), where "llama-bpe" would take a word in the vocabulary whole, as Llama 3's does.
std::string pre_tokenizer_name(const json& doc, const std::string& file, const std::string& arch) {
  const json pre = doc.value("pre_tokenizer", json());
  if (pre.is_object() && pre.value("type", "") == "ByteLevel" && pre.value("use_regex", true))
    return "gpt-2";
  if (pre.is_object() && pre.value("type", "") == "Sequence") {
    const json& seq = pre.value("pretokenizers", json::array());
    if (seq.size() == 2 && seq[0].value("type", "") == "Split" &&
        seq[1].value("type", "") == "ByteLevel" && !seq[1].value("use_regex", true)) {
      const json pattern = seq[0].value("pattern", json::object()).value("Regex", json());
      if (pattern == kLlama3Split && is_glm(arch)) return arch == "glm4" ? "glm4" : "chatglm-bpe";
      if (pattern == kLlama3Split) return "llama-bpe";
      if (pattern == kQwen2Split) return "qwen2";
    }
  }
  SHARDLM_FAIL(ErrorKind::kConfig,
               "{}: pre_tokenizer is not one llama.cpp names (GPT-2's ByteLevel, or Llama 3's "
               "or Qwen2's Split regex before a ByteLevel): {}",
               file, pre.dump());
}

// A token llama.cpp's converter marks as control although tokenizer.json does not say special.
bool looks_special(const std::string& t) {
  return (t.size() >= 4 && t.rfind("<|", 0) == 0 && t.compare(t.size() - 2, 2, "|>") == 0) ||
         t == "<pad>" || t == "<mask>";
}

struct Vocab {
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
};

// Every id below vocab_size: the model's vocabulary, then the added tokens.
Vocab read_vocab(const json& doc, int64_t vocab_size, const std::string& file) {
  Vocab v;
  for (int64_t i = 0; i < vocab_size; ++i) v.tokens.push_back(fmt::format("[PAD{}]", i));
  v.types.assign(size_t(vocab_size), kUnused);
  const auto put = [&](const std::string& text, int64_t id, int32_t type) {
    SHARDLM_CHECK_KIND(ErrorKind::kConfig, id >= 0 && id < vocab_size,
                       "{}: token '{}' has id {}, outside the model's vocab_size {}", file, text,
                       id, vocab_size);
    v.tokens[size_t(id)] = text;
    v.types[size_t(id)] = type;
  };
  for (const auto& [text, id] : doc["model"]["vocab"].items())
    put(text, id.get<int64_t>(), kNormal);
  for (const json& t : doc.value("added_tokens", json::array())) {
    const std::string text = t.at("content").get<std::string>();
    const bool control = t.value("special", false) || looks_special(text);
    put(text, t.at("id").get<int64_t>(), control ? kControl : kUserDefined);
  }
  return v;
}

// "a b" per merge (tokenizer.json spells them so, or as pairs).
std::vector<std::string> read_merges(const json& model) {
  std::vector<std::string> merges;
  for (const json& m : model.value("merges", json::array()))
    merges.push_back(m.is_array()
                         ? fmt::format("{} {}", m[0].get<std::string>(), m[1].get<std::string>())
                         : m.get<std::string>());
  return merges;
}

// The id of a tokenizer_config.json entry ("pad_token": a string or {"content": ...}), or -1.
int32_t config_token(const json& cfg, const char* key, const BpeTokenizer& tok) {
  const json t = cfg.value(key, json());
  const json text = t.is_object() ? t.value("content", json()) : t;
  return text.is_string() ? tok.token_id(text.get<std::string>()) : -1;
}

// Whether the post-processor's template for a single sequence puts `id`'s token first (bos) or
// last (eos), when it puts a special token there (gguf's SpecialVocab reads it so): how Hugging
// Face says a BOS is added when tokenizer_config.json does not.
std::optional<bool> template_adds(const json& doc, int32_t id, bool first) {
  json post = doc.value("post_processor", json());
  if (post.is_object() && post.value("type", "") == "Sequence")
    for (const json& p : post.value("processors", json::array()))
      if (p.value("type", "") == "TemplateProcessing") post = p;
  if (!post.is_object() || post.value("type", "") != "TemplateProcessing" || id < 0) return {};
  const json single = post.value("single", json::array());
  if (single.size() < 2) return {};
  const json& piece = first ? single.front() : single.back();
  if (!piece.contains("SpecialToken")) return {};
  const std::string name = piece["SpecialToken"].value("id", "");
  const json& specials = post.value("special_tokens", json::object());
  return specials.contains(name) && specials[name].value("ids", json::array()) == json::array({id});
}

// What llama.cpp's converter adds for GLM where the tokenizer does not say: <|endoftext|> as
// eos, unknown and (glm4) bos, <|user|> as end of turn (a chat's reply ends where the user's
// turn begins), and chatglm's add_bos_token false.
void add_glm_special_ids(const BpeTokenizer& tok, const std::string& arch, GgufMetadata& meta) {
  const int32_t end = tok.token_id("<|endoftext|>"), user = tok.token_id("<|user|>");
  const std::pair<const char*, int32_t> ids[] = {
      {"eos", end}, {"unknown", end}, {"bos", arch == "glm4" ? end : -1}, {"eot", user}};
  for (const auto& [name, id] : ids) {
    const std::string key = fmt::format("tokenizer.ggml.{}_token_id", name);
    if (id >= 0 && !meta.has(key)) meta.add_u32(key, uint32_t(id));
  }
  if (arch == "chatglm" && !meta.has("tokenizer.ggml.add_bos_token"))
    meta.add_bool("tokenizer.ggml.add_bos_token", false);
}

void add_special_ids(const json& doc, const std::string& file, const std::string& arch,
                     GgufMetadata& meta) {
  const std::unique_ptr<BpeTokenizer> tok = BpeTokenizer::from_file(file);
  const fs::path cfg_file = fs::path(file).parent_path() / "tokenizer_config.json";
  const json cfg = fs::exists(cfg_file) ? read_json_file(cfg_file.string()) : json::object();
  if (tok->bos_id() >= 0) meta.add_u32("tokenizer.ggml.bos_token_id", uint32_t(tok->bos_id()));
  if (tok->eos_id() >= 0) meta.add_u32("tokenizer.ggml.eos_token_id", uint32_t(tok->eos_id()));
  const int32_t pad = config_token(cfg, "pad_token", *tok);
  if (pad >= 0) meta.add_u32("tokenizer.ggml.padding_token_id", uint32_t(pad));
  for (const auto& [key, id, first] : {std::tuple{"add_bos_token", tok->bos_id(), true},
                                       std::tuple{"add_eos_token", tok->eos_id(), false}}) {
    std::optional<bool> add = template_adds(doc, id, first);
    if (cfg.contains(key) && cfg[key].is_boolean()) add = cfg[key].get<bool>();
    if (add) meta.add_bool(fmt::format("tokenizer.ggml.{}", key), *add);
  }
  if (is_glm(arch)) add_glm_special_ids(*tok, arch, meta);
}

// `text` with each of SentencePiece's "\u2581" a space.
std::string with_spaces(const std::string& text) {
  const std::string meta = "\u2581";
  std::string out;
  for (size_t i = 0; i < text.size();) {
    const bool space = text.compare(i, meta.size(), meta) == 0;
    out.push_back(space ? ' ' : text[i]);
    i += space ? meta.size() : 1;
  }
  return out;
}

// SentencePiece's tokenizer.model (tokenizer.ggml.model "llama"): the pieces with their scores
// and types (user-defined pieces as normal, as the converter reads them), then
// tokenizer_config.json's added tokens over them, and ids past the model as [PADi].
void add_sentencepiece(const std::string& file, int64_t vocab_size, bool gemma,
                       GgufMetadata& meta) {
  const std::unique_ptr<SentencePieceTokenizer> sp = SentencePieceTokenizer::from_file(file);
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, sp->vocab_size() <= vocab_size,
                     "{}: {} pieces, more than the model's vocab_size {}", file, sp->vocab_size(),
                     vocab_size);
  std::vector<std::string> tokens;
  std::vector<float> scores;
  std::vector<int32_t> types;
  for (int64_t i = 0; i < vocab_size; ++i) {
    if (i >= sp->vocab_size()) {
      tokens.push_back(fmt::format("[PAD{}]", i));
      scores.push_back(-10000.0f);
      types.push_back(kUnused);
      continue;
    }
    const SentencePieceTokenizer::Piece p = sp->piece(int32_t(i));
    tokens.push_back(p.text);
    scores.push_back(p.score);
    types.push_back(p.type == kUserDefined ? kNormal : p.type);
  }
  const fs::path cfg_file = fs::path(file).parent_path() / "tokenizer_config.json";
  const json cfg = fs::exists(cfg_file) ? read_json_file(cfg_file.string()) : json::object();
  for (const auto& [key, t] : cfg.value("added_tokens_decoder", json::object()).items()) {
    const int64_t id = std::stoll(key);
    if (id < 0 || id >= vocab_size) continue;
    const std::string text = t.at("content").get<std::string>();
    const bool control = t.value("special", false) || looks_special(text);
    // llama.cpp matches user-defined tokens with their spaces as spaces.
    tokens[size_t(id)] = control ? text : with_spaces(text);
    scores[size_t(id)] = -1000.0f;
    types[size_t(id)] = control ? kControl : kUserDefined;
  }
  meta.add_string("tokenizer.ggml.model", "llama");
  meta.add_string("tokenizer.ggml.pre", "default");
  meta.add_strings("tokenizer.ggml.tokens", tokens);
  meta.add_f32s("tokenizer.ggml.scores", scores);
  meta.add_i32s("tokenizer.ggml.token_type", types);
  const std::pair<const char*, int32_t> ids[] = {{"bos", sp->bos_id()},
                                                 {"eos", sp->eos_id()},
                                                 {"unknown", sp->unk_id()},
                                                 {"padding", sp->pad_id()}};
  for (const auto& [name, id] : ids)
    if (id >= 0) meta.add_u32(fmt::format("tokenizer.ggml.{}_token_id", name), uint32_t(id));
  for (const char* key : {"add_bos_token", "add_eos_token"})
    if (cfg.contains(key) && cfg[key].is_boolean())
      meta.add_bool(fmt::format("tokenizer.ggml.{}", key), cfg[key].get<bool>());
  // Gemma's converters say no space prefix; the others follow tokenizer_config.json.
  if (gemma)
    meta.add_bool("tokenizer.ggml.add_space_prefix", false);
  else if (cfg.contains("add_prefix_space") && cfg["add_prefix_space"].is_boolean())
    meta.add_bool("tokenizer.ggml.add_space_prefix", cfg["add_prefix_space"].get<bool>());
}

// tokenizer.json's byte-level BPE (tokenizer.ggml.model "gpt2").
void add_byte_level_bpe(const std::string& file, int64_t vocab_size, const std::string& arch,
                        GgufMetadata& meta) {
  const json doc = read_json_file(file);
  if (!doc.contains("model") || doc["model"].value("type", "") != "BPE" ||
      doc["model"].value("byte_fallback", false) || !doc["model"].contains("vocab"))
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "{}: GGUF export writes byte-level BPE tokenizer.json files and SentencePiece "
                 "tokenizer.model files, and this model is {} (export with the tokenizer.model "
                 "it was converted from beside it)",
                 file, doc.value("model", json::object()).value("type", json("?")).dump());
  meta.add_string("tokenizer.ggml.model", "gpt2");
  meta.add_string("tokenizer.ggml.pre", pre_tokenizer_name(doc, file, arch));
  const Vocab v = read_vocab(doc, vocab_size, file);
  meta.add_strings("tokenizer.ggml.tokens", v.tokens);
  meta.add_i32s("tokenizer.ggml.token_type", v.types);
  const std::vector<std::string> merges = read_merges(doc["model"]);
  if (!merges.empty()) meta.add_strings("tokenizer.ggml.merges", merges);
  add_special_ids(doc, file, arch, meta);
}

}  // namespace

void add_gguf_tokenizer(const std::string& tokenizer, int64_t vocab_size, const std::string& arch,
                        GgufMetadata& meta) {
  const std::string file = tokenizer_file(tokenizer);
  if (fs::path(file).extension() == ".json") {
    add_byte_level_bpe(file, vocab_size, arch, meta);
  } else {
    std::ifstream f(file, std::ios::binary);
    const std::string bytes{std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
    if (!SentencePieceTokenizer::is_model(bytes))
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "GGUF export: tokenizer {} is not a SentencePiece model (a tiktoken file?); "
                   "GGUF export writes tokenizer.json and SentencePiece tokenizers",
                   file);
    add_sentencepiece(file, vocab_size, arch == "gemma2" || arch == "gemma3", meta);
  }
  const std::string chat = chat_template_beside(file);
  if (!chat.empty()) meta.add_string("tokenizer.chat_template", chat);
}

}  // namespace shardlm
