// tokenize_files and read_documents: plain-text and record inputs (records.cpp, cut by
// record_reader.cpp), streamed into a ShardWriter or any sink (chats rendered by
// chat_template.cpp); the tokenizer loader. Documents are encoded on several threads in batches
// of bounded size and handed on in input order, so the shards are the same bytes for any number
// of threads; an input is never read whole.
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

#include "record_reader.h"
#include "shardlm/core/check.h"
#include "shardlm/io/bpe.h"
#include "shardlm/io/sentencepiece.h"

namespace shardlm {
namespace {

// One unit of work: a plain-text document, or a record's raw JSON (parsed by the worker, so
// that parsing runs in parallel too).
using Item = RawRecord;

struct Encoded {
  RecordDocument record;     // no tokens: nothing to write (an empty text)
  std::exception_ptr error;  // rethrown (or counted) when the item's turn to be written comes
};

// Where a record starts: "<file>:<line>" and, in a JSON array, its index.
std::string record_place(const std::string& path, const Item& item) {
  return item.index < 0 ? fmt::format("{}:{}", path, item.line)
                        : fmt::format("{}:{}: record {}", path, item.line, item.index);
}

RecordDocument encode_record_text(const Item& item, const std::string& path,
                                  const RecordOptions& options, const Tokenizer& tok) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(item.text);
  } catch (const nlohmann::json::parse_error& err) {
    SHARDLM_FAIL(ErrorKind::kData, "{}: not valid JSON (byte {} of the record)",
                 record_place(path, item), err.byte);
  }
  try {
    return encode_record(j, options, tok);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kData) throw;
    SHARDLM_FAIL(ErrorKind::kData, "{}: {}", record_place(path, item), e.what());
  }
}

Encoded encode_item(const Item& item, const std::string& path, const RecordOptions* records,
                    const Tokenizer& tok) {
  Encoded e;
  try {
    if (records != nullptr) {
      e.record = encode_record_text(item, path, *records, tok);
    } else {
      e.record.doc.tokens = tok.encode(item.text);
      e.record.doc.tokens.push_back(tok.eos_id());
    }
  } catch (...) {
    e.error = std::current_exception();
  }
  return e;
}

// Cuts plain text into documents: maximal runs of non-blank lines, each line ending in "\n".
class TextDocuments {
 public:
  explicit TextDocuments(std::istream& in) : in_(in) {}
  bool next(Item& out) {
    out.text.clear();
    std::string line;
    while (std::getline(in_, line)) {
      if (line.empty() || line == "\r") {
        if (!out.text.empty()) return true;
      } else {
        out.text += line;
        out.text.push_back('\n');
      }
    }
    return !out.text.empty();
  }

 private:
  std::istream& in_;
};

// Reads the next items into `batch` (cleared first) until it holds `max_bytes` of text or
// `max_items` items, or the input ends; false when nothing was left to read.
template <class Source>
bool read_batch(Source& source, size_t max_bytes, size_t max_items, std::vector<Item>& batch) {
  batch.clear();
  size_t bytes = 0;
  Item item;
  while (bytes < max_bytes && batch.size() < max_items && source.next(item)) {
    bytes += item.text.size();
    batch.push_back(std::move(item));
  }
  return !batch.empty();
}

// Encodes items[i] into out[i] on `threads` threads (this one included), each taking the next
// item as it finishes one: documents differ widely in length.
void encode_batch(const std::vector<Item>& items, const std::string& path,
                  const RecordOptions* records, const Tokenizer& tok, int threads,
                  std::vector<Encoded>& out) {
  out.assign(items.size(), Encoded{});
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items.size();)
      out[i] = encode_item(items[i], path, records, tok);
  };
  const size_t helpers = std::min(size_t(std::max(threads, 1)), items.size()) - 1;
  std::vector<std::jthread> pool;
  pool.reserve(helpers);
  for (size_t t = 0; t < helpers; ++t) pool.emplace_back(work);
  work();
}  // the helpers join here

// A bad record's error, counted when skip_bad_records allows it, else rethrown.
void count_or_rethrow(const std::exception_ptr& error, bool skip, FileStats& stats) {
  if (!skip) std::rethrow_exception(error);
  try {
    std::rethrow_exception(error);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::kData) throw;
    if (stats.bad_shown.size() < FileStats::kBadRecordsShown) stats.bad_shown.push_back(e.what());
    ++stats.bad_records;
  }
}

