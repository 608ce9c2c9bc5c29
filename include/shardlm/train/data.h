// Training data: a token stream with document starts and an optional loss mask (from a text or
// record file tokenized in memory, or from a token-shard corpus mapped from disk), packed into
// windows of T tokens and served as micro-batches with exact epoch accounting.
//
// Two packings (data.packing):
//  - stream: the stream cut every T tokens. Every token is a target exactly once per epoch (the
//    first token's input is a virtual <eos>, the end of "the previous document"), unless its
//    loss mask is 0; a document crossing a window boundary continues in the next window, its
//    first part unseen there (pre-training text).
//  - samples: whole documents placed into windows by best-fit decreasing (longest first, each
//    into the window it fills most; a new window when none has room), the rest of each window
//    padding. A document of n tokens is trained as it is alone: inputs x_0 .. x_{n-1} at
//    positions 0 .. n-1, targets x_1 .. x_{n-1} where their mask is 1 (its first token is never
//    a target). A document longer than T is truncated to its first T tokens, dropped, or an
//    error (data.overlong), and counted. The windows are fixed by the documents' lengths; each
//    epoch visits them in a seeded order, so every sample is seen once per epoch.
//    A paired source (preference records) packs pairs: one item of both documents' lengths,
//    chosen then rejected side by side in one window, each as if alone. A pair longer than T
//    is an error or dropped by data.overlong; "truncate" cuts both sequences to their first m
//    tokens, the largest m that fits them in T (TRL's keep_start truncation at max_length m),
//    and drops the pair when that leaves either sequence without a target.
// Either way the last window and the last step of an epoch are padded and masked
// (kIgnoreIndex), never dropped, attention never crosses a document (each input row carries
// its document's start) and positions restart at 0 in every document.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shardlm/io/records.h"
#include "shardlm/io/tokenizer.h"
#include "shardlm/model/llama.h"
#include "shardlm/plan/plan.h"

namespace shardlm {

class TokenSource {
 public:
  virtual ~TokenSource() = default;
  virtual const std::string& name() const = 0;
  virtual int64_t num_tokens() const = 0;
  virtual const std::vector<int64_t>& doc_starts() const = 0;  // ascending, first is 0
  virtual bool has_loss_mask() const = 0;
  // Preference pairs: documents 2k and 2k + 1 are pair k's chosen and rejected sequences.
  virtual bool paired() const { return false; }
  // tokens [begin, begin + n) into out; mask (1 = a training target) when not null.
  virtual void read(int64_t begin, int64_t n, int32_t* out, uint8_t* mask) const = 0;
  // The host memory it holds (its containers'; a mapped corpus's pages are the page cache's),
  // and what the plan says of it from its sizes (plan.h): the two agree.
  virtual int64_t host_bytes() const = 0;
  virtual int64_t planned_host_bytes() const = 0;
};

// A text file tokenized whole in memory: documents at blank lines, each followed by <eos>.
// Throws Error(kData) naming the file when it is unreadable or holds no text.
std::shared_ptr<TokenSource> load_text_source(const std::string& path, const Tokenizer& tok);
// Tokens and document starts given directly (tests).
std::shared_ptr<TokenSource> make_memory_source(std::vector<int32_t> tokens,
                                                std::vector<int64_t> doc_starts, std::string name,
                                                std::vector<uint8_t> mask = {},
                                                bool paired = false);
// A token-shard corpus directory (`shardlm tokenize` output); checksums are verified once.
std::shared_ptr<TokenSource> load_corpus_source(const std::string& path);
// A .jsonl / .json file of records (records.h) tokenized whole in memory by the reader
// `shardlm tokenize` uses (read_documents), in the same documents; its describe_file line (with
// any skipped bad records) goes to `log`. Errors as read_documents. Preference records make a
// paired source; a file mixing them with other records is Error(kData).
std::shared_ptr<TokenSource> load_record_source(const std::string& path, const Tokenizer& tok,
                                                const RecordOptions& options, std::ostream& log);
// A directory is a corpus, a .jsonl / .json file records (load_record_source, logging to `log`
// when given), anything else a text file.
std::shared_ptr<TokenSource> open_source(const std::string& path, const Tokenizer& tok,
                                         const RecordOptions& records = {},
                                         std::ostream* log = nullptr);

enum class Packing { kStream, kSamples };
enum class Overlong { kTruncate, kDrop, kError };

struct PackingOptions {
  Packing packing = Packing::kStream;
  Overlong overlong = Overlong::kTruncate;
};

// data.packing and data.overlong as options: "auto" is samples when `source` has a loss mask
// (chat and instruction records), stream otherwise.
PackingOptions packing_options(const std::string& packing, const std::string& overlong,
                               const TokenSource& source);
std::string_view packing_name(Packing p);

// Best-fit decreasing: items of lengths in [1, capacity] into bins of `capacity`. Items are
// taken longest first (equal lengths by index); each goes into the open bin with the least room
// that still holds it, or a new bin. Bin b holds items[offsets[b] .. offsets[b + 1]), in the
// order they were placed; bins are numbered as they were opened.
struct PackedBins {
  std::vector<int64_t> offsets;  // [bins + 1]
  std::vector<int64_t> items;    // [items] indices into `lengths`
  int64_t size() const { return int64_t(offsets.size()) - 1; }
};
PackedBins pack_best_fit_decreasing(const std::vector<int64_t>& lengths, int64_t capacity);

// What samples packing did with a Dataset's documents (zeros under stream, but padding).
struct PackingStats {
  int64_t samples = 0;           // documents placed in windows
  int64_t truncated = 0;         // documents longer than T cut to T tokens
  int64_t dropped = 0;           // documents longer than T left out
  int64_t overlong_tokens = 0;   // tokens of the truncated documents cut, or of the dropped ones
  int64_t overlong_targets = 0;  // of which targets (mask 1, after a document's first token)
  int64_t padding = 0;           // positions of all windows holding no token, per epoch
};

class Dataset {
 public:
  // The documents [first_doc, end_doc) of `source` (end_doc = -1: to the end). eos_id is
  // the input that predicts the stream's very first token (stream packing). Throws Error(kData)
  // naming the document under Overlong::kError, and when nothing is left to train on.
  Dataset(std::shared_ptr<TokenSource> source, int64_t seq_len, int32_t eos_id,
          int64_t first_doc = 0, int64_t end_doc = -1, PackingOptions packing = {});

