// tokenize_files: plain-text and JSONL inputs, streamed line by line, into a ShardWriter
// (chats rendered by chat_template.cpp); the tokenizer loader. Documents are encoded on several
// threads in batches of bounded size and written in input order, so the shards are the same
// bytes for any number of threads; an input is never read whole.
#include "shardlm/io/tokenize.h"

#include <algorithm>
#include <atomic>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <ostream>
#include <sstream>
#include <thread>

#include "shardlm/core/check.h"
#include "shardlm/io/bpe.h"
#include "shardlm/io/sentencepiece.h"

namespace shardlm {
namespace {

struct FileCounts {
  int64_t docs = 0;
  int64_t tokens = 0;
  int64_t chats = 0;
};

// One unit of work: a plain-text document, or a JSONL line (parsed by the worker, so that
// parsing runs in parallel too).
struct Item {
  std::string text;
  int64_t line_no = 0;  // the JSONL line's number (for errors); 0 for a text document
};

struct Encoded {
  DocumentTokens doc;  // no tokens: nothing to write (a blank line or an empty text)
  bool chat = false;
  std::exception_ptr error;  // rethrown when the item's turn to be written comes
};

[[noreturn]] void jsonl_error(const std::string& path, int64_t line, const std::string& what) {
  SHARDLM_FAIL(ErrorKind::kData, "{}:{}: {}", path, line, what);
}

// An assistant's reasoning: "reasoning_content" or "thinking", a string (null: none).
std::optional<std::string> parse_reasoning(const nlohmann::json& m, size_t i,
                                           const std::string& path, int64_t line) {
  std::optional<std::string> reasoning;
  for (const char* key : {"reasoning_content", "thinking"}) {
    const auto it = m.find(key);
    if (it == m.end() || it->is_null()) continue;
    if (!it->is_string())
      jsonl_error(path, line, fmt::format("messages[{}].{} must be a string", i, key));
    if (reasoning)
      jsonl_error(path, line,
                  fmt::format("messages[{}] has both \"reasoning_content\" and \"thinking\"; "
                              "keep one",
                              i));
    reasoning = it->get<std::string>();
  }
  return reasoning;
}

std::vector<ChatMessage> parse_messages(const nlohmann::json& list, const std::string& path,
                                        int64_t line) {
  if (!list.is_array() || list.empty())
    jsonl_error(path, line, "\"messages\" must be a non-empty list of {\"role\", \"content\"}");
  std::vector<ChatMessage> messages;
  messages.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) {
    const nlohmann::json& m = list[i];
    if (!m.is_object()) jsonl_error(path, line, fmt::format("messages[{}] is not an object", i));
    const auto role = m.find("role");
    if (role == m.end() || !role->is_string() || !is_chat_role(role->get<std::string>()))
      jsonl_error(path, line,
                  fmt::format("messages[{}].role must be \"system\", \"user\" or \"assistant\"{}",
                              i, role != m.end() ? fmt::format(", not {}", role->dump()) : ""));
    const auto content = m.find("content");
    if (content == m.end() || !content->is_string())
      jsonl_error(path, line, fmt::format("messages[{}].content must be a string", i));
    messages.push_back(
        {role->get<std::string>(), content->get<std::string>(), parse_reasoning(m, i, path, line)});
  }
  return messages;
}

bool is_jsonl(const std::string& path) {
  return std::filesystem::path(path).extension() == ".jsonl";
}

Encoded encode_jsonl_line(const Item& item, const std::string& path, const Tokenizer& tok) {
  const std::string& line = item.text;
  Encoded e;
  if (line.find_first_not_of(" \t\r") == std::string::npos) return e;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(line);
  } catch (const nlohmann::json::parse_error& err) {
    jsonl_error(path, item.line_no, fmt::format("not valid JSON (column {})", err.byte));
  }
  if (!j.is_object()) jsonl_error(path, item.line_no, "a record must be a JSON object");
  const auto text = j.find("text");
  const auto messages = j.find("messages");
  if (text != j.end() && messages != j.end())
    jsonl_error(path, item.line_no, "a record has \"text\" or \"messages\", not both");
  if (text != j.end()) {
    if (!text->is_string()) jsonl_error(path, item.line_no, "\"text\" must be a string");
    const std::string& s = text->get_ref<const std::string&>();
    if (s.empty()) return e;
    e.doc.tokens = tok.encode(s);
    e.doc.tokens.push_back(tok.eos_id());
  } else if (messages != j.end()) {
    e.doc = encode_chat(parse_messages(*messages, path, item.line_no), tok);
    e.chat = true;
  } else {
    jsonl_error(path, item.line_no, "a record needs \"text\" (a string) or \"messages\" (a list)");
  }
  return e;
}

