// Token sources (in-memory text, mapped shard corpora; record files in record_source.cpp) and
// the windowed Dataset: its common part and stream packing (data_samples.cpp: samples packing).
#include "shardlm/train/data.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <random>

#include "shardlm/core/check.h"
#include "shardlm/io/shards.h"

namespace shardlm {
namespace {

class MemorySource final : public TokenSource {
 public:
  MemorySource(std::vector<int32_t> tokens, std::vector<int64_t> docs, std::string name,
               std::vector<uint8_t> mask, bool paired)
      : name_(std::move(name)),
        tokens_(std::move(tokens)),
        docs_(std::move(docs)),
        mask_(std::move(mask)),
        paired_(paired) {
    if (docs_.empty() || docs_.front() != 0) docs_.insert(docs_.begin(), 0);
    SHARDLM_CHECK(mask_.empty() || mask_.size() == tokens_.size(),
                  "loss mask has {} entries for {} tokens", mask_.size(), tokens_.size());
    SHARDLM_CHECK(!paired_ || docs_.size() % 2 == 0, "a paired source of {} documents",
                  docs_.size());
    // Held for the run: no slack past the contents (host_bytes()).
    tokens_.shrink_to_fit();
    docs_.shrink_to_fit();
    mask_.shrink_to_fit();
  }
  const std::string& name() const override { return name_; }
  int64_t num_tokens() const override { return int64_t(tokens_.size()); }
  const std::vector<int64_t>& doc_starts() const override { return docs_; }
  bool has_loss_mask() const override { return !mask_.empty(); }
  bool paired() const override { return paired_; }
  void read(int64_t begin, int64_t n, int32_t* out, uint8_t* mask) const override {
    SHARDLM_CHECK(begin >= 0 && n >= 0 && begin + n <= num_tokens(), "read past the stream");
    std::copy_n(tokens_.begin() + begin, n, out);
    if (mask) {
      if (mask_.empty())
        std::fill_n(mask, n, uint8_t{1});
      else
        std::copy_n(mask_.begin() + begin, n, mask);
    }
  }
  int64_t host_bytes() const override {
    return int64_t(tokens_.capacity() * sizeof(int32_t) + docs_.capacity() * sizeof(int64_t) +
                   mask_.capacity());
  }
  int64_t planned_host_bytes() const override {
    return memory_source_host_bytes(num_tokens(), int64_t(docs_.size()), has_loss_mask());
  }

 private:
  std::string name_;
  std::vector<int32_t> tokens_;
  std::vector<int64_t> docs_;
  std::vector<uint8_t> mask_;
  bool paired_ = false;
};

class CorpusSource final : public TokenSource {
 public:
  explicit CorpusSource(const std::string& path) : name_(path), corpus_(path) {
    corpus_.verify_checksums();
  }
  const std::string& name() const override { return name_; }
  int64_t num_tokens() const override { return corpus_.info().n_tokens; }
  const std::vector<int64_t>& doc_starts() const override { return corpus_.doc_starts(); }
  bool has_loss_mask() const override { return corpus_.info().has_loss_mask; }
  void read(int64_t begin, int64_t n, int32_t* out, uint8_t* mask) const override {
    corpus_.read(begin, n, out, mask);
  }
  int64_t host_bytes() const override { return corpus_.host_bytes(); }
  int64_t planned_host_bytes() const override {
    return corpus_source_host_bytes(int64_t(doc_starts().size()), corpus_.num_shards());
  }