// The items of `source`, batch by batch, encoded and handed to `sink` in order.
template <class Source>
FileStats encode_all(Source& source, const std::string& path, const RecordOptions* records,
                     const Tokenizer& tok, int threads,
                     const std::function<void(const DocumentTokens&)>& sink) {
  // Bounded memory: at most this much text (and its tokens) is held at once.
  const size_t max_bytes = size_t(threads) << 21, max_items = size_t(threads) << 10;
  FileStats stats;
  std::vector<Item> batch;
  std::vector<Encoded> encoded;
  while (read_batch(source, max_bytes, max_items, batch)) {
    encode_batch(batch, path, records, tok, threads, encoded);
    for (Encoded& e : encoded) {
      if (e.error) {
        count_or_rethrow(e.error, records != nullptr && records->skip_bad_records, stats);
        continue;
      }
      if (e.record.doc.tokens.empty()) continue;
      sink(e.record.doc);
      stats.docs += 1;
      stats.tokens += int64_t(e.record.doc.tokens.size());
      stats.masked += e.record.masked ? 1 : 0;
      if (const auto& rejected = e.record.rejected) {  // a pair: its second document follows
        sink(*rejected);
        stats.docs += 1;
        stats.tokens += int64_t(rejected->tokens.size());
        stats.masked += 1;
        stats.pairs += 1;
      }
    }
  }
  return stats;
}

}  // namespace

FileStats read_documents(const std::string& path, const Tokenizer& tok,
                         const RecordOptions& options, int threads,
                         const std::function<void(const DocumentTokens&)>& sink) {
  if (threads < 1)
    SHARDLM_FAIL(ErrorKind::kConfig, "tokenize: threads must be >= 1, got {}", threads);
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec))
    SHARDLM_FAIL(ErrorKind::kData, "{}: is a directory; give the files in it", path);
  std::ifstream in(path, std::ios::binary);
  if (!in) SHARDLM_FAIL(ErrorKind::kData, "{}: cannot open the input file", path);
  FileStats stats;
  if (is_record_file(path)) {
    RecordScanner records(in, path);
    stats = encode_all(records, path, &options, tok, threads, sink);
  } else {
    TextDocuments text(in);
    stats = encode_all(text, path, nullptr, tok, threads, sink);
  }
  if (in.bad()) SHARDLM_FAIL(ErrorKind::kData, "{}: read error", path);
  if (stats.docs == 0)
    SHARDLM_FAIL(ErrorKind::kData,
                 "{}: no documents (the file is empty or holds only blank lines{})", path,
                 !is_record_file(path) ? ""
                 : stats.bad_records == 0
                     ? " and empty texts"
                     : fmt::format(", empty texts and {} bad records skipped", stats.bad_records));
  return stats;
}

std::string describe_file(const std::string& path, const FileStats& stats) {
  std::string out = fmt::format(
      "  {}: {} documents{}{}, {} tokens\n", path, stats.docs,
      stats.masked > 0 ? fmt::format(" ({} masked)", stats.masked) : "",
      stats.pairs > 0 ? fmt::format(" in {} preference pairs", stats.pairs) : "", stats.tokens);
  if (stats.bad_records > 0) {
    out += fmt::format("  {}: {} bad record{} skipped (data.skip_bad_records){}\n", path,
                       stats.bad_records, stats.bad_records == 1 ? "" : "s",
                       stats.bad_records > int64_t(stats.bad_shown.size()) ? "; the first:" : ":");
    for (const std::string& what : stats.bad_shown) out += "    " + what + "\n";
  }
  return out;
}

CorpusInfo tokenize_files(const std::vector<std::string>& inputs, const std::string& output_dir,
                          const Tokenizer& tok, std::ostream& log, int64_t max_shard_tokens,
                          int threads, const RecordOptions& records) {
  if (inputs.empty()) SHARDLM_FAIL(ErrorKind::kConfig, "tokenize needs at least one input file");
  if (threads < 1)
    SHARDLM_FAIL(ErrorKind::kConfig, "tokenize: threads must be >= 1, got {}", threads);
  const auto t0 = std::chrono::steady_clock::now();
  ShardWriter writer(output_dir, tok.name(), tok.vocab_size(), max_shard_tokens);
  int64_t bad = 0;
  for (const std::string& path : inputs) {
    const FileStats stats =
        read_documents(path, tok, records, threads, [&](const DocumentTokens& d) {
          writer.add_document(d.tokens.data(), int64_t(d.tokens.size()),
                              d.mask.empty() ? nullptr : d.mask.data());
        });
    // A corpus keeps documents, not pairs: training reads preference records itself.
    if (stats.pairs > 0)
      SHARDLM_FAIL(ErrorKind::kData,
                   "{}: holds preference records (prompt, chosen, rejected), which a token corpus "
                   "cannot keep as pairs; give the file itself as data.train with "
                   "train.objective = \"dpo\" or \"simpo\"",
                   path);
    log << describe_file(path, stats);
    bad += stats.bad_records;
  }
  const CorpusInfo info = writer.finish();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  log << fmt::format(
      "tokenized {} file{}: {} documents, {} tokens ({} tokenizer, vocab {}, loss mask: {}){} "
      "-> {} in {:.2f} s on {} thread{} ({:.0f} tokens/s)\n",
      inputs.size(), inputs.size() == 1 ? "" : "s", info.n_docs, info.n_tokens, info.tokenizer,
      info.vocab_size, info.has_loss_mask ? "yes" : "no",
      bad > 0 ? fmt::format(", {} bad records skipped", bad) : "", output_dir, seconds, threads,
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