Encoded encode_item(const Item& item, const std::string& path, bool jsonl, const Tokenizer& tok) {
  try {
    if (jsonl) return encode_jsonl_line(item, path, tok);
    Encoded e;
    e.doc.tokens = tok.encode(item.text);
    e.doc.tokens.push_back(tok.eos_id());
    return e;
  } catch (...) {
    Encoded e;
    e.error = std::current_exception();
    return e;
  }
}

// Reads the next items of `in` into `batch` (cleared first) until it holds `max_bytes` of text
// or `max_items` items, or the input ends; false when nothing was left to read. Plain text
// is cut into documents here: maximal runs of non-blank lines, each line ending in "\n".
bool read_batch(std::istream& in, const std::string& path, bool jsonl, int64_t& line_no,
                size_t max_bytes, size_t max_items, std::vector<Item>& batch) {
  batch.clear();
  size_t bytes = 0;
  std::string line, doc;
  while (bytes < max_bytes && batch.size() < max_items && std::getline(in, line)) {
    ++line_no;
    if (jsonl) {
      bytes += line.size();
      batch.push_back({std::move(line), line_no});
    } else if (line.empty() || line == "\r") {
      if (!doc.empty()) {
        bytes += doc.size();
        batch.push_back({std::move(doc), 0});
        doc.clear();
      }
    } else {
      doc += line;
      doc.push_back('\n');
    }
  }
  // The bounds are checked only between documents, so a document left here ends the input.
  if (!doc.empty()) batch.push_back({std::move(doc), 0});
  if (in.bad()) SHARDLM_FAIL(ErrorKind::kData, "{}: read error", path);
  return !batch.empty();
}

// Encodes items[i] into out[i] on `threads` threads (this one included), each taking the next
// item as it finishes one: documents differ widely in length.
void encode_batch(const std::vector<Item>& items, const std::string& path, bool jsonl,
                  const Tokenizer& tok, int threads, std::vector<Encoded>& out) {
  out.assign(items.size(), Encoded{});
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items.size();)
      out[i] = encode_item(items[i], path, jsonl, tok);
  };
  const size_t helpers = std::min(size_t(std::max(threads, 1)), items.size()) - 1;
  std::vector<std::jthread> pool;
  pool.reserve(helpers);
  for (size_t t = 0; t < helpers; ++t) pool.emplace_back(work);
  work();
}  // the helpers join here

// One input file into the writer, in order, whatever the number of threads.
FileCounts tokenize_file(std::istream& in, const std::string& path, const Tokenizer& tok,
                         int threads, ShardWriter& writer) {
  const bool jsonl = is_jsonl(path);
  // Bounded memory: at most this much text (and its tokens) is held at once.
  const size_t max_bytes = size_t(threads) << 21, max_items = size_t(threads) << 10;
  FileCounts counts;
  std::vector<Item> batch;
  std::vector<Encoded> encoded;
  int64_t line_no = 0;
  while (read_batch(in, path, jsonl, line_no, max_bytes, max_items, batch)) {
    encode_batch(batch, path, jsonl, tok, threads, encoded);
    for (Encoded& e : encoded) {
      if (e.error) std::rethrow_exception(e.error);
      if (e.doc.tokens.empty()) continue;
      const DocumentTokens& d = e.doc;
      writer.add_document(d.tokens.data(), int64_t(d.tokens.size()),
                          d.mask.empty() ? nullptr : d.mask.data());
      counts.docs += 1;
      counts.tokens += int64_t(d.tokens.size());
      counts.chats += e.chat ? 1 : 0;
    }
  }
  return counts;
}

}  // namespace

CorpusInfo tokenize_files(const std::vector<std::string>& inputs, const std::string& output_dir,
                          const Tokenizer& tok, std::ostream& log, int64_t max_shard_tokens,
                          int threads) {
  if (inputs.empty()) SHARDLM_FAIL(ErrorKind::kConfig, "tokenize needs at least one input file");
  if (threads < 1)
    SHARDLM_FAIL(ErrorKind::kConfig, "tokenize: threads must be >= 1, got {}", threads);
  const auto t0 = std::chrono::steady_clock::now();
  ShardWriter writer(output_dir, tok.name(), tok.vocab_size(), max_shard_tokens);
  for (const std::string& path : inputs) {
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec))
      SHARDLM_FAIL(ErrorKind::kData, "{}: is a directory; give the files in it", path);
    std::ifstream in(path, std::ios::binary);
    if (!in) SHARDLM_FAIL(ErrorKind::kData, "{}: cannot open the input file", path);
    const FileCounts counts = tokenize_file(in, path, tok, threads, writer);
    if (counts.docs == 0)
      SHARDLM_FAIL(ErrorKind::kData,
                   "{}: no documents (the file is empty or holds only blank "
                   "lines{})",
                   path, is_jsonl(path) ? " and empty texts" : "");
    log << fmt::format("  {}: {} documents{}, {} tokens\n", path, counts.docs,
                       counts.chats > 0 ? fmt::format(" ({} chats)", counts.chats) : "",
                       counts.tokens);
  }
  const CorpusInfo info = writer.finish();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  log << fmt::format(
      "tokenized {} file{}: {} documents, {} tokens ({} tokenizer, vocab {}, loss mask: {}) "
      "-> {} in {:.2f} s on {} thread{} ({:.0f} tokens/s)\n",
      inputs.size(), inputs.size() == 1 ? "" : "s", info.n_docs, info.n_tokens, info.tokenizer,
      info.vocab_size, info.has_loss_mask ? "yes" : "no", output_dir, seconds, threads,
      threads == 1 ? "" : "s", seconds > 0 ? double(info.n_tokens) / seconds : 0.0);
  return info;
}

