// Loading a byte-level BPE (bpe.h): tokenizer.json or a tiktoken file into BpeTokenizer::Impl,
// the pre-tokenizer's pattern compiled with PCRE2, the byte alphabet, the added tokens and bos /
// eos. Encoding and decoding: bpe.cpp.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "bpe_impl.h"
#include "shardlm/core/check.h"
#include "shardlm/io/bpe.h"
#include "shardlm/io/tokenizer.h"

namespace shardlm {

using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

// GPT-2's pre-tokenizer, the one ByteLevel applies when use_regex is true.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// Llama-3's (tiktoken files of 128000 ranks).
constexpr const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

void append_utf8(std::string& s, uint32_t cp) {
  if (cp < 0x80) {
    s += char(cp);
  } else if (cp < 0x800) {
    s += char(0xc0 | (cp >> 6));
    s += char(0x80 | (cp & 0x3f));
  } else if (cp < 0x10000) {
    s += char(0xe0 | (cp >> 12));
    s += char(0x80 | ((cp >> 6) & 0x3f));
    s += char(0x80 | (cp & 0x3f));
  } else {
    s += char(0xf0 | (cp >> 18));
    s += char(0x80 | ((cp >> 12) & 0x3f));
    s += char(0x80 | ((cp >> 6) & 0x3f));
    s += char(0x80 | (cp & 0x3f));
  }
}

void compile_pattern(BpeTokenizer::Impl& m, const std::string& pattern) {
  int err = 0;
  PCRE2_SIZE at = 0;
  m.regex = std::make_unique<Pcre2Regex>();
  m.regex->code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                    PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &at, nullptr);
  if (m.regex->code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    m.fail(fmt::format("pre_tokenizer regex does not compile at {}: {}", at,
                       reinterpret_cast<const char*>(msg)));
  }
  pcre2_jit_compile(m.regex->code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter
}

// GPT-2's bytes_to_unicode: printable bytes map to themselves, the others to U+0100 onwards.
void byte_alphabet(BpeTokenizer::Impl& m) {
  uint32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool kept = (b >= '!' && b <= '~') || (b >= 0xa1 && b <= 0xac) || (b >= 0xae);
    const uint32_t cp = kept ? uint32_t(b) : next++;
    append_utf8(m.byte_str[b], cp);
    m.char_byte[cp] = uint8_t(b);
  }
}

// tokenizer.json parsed, with a 'model' object.
json read_tokenizer_json(BpeTokenizer::Impl& m, const std::string& path) {
  std::ifstream f(path);
  if (!f) SHARDLM_FAIL(ErrorKind::kConfig, "{}: cannot read the tokenizer file", path);
  json doc;
  try {
    f >> doc;
  } catch (const json::exception& e) {
    m.fail(fmt::format("not valid JSON: {}", e.what()));
  }
  if (!doc.is_object() || !doc.contains("model") || !doc["model"].is_object())
    m.fail("no 'model' object (not a Hugging Face tokenizer.json?)");
  return doc;
}