 private:
  std::string name_;
  TokenCorpus corpus_;
};

}  // namespace

std::shared_ptr<TokenSource> load_text_source(const std::string& path, const Tokenizer& tok) {
  std::ifstream f(path, std::ios::binary);
  if (!f) SHARDLM_FAIL(ErrorKind::kData, "{}: cannot open the data file", path);
  std::vector<int32_t> tokens;
  std::vector<int64_t> docs;
  // Documents are maximal runs of lines between blank lines.
  std::string line, doc;
  auto flush = [&] {
    while (!doc.empty() && doc.back() == '\n') doc.pop_back();
    if (doc.empty()) return;
    doc.push_back('\n');
    docs.push_back(int64_t(tokens.size()));
    const auto ids = tok.encode(doc);
    tokens.insert(tokens.end(), ids.begin(), ids.end());
    tokens.push_back(tok.eos_id());
    doc.clear();
  };
  while (std::getline(f, line)) {
    if (line.empty() || line == "\r") {
      flush();
    } else {
      doc += line;
      doc.push_back('\n');
    }
  }
  if (f.bad()) SHARDLM_FAIL(ErrorKind::kData, "{}: read error", path);
  flush();
  if (tokens.empty())
    SHARDLM_FAIL(ErrorKind::kData, "{}: the data file holds no text to train on", path);
  return std::make_shared<MemorySource>(std::move(tokens), std::move(docs), path,
                                        std::vector<uint8_t>{}, false);
}

std::shared_ptr<TokenSource> make_memory_source(std::vector<int32_t> tokens,
                                                std::vector<int64_t> doc_starts, std::string name,
                                                std::vector<uint8_t> mask, bool paired) {
  return std::make_shared<MemorySource>(std::move(tokens), std::move(doc_starts), std::move(name),
                                        std::move(mask), paired);
}

std::shared_ptr<TokenSource> load_corpus_source(const std::string& path) {
  return std::make_shared<CorpusSource>(path);
}

std::shared_ptr<TokenSource> open_source(const std::string& path, const Tokenizer& tok,
                                         const RecordOptions& records, std::ostream* log) {
  std::error_code ec;
  if (std::filesystem::is_directory(path, ec)) return load_corpus_source(path);
  if (is_record_file(path)) {
    std::ostream null_log(nullptr);
    return load_record_source(path, tok, records, log != nullptr ? *log : null_log);
  }
  return load_text_source(path, tok);
}

Dataset::Dataset(std::shared_ptr<TokenSource> source, int64_t seq_len, int32_t eos_id,
                 int64_t first_doc, int64_t end_doc, PackingOptions packing)
    : source_(std::move(source)), seq_len_(seq_len), eos_id_(eos_id), packing_(packing) {
  SHARDLM_CHECK(seq_len_ >= 1, "seq_len must be >= 1");
  const auto& docs = source_->doc_starts();
  const int64_t n_docs = int64_t(docs.size());
  first_doc_ = first_doc;
  end_doc_ = end_doc < 0 ? n_docs : end_doc;
  SHARDLM_CHECK(0 <= first_doc_ && first_doc_ < end_doc_ && end_doc_ <= n_docs,
                "document range [{}, {}) of {}", first_doc_, end_doc_, n_docs);
  begin_ = docs[first_doc_];
  end_ = end_doc_ < n_docs ? docs[end_doc_] : source_->num_tokens();
  if (end_ <= begin_) SHARDLM_FAIL(ErrorKind::kData, "{}: no tokens to train on", source_->name());
  tok_buf_.resize(seq_len_ + 1);
  mask_buf_.resize(seq_len_ + 1);
  if (source_->paired()) {
    SHARDLM_CHECK(first_doc_ % 2 == 0 && end_doc_ % 2 == 0,
                  "documents [{}, {}) of a paired source split a pair", first_doc_, end_doc_);
    if (packing_.packing != Packing::kSamples)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "{}: preference pairs are packed whole (data.packing = \"samples\" or "
                   "\"auto\"), not as a stream",
                   source_->name());
  }
  if (packing_.packing == Packing::kSamples)
    pack_samples();
  else
    count_stream_targets();
  // Held for the set's life: no slack past the contents (host_bytes()).
  for (std::vector<int64_t>* v :
       {&window_targets_, &window_tokens_, &bins_.offsets, &bins_.items, &pair_keep_})
    v->shrink_to_fit();
}