namespace {

namespace fs = std::filesystem;

// A tiktoken rank file starts with "<base64> <rank>"; a SentencePiece model is protobuf.
bool looks_like_tiktoken(const std::string& head) {
  const std::string line = head.substr(0, head.find('\n'));
  const size_t sp = line.find(' ');
  if (sp == std::string::npos || sp == 0 || sp + 1 >= line.size()) return false;
  for (size_t i = 0; i < sp; ++i) {
    const char c = line[i];
    if (!std::isalnum(static_cast<unsigned char>(c)) && c != '+' && c != '/' && c != '=')
      return false;
  }
  for (size_t i = sp + 1; i < line.size(); ++i)
    if (!std::isdigit(static_cast<unsigned char>(line[i])) && line[i] != '\r') return false;
  return true;
}

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) SHARDLM_FAIL(ErrorKind::kConfig, "{}: cannot read the tokenizer file", p.string());
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// tokenizer.model: a tiktoken rank file (Llama-3's original) or a SentencePiece protobuf
// (Llama-2, Mistral), told apart by content.
std::unique_ptr<Tokenizer> load_model_file(const fs::path& p) {
  const std::string bytes = read_file(p);
  if (looks_like_tiktoken(bytes)) return BpeTokenizer::from_tiktoken(p.string());
  if (SentencePieceTokenizer::is_model(bytes)) return SentencePieceTokenizer::from_file(p.string());
  SHARDLM_FAIL(ErrorKind::kConfig,
               "{}: neither a SentencePiece model (protobuf, as Llama-2's and Mistral's "
               "tokenizer.model) nor a tiktoken rank file (\"<base64 token> <rank>\" lines, as "
               "Llama-3's original tokenizer.model)",
               p.string());
}

// Hugging Face's conversion of a SentencePiece model (Llama-2, Mistral: BPE with byte
// fallback, or Unigram, with Metaspace): the directory's tokenizer.model is read instead.
bool converted_from_sentencepiece(const fs::path& tokenizer_json) {
  nlohmann::json doc;
  try {
    std::ifstream(tokenizer_json) >> doc;
  } catch (const nlohmann::json::exception&) {
    return false;  // BpeTokenizer::from_file names the error
  }
  if (!doc.is_object() || !doc.contains("model") || !doc["model"].is_object()) return false;
  const nlohmann::json& model = doc["model"];
  return model.value("type", std::string()) == "Unigram" || model.value("byte_fallback", false);
}

}  // namespace

std::string find_tokenizer(const std::string& dir) {
  const fs::path p(dir);
  const bool json = fs::exists(p / "tokenizer.json");
  const bool model = fs::exists(p / "tokenizer.model");
  if (json && !(model && converted_from_sentencepiece(p / "tokenizer.json")))
    return (p / "tokenizer.json").string();
  if (fs::exists(p / "vocab.json") && fs::exists(p / "merges.txt"))
    return (p / "vocab.json").string();
  if (model) return (p / "tokenizer.model").string();
  return json ? (p / "tokenizer.json").string() : "";
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& path) {
  if (path.empty() || path == "byte") return std::make_unique<ByteTokenizer>();
  const fs::path p(path);
  if (fs::is_directory(p)) {
    const std::string file = find_tokenizer(path);
    if (file.empty())
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "tokenizer \"{}\": the directory has no tokenizer.json, vocab.json + "
                   "merges.txt or tokenizer.model",
                   path);
    return load_tokenizer(file);
  }
  if (fs::exists(p)) {
    // vocab.json is how a vocab.json + merges.txt tokenizer names itself.
    if (p.filename() == "vocab.json" && fs::exists(p.parent_path() / "merges.txt"))
      return BpeTokenizer::from_vocab_merges(path, (p.parent_path() / "merges.txt").string());
    if (p.extension() == ".json") return BpeTokenizer::from_file(path);
    return load_model_file(p);
  }
  SHARDLM_FAIL(ErrorKind::kConfig,
               "tokenizer \"{}\": no such file or directory; give \"byte\", a directory holding "
               "tokenizer.json, vocab.json + merges.txt or tokenizer.model, or one of those files",
               path);
}

}  // namespace shardlm