  // Splits off the last `fraction` of documents (at least one; at least one stays) as a
  // held-out set; this set keeps the rest.
  Dataset split_tail(double fraction);

  std::string name() const;
  int64_t num_tokens() const { return end_ - begin_; }
  int64_t num_documents() const { return end_doc_ - first_doc_; }
  int64_t seq_len() const { return seq_len_; }
  const PackingOptions& packing() const { return packing_; }
  const PackingStats& packing_stats() const { return stats_; }
  int64_t num_windows() const;
  // Target tokens per epoch: stream, every token whose loss mask is 1 (all of them without a
  // mask); samples, those of the documents' tokens after their first.
  int64_t targets_per_epoch() const { return targets_per_epoch_; }

  // The window order of an epoch: a seeded shuffle, the same for the same (seed, epoch).
  std::vector<int64_t> epoch_order(uint64_t seed, int64_t epoch) const;
  // The same into `order`, resized to the windows (no allocation when it already holds them).
  void epoch_order(uint64_t seed, int64_t epoch, std::vector<int64_t>& order) const;
  // Target tokens of window w (what fill() will count for it).
  int64_t window_targets(int64_t w) const;
  // Positions of window w that hold a token (the rest is padding).
  int64_t window_tokens(int64_t w) const;

  // Fills rows [0, B) with windows order[first .. first+B); rows past the end of `order` are
  // fully masked. Returns the number of targets written.
  int64_t fill(const std::vector<int64_t>& order, int64_t first, int64_t B, BatchInputs& in);
  // Checks rows [0, B) of `in` as fill(order, first, B, in) wrote them against a model of
  // `vocab` ids: every token in [0, vocab), every target there or kIgnoreIndex; the first id
  // outside (tokens before targets, by position) is Error(kData) naming the source, the window,
  // the position in it and in the micro-batch, and the value. The trainer checks each
  // micro-batch here, on the host, before its inputs go up: a device that checks ids only
  // with a later result read would otherwise run a step with the bad ids left out.
  void check_ids(const std::vector<int64_t>& order, int64_t first, int64_t B, const BatchInputs& in,
                 int64_t vocab) const;

  // Samples packing: the lengths of window w's documents in the order fill() places them from
  // the row's start (a pair's chosen then rejected).
  std::vector<int64_t> window_documents(int64_t w) const;
  // The same without a container: how many (a pair counts two), and the i-th one's length.
  int64_t window_document_count(int64_t w) const;
  int64_t window_document_length(int64_t w, int64_t i) const;
  bool paired() const { return source_->paired(); }
  const TokenSource& source() const { return *source_; }

  // The host memory the set holds besides its source (its containers'), and what the plan says
  // of it from the set's sizes (plan.h's data_set_host_bytes): the two agree.
  int64_t host_bytes() const;
  DataSetSizes host_sizes() const;

 private:
  int64_t doc_length(int64_t d) const;
  int64_t kept_length(int64_t d) const;  // its tokens in a window (cut to T or a pair's m)
  void pack_pairs(std::vector<int64_t>& lengths, std::vector<int64_t>& doc_of,
                  std::vector<int64_t>& targets);
  int64_t doc_targets(int64_t d, int64_t keep);  // targets of its first `keep` tokens
  void count_stream_targets();
  void pack_samples();
  int64_t fill_stream_row(int64_t w, int32_t* tok, int32_t* tgt, int32_t* pos, int32_t* seg);
  int64_t fill_samples_row(int64_t w, int32_t* tok, int32_t* tgt, int32_t* pos, int32_t* seg);

  std::shared_ptr<TokenSource> source_;
  int64_t seq_len_;
  int32_t eos_id_;
  PackingOptions packing_;
  int64_t first_doc_, end_doc_;  // document range
  int64_t begin_, end_;          // token range
  int64_t targets_per_epoch_ = 0;
  PackingStats stats_;
  std::vector<int64_t> window_targets_;  // [num_windows] (stream: masked corpora only)
  std::vector<int64_t> window_tokens_;   // [num_windows] (samples)
  PackedBins bins_;                      // samples: documents (source indices) per window
  std::vector<int64_t> pair_keep_;       // paired: each pair's tokens kept per sequence (m)
  std::vector<int32_t> tok_buf_;         // [T + 1] scratch for fill()
  std::vector<uint8_t> mask_buf_;        // [T + 1]
};

// One line on how `data` is packed: the packing, windows, padding per epoch and, under samples,
// the documents longer than T and what became of them.
std::string packing_line(const Dataset& data);

}  // namespace shardlm