// Refuses what byte-level BPE does not read (the model's type and options, the normalizer, the
// decoder); takes NFC and ignore_merges.
void check_model_options(BpeTokenizer::Impl& m, const json& doc, const json& model) {
  if (model.value("type", std::string()) != "BPE")
    m.fail(fmt::format("model.type = {} is not supported (byte-level BPE only)",
                       model.contains("type") ? model["type"].dump() : "missing"));
  if (model.value("byte_fallback", false))
    m.fail(
        "model.byte_fallback = true (a conversion of a SentencePiece model) is not read; give "
        "the directory holding the model's tokenizer.model, which is read instead");
  for (const char* k : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (model.contains(k) && !model[k].is_null() && model[k] != "")
      m.fail(fmt::format("model.{} is not supported", k));
  if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"] != 0)
    m.fail("model.dropout is not supported");
  if (doc.contains("normalizer") && !doc["normalizer"].is_null()) {
    const json& n = doc["normalizer"];
    const bool is_nfc = n.value("type", std::string()) == "NFC" ||
                        (n.value("type", std::string()) == "Sequence" &&
                         n.value("normalizers", json::array()).size() == 1 &&
                         n["normalizers"][0].value("type", std::string()) == "NFC");
    if (!is_nfc) m.fail(fmt::format("normalizer {} is not supported (NFC only)", n.dump()));
    m.nfc = true;
  }
  if (doc.contains("decoder") && !doc["decoder"].is_null() &&
      doc["decoder"].value("type", std::string()) != "ByteLevel")
    m.fail(fmt::format("decoder {} is not supported (ByteLevel)", doc["decoder"].dump()));
  m.ignore_merges = model.value("ignore_merges", false);
}

// Pre-tokenizer: ByteLevel (GPT-2's regex unless use_regex is false), or a Sequence of
// Split (Isolated, not inverted) and ByteLevel without a regex.
void read_pre_tokenizer(BpeTokenizer::Impl& m, const json& doc) {
  std::string pattern;
  bool byte_level = false;
  auto take = [&](const json& p) {
    const std::string type = p.value("type", std::string());
    if (type == "ByteLevel") {
      byte_level = true;
      m.add_prefix_space = p.value("add_prefix_space", false);
      if (p.value("use_regex", true)) {
        if (!pattern.empty()) m.fail("pre_tokenizer: two regexes (Split and ByteLevel's)");
        pattern = kGpt2Pattern;
      }
    } else if (type == "Split") {
      if (p.value("behavior", std::string()) != "Isolated" || p.value("invert", false))
        m.fail(
            fmt::format("pre_tokenizer Split {} is not supported (behavior Isolated, not "
                        "inverted)",
                        p.dump()));
      if (!p.contains("pattern") || !p["pattern"].is_object() || !p["pattern"].contains("Regex"))
        m.fail("pre_tokenizer Split: only a {\"Regex\": ...} pattern is supported");
      if (!pattern.empty()) m.fail("pre_tokenizer: more than one regex");
      pattern = p["pattern"]["Regex"].get<std::string>();
    } else {
      m.fail(fmt::format("pre_tokenizer {} is not supported (ByteLevel, Split)", p.dump()));
    }
  };
  const json pre = doc.value("pre_tokenizer", json());
  if (pre.is_object() && pre.value("type", std::string()) == "Sequence") {
    for (const json& p : pre.value("pretokenizers", json::array())) take(p);
  } else if (pre.is_object()) {
    take(pre);
  }
  if (!byte_level) m.fail("pre_tokenizer: no ByteLevel step (byte-level BPE only)");
  if (!pattern.empty()) compile_pattern(m, pattern);
}

// model.vocab into m.vocab; returns the largest id.
int32_t read_vocab(BpeTokenizer::Impl& m, const json& model) {
  if (!model.contains("vocab") || !model["vocab"].is_object()) m.fail("model.vocab is missing");
  int32_t max_id = -1;
  for (const auto& [tok, id] : model["vocab"].items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() >= std::numeric_limits<int32_t>::max())
      m.fail(fmt::format("model.vocab['{}'] is not a valid id", tok));
    m.vocab[tok] = id.get<int32_t>();
    max_id = std::max(max_id, id.get<int32_t>());
  }
  return max_id;
}

// model.merges, each "a b" or [a, b], ranked in file order.
void read_merges(BpeTokenizer::Impl& m, const json& model) {
  int32_t rank = 0;
  for (const json& mg : model.value("merges", json::array())) {
    std::string a, b;
    if (mg.is_string()) {
      const std::string s = mg.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos) m.fail(fmt::format("merge '{}' is not two tokens", s));
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (mg.is_array() && mg.size() == 2 && mg[0].is_string() && mg[1].is_string()) {
      a = mg[0].get<std::string>();
      b = mg[1].get<std::string>();
    } else {
      m.fail(fmt::format("merge {} is neither \"a b\" nor [a, b]", mg.dump()));
    }
    m.merge_rank.emplace(a + '\x01' + b, rank++);
  }
}

// added_tokens into m.added; returns their largest id (-1 when none).
int32_t read_added_tokens(BpeTokenizer::Impl& m, const json& doc) {
  int32_t max_id = -1;
  for (const json& a : doc.value("added_tokens", json::array())) {
    if (!a.contains("id") || !a.contains("content"))
      m.fail(fmt::format("added token {} has no id or content", a.dump()));
    const BpeTokenizer::Impl::Added add{a["content"].get<std::string>(), a["id"].get<int32_t>(),
                                        a.value("special", false)};
    if (add.content.empty()) m.fail("an added token is empty");
    max_id = std::max(max_id, add.id);
    m.added.push_back(add);
  }
  return max_id;
}

using TokenRanks = std::vector<std::pair<std::string, int32_t>>;  // raw bytes, rank

std::string decode_base64(const BpeTokenizer::Impl& m, const std::string& in, int64_t line_no) {
  std::string out;
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    int v = c >= 'A' && c <= 'Z'   ? c - 'A'
            : c >= 'a' && c <= 'z' ? c - 'a' + 26
            : c >= '0' && c <= '9' ? c - '0' + 52
            : c == '+'             ? 62
            : c == '/'             ? 63
            : c == '='             ? -2
                                   : -1;
    if (v == -2) break;
    if (v < 0) m.fail(fmt::format("line {}: '{}' is not base64", line_no, in));
    acc = (acc << 6) | uint32_t(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out += char((acc >> bits) & 0xff);
    }
  }
  return out;
}