int64_t Dataset::host_bytes() const {
  return int64_t((window_targets_.capacity() + window_tokens_.capacity() +
                  bins_.offsets.capacity() + bins_.items.capacity() + pair_keep_.capacity()) *
                     sizeof(int64_t) +
                 tok_buf_.capacity() * sizeof(int32_t) + mask_buf_.capacity());
}

DataSetSizes Dataset::host_sizes() const {
  const bool samples = packing_.packing == Packing::kSamples;
  return {.seq_len = seq_len_,
          .windows = num_windows(),
          .samples = samples,
          .paired = paired(),
          .documents = num_documents(),
          .placed = samples ? stats_.samples : 0,
          .window_targets = !samples && source_->has_loss_mask()};
}

int64_t Dataset::doc_length(int64_t d) const {
  const auto& docs = source_->doc_starts();
  return (d + 1 < int64_t(docs.size()) ? docs[d + 1] : source_->num_tokens()) - docs[d];
}

int64_t Dataset::num_windows() const {
  if (packing_.packing == Packing::kSamples) return bins_.size();
  return (num_tokens() + seq_len_ - 1) / seq_len_;
}

// Stream packing: every token is a target unless masked; each window's targets counted once,
// streaming through the mask.
void Dataset::count_stream_targets() {
  stats_.padding = num_windows() * seq_len_ - num_tokens();
  if (!source_->has_loss_mask()) {
    targets_per_epoch_ = num_tokens();
    return;
  }
  window_targets_.resize(num_windows());
  std::vector<int32_t> toks(seq_len_);
  std::vector<uint8_t> mask(seq_len_);
  for (int64_t w = 0; w < num_windows(); ++w) {
    const int64_t start = begin_ + w * seq_len_, n = std::min(seq_len_, end_ - start);
    source_->read(start, n, toks.data(), mask.data());
    window_targets_[w] = std::count(mask.begin(), mask.begin() + n, uint8_t{1});
    targets_per_epoch_ += window_targets_[w];
  }
}

Dataset Dataset::split_tail(double fraction) {
  if (num_documents() < 2)
    SHARDLM_FAIL(ErrorKind::kData,
                 "{}: a held-out split needs at least two documents (blank-line separated); "
                 "give data.valid instead",
                 source_->name());
  // A paired source splits between pairs: counted in pairs, at least one on each side.
  const int64_t unit = paired() ? 2 : 1, items = num_documents() / unit;
  if (items < 2)
    SHARDLM_FAIL(ErrorKind::kData, "{}: a held-out split needs at least two pairs; give data.valid",
                 source_->name());
  int64_t n_tail = std::max<int64_t>(1, std::llround(fraction * double(items)));
  n_tail = std::min<int64_t>(n_tail, items - 1);
  const int64_t cut = end_doc_ - n_tail * unit;
  Dataset tail(source_, seq_len_, eos_id_, cut, end_doc_, packing_);
  *this = Dataset(source_, seq_len_, eos_id_, first_doc_, cut, packing_);
  return tail;
}

std::string Dataset::name() const { return source_->name(); }

int64_t Dataset::window_targets(int64_t w) const {
  if (!window_targets_.empty()) return window_targets_[w];
  return std::min(seq_len_, end_ - (begin_ + w * seq_len_));
}

int64_t Dataset::window_tokens(int64_t w) const {
  if (packing_.packing == Packing::kSamples) return window_tokens_[w];
  return std::min(seq_len_, end_ - (begin_ + w * seq_len_));
}

std::vector<int64_t> Dataset::epoch_order(uint64_t seed, int64_t epoch) const {
  std::vector<int64_t> order;
  epoch_order(seed, epoch, order);
  return order;
}

void Dataset::epoch_order(uint64_t seed, int64_t epoch, std::vector<int64_t>& order) const {
  order.resize(size_t(num_windows()));
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 rng(seed * 1000003ull + static_cast<uint64_t>(epoch));
  std::shuffle(order.begin(), order.end(), rng);
}

