// TextDataset: a text file as a stream of byte tokens, split into documents at blank lines,
// packed into fixed windows of T tokens, and served as micro-batches with exact epoch
// accounting: every token is a target exactly once per epoch; the last partial window and
// the last partial batch are padded and masked (kIgnoreIndex), never dropped.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "shardlm/io/tokenizer.h"
#include "shardlm/model/llama.h"

namespace shardlm {

class TextDataset {
 public:
  // Reads `path` whole (a corpus for the CPU engine; the sharded token format streams).
  // Throws Error(kData) naming the file when it cannot be read or is empty.
  // Documents are separated by one or more blank lines; each is followed by <eos>.
  TextDataset(const std::string& path, const Tokenizer& tok, int64_t seq_len);
  // From tokens and document starts directly (tests, held-out splits).
  TextDataset(std::vector<int32_t> tokens, std::vector<int64_t> doc_starts, int64_t seq_len,
              std::string name);

  // Splits off the last `fraction` of documents (at least one, if there are two or more)
  // as a held-out set; this set keeps the rest.
  TextDataset split_tail(double fraction);

  const std::string& name() const { return name_; }
  int64_t num_tokens() const { return static_cast<int64_t>(tokens_.size()); }
  int64_t num_documents() const { return static_cast<int64_t>(doc_starts_.size()); }
  // Target tokens per epoch: every token but the first of the stream is a target once.
  int64_t targets_per_epoch() const { return num_tokens() - 1; }
  int64_t num_windows() const;
  int64_t seq_len() const { return seq_len_; }

  // Fills rows [0, B) of `in` with windows order[first .. first+B) (rows past the end of
  // `order` are fully masked). Returns the number of non-ignored targets written.
  int64_t fill(const std::vector<int64_t>& order, int64_t first, int64_t B, BatchInputs& in) const;

  // The window order of an epoch: a seeded shuffle (deterministic for (seed, epoch)).
  std::vector<int64_t> epoch_order(uint64_t seed, int64_t epoch) const;

 private:
  std::string name_;
  std::vector<int32_t> tokens_;
  std::vector<int64_t> doc_starts_;  // sorted token indices where documents begin
  int64_t seq_len_ = 0;
};

}  // namespace shardlm
