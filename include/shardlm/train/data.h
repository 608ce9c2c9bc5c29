// Training data: a token stream with document starts and an optional loss mask (from a text or
// record file tokenized in memory, or from a token-shard corpus mapped from disk), packed into
// windows of T tokens and served as micro-batches with exact epoch accounting.
//
// Every token of the stream is a target exactly once per epoch (the first token's input is a
// virtual <eos>, the end of "the previous document"), unless its loss mask is 0. The last
// window and the last step of an epoch are padded and masked (kIgnoreIndex), never dropped.
// Attention never crosses a document: each input row carries its document's start, and
// positions restart at 0 in every document.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "shardlm/io/records.h"
#include "shardlm/io/tokenizer.h"
#include "shardlm/model/llama.h"

namespace shardlm {

class TokenSource {
 public:
  virtual ~TokenSource() = default;
  virtual const std::string& name() const = 0;
  virtual int64_t num_tokens() const = 0;
  virtual const std::vector<int64_t>& doc_starts() const = 0;  // ascending, first is 0
  virtual bool has_loss_mask() const = 0;
  // tokens [begin, begin + n) into out; mask (1 = a training target) when not null.
  virtual void read(int64_t begin, int64_t n, int32_t* out, uint8_t* mask) const = 0;
};

// A text file tokenized whole in memory: documents at blank lines, each followed by <eos>.
// Throws Error(kData) naming the file when it is unreadable or holds no text.
std::shared_ptr<TokenSource> load_text_source(const std::string& path, const Tokenizer& tok);
// Tokens and document starts given directly (tests).
std::shared_ptr<TokenSource> make_memory_source(std::vector<int32_t> tokens,
                                                std::vector<int64_t> doc_starts, std::string name,
                                                std::vector<uint8_t> mask = {});
// A token-shard corpus directory (`shardlm tokenize` output); checksums are verified once.
std::shared_ptr<TokenSource> load_corpus_source(const std::string& path);
// A .jsonl / .json file of records (records.h) tokenized whole in memory by the reader
// `shardlm tokenize` uses (read_documents), in the same documents; its describe_file line (with
// any skipped bad records) goes to `log`. Errors as read_documents.
std::shared_ptr<TokenSource> load_record_source(const std::string& path, const Tokenizer& tok,
                                                const RecordOptions& options, std::ostream& log);
// A directory is a corpus, a .jsonl / .json file records (load_record_source, logging to `log`
// when given), anything else a text file.
std::shared_ptr<TokenSource> open_source(const std::string& path, const Tokenizer& tok,
                                         const RecordOptions& records = {},
                                         std::ostream* log = nullptr);

class Dataset {
 public:
  // The documents [first_doc, end_doc) of `source` (end_doc = -1: to the end). eos_id is
  // the input that predicts the stream's very first token.
  Dataset(std::shared_ptr<TokenSource> source, int64_t seq_len, int32_t eos_id,
          int64_t first_doc = 0, int64_t end_doc = -1);

  // Splits off the last `fraction` of documents (at least one; at least one stays) as a
  // held-out set; this set keeps the rest.
  Dataset split_tail(double fraction);

  std::string name() const;
  int64_t num_tokens() const { return end_ - begin_; }
  int64_t num_documents() const { return end_doc_ - first_doc_; }
  int64_t seq_len() const { return seq_len_; }
  int64_t num_windows() const { return (num_tokens() + seq_len_ - 1) / seq_len_; }
  // Target tokens per epoch: every token whose loss mask is 1 (all of them without a mask).
  int64_t targets_per_epoch() const { return targets_per_epoch_; }

  // The window order of an epoch: a seeded shuffle, the same for the same (seed, epoch).
  std::vector<int64_t> epoch_order(uint64_t seed, int64_t epoch) const;
  // Target tokens of window w (what fill() will count for it).
  int64_t window_targets(int64_t w) const;

  // Fills rows [0, B) with windows order[first .. first+B); rows past the end of `order` are
  // fully masked. Returns the number of targets written.
  int64_t fill(const std::vector<int64_t>& order, int64_t first, int64_t B, BatchInputs& in);

 private:
  std::shared_ptr<TokenSource> source_;
  int64_t seq_len_;
  int32_t eos_id_;
  int64_t first_doc_, end_doc_;  // document range
  int64_t begin_, end_;          // token range
  int64_t targets_per_epoch_ = 0;
  std::vector<int64_t> window_targets_;  // [num_windows] (masked corpora only)
  std::vector<int32_t> tok_buf_;         // [T + 1] scratch for fill()
  std::vector<uint8_t> mask_buf_;        // [T + 1]
};

}  // namespace shardlm