// A tiktoken file's "<base64 token> <rank>" lines: each token's raw bytes and rank.
TokenRanks read_tiktoken_ranks(const BpeTokenizer::Impl& m, std::istream& f) {
  TokenRanks ranks;
  int64_t line_no = 0;
  for (std::string line; std::getline(f, line);) {
    ++line_no;
    if (line.empty()) continue;
    const size_t sp = line.find(' ');
    int64_t r = -1;
    try {
      if (sp != std::string::npos) r = std::stoll(line.substr(sp + 1));
    } catch (const std::exception&) {
    }
    if (sp == std::string::npos || r < 0 || r >= std::numeric_limits<int32_t>::max())
      m.fail(fmt::format("line {}: expected \"<base64 token> <rank>\"", line_no));
    ranks.emplace_back(decode_base64(m, line.substr(0, sp), line_no), int32_t(r));
  }
  if (ranks.empty()) m.fail("no ranks");
  return ranks;
}

// Raw bytes as the byte alphabet's characters (the vocabulary's spelling).
std::string byte_level_text(const BpeTokenizer::Impl& m, std::string_view bytes) {
  std::string s;
  for (char c : bytes) s += m.byte_str[uint8_t(c)];
  return s;
}

void vocab_and_merges_from_ranks(BpeTokenizer::Impl& m, const TokenRanks& ranks) {
  std::unordered_map<std::string, int32_t> by_bytes;
  for (const auto& [bytes, r] : ranks) {
    by_bytes[bytes] = r;
    m.vocab[byte_level_text(m, bytes)] = r;
  }
  // Every split of a token into two tokens merges at the token's rank.
  for (const auto& [bytes, r] : ranks)
    for (size_t k = 1; k < bytes.size(); ++k)
      if (by_bytes.count(bytes.substr(0, k)) && by_bytes.count(bytes.substr(k)))
        m.merge_rank.emplace(
            byte_level_text(m, bytes.substr(0, k)) + '\x01' + byte_level_text(m, bytes.substr(k)),
            r);
}

// The pre-tokenizer and special tokens that a file of `n` ranks implies: Llama-3's at 128000,
// GPT-2's otherwise (with <|endoftext|> at 50256). Returns the largest special id (-1: none).
int32_t add_tiktoken_specials(BpeTokenizer::Impl& m, size_t n) {
  if (n == 128000) {
    compile_pattern(m, kLlama3Pattern);
    const char* named[] = {"<|begin_of_text|>",
                           "<|end_of_text|>",
                           "<|reserved_special_token_0|>",
                           "<|reserved_special_token_1|>",
                           "<|finetune_right_pad_id|>",
                           "<|reserved_special_token_2|>",
                           "<|start_header_id|>",
                           "<|end_header_id|>",
                           "<|eom_id|>",
                           "<|eot_id|>",
                           "<|python_tag|>"};
    int reserved = 3;
    for (int32_t i = 0; i < 256; ++i) {
      const std::string text = i < int32_t(std::size(named))
                                   ? std::string(named[i])
                                   : fmt::format("<|reserved_special_token_{}|>", reserved++);
      m.added.push_back({text, 128000 + i, true});
    }
    return 128000 + 255;
  }
  compile_pattern(m, kGpt2Pattern);
  if (n == 50256) {
    m.added.push_back({"<|endoftext|>", 50256, true});
    return 50256;
  }
  return -1;
}

}  // namespace

BpeTokenizer::BpeTokenizer() : impl_(std::make_unique<Impl>()) {}
BpeTokenizer::~BpeTokenizer() = default;

std::unique_ptr<BpeTokenizer> BpeTokenizer::from_file(const std::string& path) {
  std::unique_ptr<BpeTokenizer> t(new BpeTokenizer());
  Impl& m = *t->impl_;
  m.file = path;
  const json doc = read_tokenizer_json(m, path);
  const json& model = doc["model"];
  check_model_options(m, doc, model);
  byte_alphabet(m);
  read_pre_tokenizer(m, doc);
  int32_t max_id = read_vocab(m, model);
  read_merges(m, model);
  max_id = std::max(max_id, read_added_tokens(m, doc));
  t->finish(max_id, path);
  return t;
}