// Stream window w into one row: the T tokens from begin_ + w T, each input the token before its
// target. Returns the row's tokens; the rest of the row is the caller's padding.
int64_t Dataset::fill_stream_row(int64_t w, int32_t* tok, int32_t* tgt, int32_t* pos,
                                 int32_t* seg) {
  const int64_t T = seq_len_;
  const int64_t start = begin_ + w * T;
  const int64_t n = std::min(T, end_ - start);
  // tok_buf_[0] is the input before the window's first target.
  if (start == 0) {
    tok_buf_[0] = eos_id_;
    source_->read(0, n, tok_buf_.data() + 1, mask_buf_.data() + 1);
  } else {
    source_->read(start - 1, n + 1, tok_buf_.data(), mask_buf_.data());
  }
  // Document of the first input token (index start - 1; -1 is the virtual <eos>).
  const auto& docs = source_->doc_starts();
  size_t next_doc = size_t(std::upper_bound(docs.begin(), docs.end(), start - 1) - docs.begin());
  int64_t doc = next_doc == 0 ? start - 1 : docs[next_doc - 1];
  for (int64_t t = 0; t < n; ++t) {
    const int64_t i = start - 1 + t;  // stream index of this input token
    while (next_doc < docs.size() && docs[next_doc] <= i) doc = docs[next_doc++];
    tok[t] = tok_buf_[t];
    pos[t] = int32_t(i - doc);
    seg[t] = int32_t(std::max(doc, start - 1) - (start - 1));
    tgt[t] = mask_buf_[t + 1] ? tok_buf_[t + 1] : kIgnoreIndex;
  }
  return n;
}

int64_t Dataset::fill(const std::vector<int64_t>& order, int64_t first, int64_t B,
                      BatchInputs& in) {
  const int64_t T = seq_len_;
  int32_t* tok = in.tokens.i32();
  int32_t* tgt = in.targets.i32();
  int32_t* pos = in.positions.i32();
  int32_t* seg = in.seg_start.i32();
  int64_t valid = 0;
  for (int64_t r = 0; r < B; ++r) {
    const int64_t row = r * T;
    int64_t n = 0;  // positions holding a token
    if (first + r < int64_t(order.size())) {
      const int64_t w = order[first + r];
      n = packing_.packing == Packing::kSamples
              ? fill_samples_row(w, tok + row, tgt + row, pos + row, seg + row)
              : fill_stream_row(w, tok + row, tgt + row, pos + row, seg + row);
    }
    for (int64_t t = 0; t < n; ++t) valid += tgt[row + t] != kIgnoreIndex ? 1 : 0;
    for (int64_t t = n; t < T; ++t) {  // padding: masked, attends only to itself
      tok[row + t] = 0;
      tgt[row + t] = kIgnoreIndex;
      pos[row + t] = 0;
      seg[row + t] = int32_t(t);
    }
  }
  return valid;
}

void Dataset::check_ids(const std::vector<int64_t>& order, int64_t first, int64_t B,
                        const BatchInputs& in, int64_t vocab) const {
  const int64_t T = seq_len_;
  const int32_t* rows[2] = {in.tokens.i32(), in.targets.i32()};
  for (int k = 0; k < 2; ++k) {
    const int32_t* ids = rows[k];
    const bool targets = k == 1;
    for (int64_t i = 0; i < B * T; ++i) {
      const int32_t v = ids[i];
      if ((v >= 0 && v < vocab) || (targets && v == kIgnoreIndex)) [[likely]]
        continue;
      const int64_t r = i / T;
      const std::string window = first + r < int64_t(order.size())
                                     ? fmt::format("window {}", order[size_t(first + r)])
                                     : std::string("a padding row");
      SHARDLM_FAIL(ErrorKind::kData,
                   "{}: {} id {} at position {} of {} (micro-batch position {}) is outside the "
                   "model's vocabulary [0, {}){}; the data and model.vocab_size disagree",
                   name(), targets ? "target" : "token", v, i % T, window, i, vocab,
                   targets ? " and is not the ignore index -1" : "");
    }
  }
}

}  // namespace shardlm