std::unique_ptr<BpeTokenizer> BpeTokenizer::from_vocab_merges(const std::string& vocab_json,
                                                              const std::string& merges_txt) {
  std::unique_ptr<BpeTokenizer> t(new BpeTokenizer());
  Impl& m = *t->impl_;
  m.file = vocab_json;
  byte_alphabet(m);
  compile_pattern(m, kGpt2Pattern);
  std::ifstream vf(vocab_json);
  if (!vf) m.fail("cannot read");
  json vocab;
  try {
    vf >> vocab;
  } catch (const json::exception& e) {
    m.fail(fmt::format("not valid JSON: {}", e.what()));
  }
  if (!vocab.is_object()) m.fail("not an object of token -> id");
  int32_t max_id = -1;
  for (const auto& [tok, id] : vocab.items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() >= std::numeric_limits<int32_t>::max())
      m.fail(fmt::format("'{}' has no valid id", tok));
    m.vocab[tok] = id.get<int32_t>();
    max_id = std::max(max_id, id.get<int32_t>());
  }
  const auto eot = m.vocab.find("<|endoftext|>");
  if (eot != m.vocab.end()) m.added.push_back({eot->first, eot->second, true});
  std::ifstream mf(merges_txt);
  if (!mf) SHARDLM_FAIL(ErrorKind::kConfig, "{}: cannot read", merges_txt);
  int32_t rank = 0;
  int64_t line_no = 0;
  for (std::string line; std::getline(mf, line);) {
    ++line_no;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || (line_no == 1 && line.rfind("#version", 0) == 0)) continue;
    const size_t sp = line.find(' ');
    if (sp == std::string::npos || line.find(' ', sp + 1) != std::string::npos)
      SHARDLM_FAIL(ErrorKind::kConfig, "{}:{}: a merge is two tokens separated by one space",
                   merges_txt, line_no);
    m.merge_rank.emplace(line.substr(0, sp) + '\x01' + line.substr(sp + 1), rank++);
  }
  t->finish(max_id, vocab_json);
  return t;
}

std::unique_ptr<BpeTokenizer> BpeTokenizer::from_tiktoken(const std::string& path) {
  std::unique_ptr<BpeTokenizer> t(new BpeTokenizer());
  Impl& m = *t->impl_;
  m.file = path;
  byte_alphabet(m);
  std::ifstream f(path);
  if (!f) m.fail("cannot read");
  const TokenRanks ranks = read_tiktoken_ranks(m, f);
  int32_t max_id = -1;
  for (const auto& [bytes, r] : ranks) max_id = std::max(max_id, r);
  vocab_and_merges_from_ranks(m, ranks);
  max_id = std::max(max_id, add_tiktoken_specials(m, ranks.size()));
  t->finish(max_id, path);
  return t;
}

void BpeTokenizer::finish(int32_t max_id, const std::string& path) {
  Impl& m = *impl_;
  std::stable_sort(m.added.begin(), m.added.end(), [](const Impl::Added& x, const Impl::Added& y) {
    return x.content.size() > y.content.size();
  });
  for (size_t i = 0; i < m.added.size(); ++i) {
    m.added_of_id[m.added[i].id] = i;
    m.added_first[uint8_t(m.added[i].content[0])] = true;
  }
  vocab_size_ = max_id + 1;
  m.id_to_token.assign(size_t(vocab_size_), std::string());
  for (const auto& [tok, id] : m.vocab) m.id_to_token[size_t(id)] = tok;

  // bos / eos: tokenizer_config.json beside the file, else the families' names.
  auto token_text = [](const json& v) -> std::string {
    if (v.is_string()) return v.get<std::string>();
    if (v.is_object() && v.contains("content") && v["content"].is_string())
      return v["content"].get<std::string>();
    return "";
  };
  const fs::path cfg_path = fs::path(path).parent_path() / "tokenizer_config.json";
  std::string bos, eos;
  if (fs::exists(cfg_path)) {
    std::ifstream cf(cfg_path);
    json cfg;
    try {
      cf >> cfg;
    } catch (const json::exception& e) {
      SHARDLM_FAIL(ErrorKind::kConfig, "{}: not valid JSON: {}", cfg_path.string(), e.what());
    }
    if (cfg.contains("bos_token")) bos = token_text(cfg["bos_token"]);
    if (cfg.contains("eos_token")) eos = token_text(cfg["eos_token"]);
  }
  auto first_known = [&](std::initializer_list<const char*> names) {
    for (const char* n : names)
      if (token_id(n) >= 0) return std::string(n);
    return std::string();
  };
  if (bos.empty()) bos = first_known({"<|begin_of_text|>", "<s>", "<|endoftext|>"});
  if (eos.empty()) eos = first_known({"<|end_of_text|>", "</s>", "<|endoftext|>"});
  bos_ = bos.empty() ? -1 : token_id(bos);
  eos_ = eos.empty() ? -1 : token_id(eos);
  name_ = fs::absolute(path).lexically_normal().string();
  chat_template_ = chat_template_beside(path);
}

}  // namespace shardlm
