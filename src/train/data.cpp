// TextDataset: byte-token windows with document boundaries, exact per-epoch coverage.
#include "shardlm/train/data.h"

#include <algorithm>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>

#include "shardlm/core/check.h"

namespace shardlm {

TextDataset::TextDataset(const std::string& path, const Tokenizer& tok, int64_t seq_len)
    : name_(path), seq_len_(seq_len) {
  std::ifstream f(path, std::ios::binary);
  if (!f) SHARDLM_FAIL(ErrorKind::kData, "{}: cannot open the data file", path);
  std::stringstream ss;
  ss << f.rdbuf();
  if (f.bad()) SHARDLM_FAIL(ErrorKind::kData, "{}: read error", path);
  const std::string text = ss.str();
  // Documents: maximal runs of text between blank lines.
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find("\n\n", pos);
    if (end == std::string::npos) end = text.size();
    std::string_view doc(text.data() + pos, end - pos);
    while (!doc.empty() && doc.front() == '\n') doc.remove_prefix(1);
    if (!doc.empty()) {
      doc_starts_.push_back(static_cast<int64_t>(tokens_.size()));
      const auto ids = tok.encode(doc);
      tokens_.insert(tokens_.end(), ids.begin(), ids.end());
      tokens_.push_back(tok.eos_id());
    }
    pos = end + 2;
  }
  if (tokens_.size() < 2)
    SHARDLM_FAIL(ErrorKind::kData, "{}: the data file holds no text to train on", path);
}

TextDataset::TextDataset(std::vector<int32_t> tokens, std::vector<int64_t> doc_starts,
                         int64_t seq_len, std::string name)
    : name_(std::move(name)),
      tokens_(std::move(tokens)),
      doc_starts_(std::move(doc_starts)),
      seq_len_(seq_len) {
  SHARDLM_CHECK(seq_len_ >= 1, "seq_len must be >= 1");
  if (doc_starts_.empty() || doc_starts_.front() != 0) doc_starts_.insert(doc_starts_.begin(), 0);
}

TextDataset TextDataset::split_tail(double fraction) {
  SHARDLM_CHECK_KIND(ErrorKind::kData, doc_starts_.size() >= 2,
                     "{}: a held-out split needs at least two documents (blank-line separated); "
                     "give data.valid instead",
                     name_);
  int64_t n_tail = std::max<int64_t>(1, std::llround(fraction * num_documents()));
  n_tail = std::min<int64_t>(n_tail, num_documents() - 1);
  const int64_t cut_doc = num_documents() - n_tail;
  const int64_t cut = doc_starts_[cut_doc];
  std::vector<int32_t> tail(tokens_.begin() + cut, tokens_.end());
  std::vector<int64_t> tail_docs;
  for (int64_t d = cut_doc; d < num_documents(); ++d) tail_docs.push_back(doc_starts_[d] - cut);
  tokens_.resize(cut);
  doc_starts_.resize(cut_doc);
  return TextDataset(std::move(tail), std::move(tail_docs), seq_len_, name_ + " (held-out tail)");
}

int64_t TextDataset::num_windows() const { return (targets_per_epoch() + seq_len_ - 1) / seq_len_; }

std::vector<int64_t> TextDataset::epoch_order(uint64_t seed, int64_t epoch) const {
  std::vector<int64_t> order(num_windows());
  std::iota(order.begin(), order.end(), 0);
  std::mt19937_64 rng(seed * 1000003ull + static_cast<uint64_t>(epoch));
  std::shuffle(order.begin(), order.end(), rng);
  return order;
}

int64_t TextDataset::fill(const std::vector<int64_t>& order, int64_t first, int64_t B,
                          BatchInputs& in) const {
  const int64_t T = seq_len_, n = num_tokens();
  int32_t* tok = in.tokens.i32();
  int32_t* tgt = in.targets.i32();
  int32_t* pos = in.positions.i32();
  int32_t* seg = in.seg_start.i32();
  int64_t valid = 0;
  for (int64_t r = 0; r < B; ++r) {
    const int64_t row = r * T;
    if (first + r >= static_cast<int64_t>(order.size())) {
      for (int64_t t = 0; t < T; ++t) {
        tok[row + t] = 0;
        tgt[row + t] = kIgnoreIndex;
        pos[row + t] = static_cast<int32_t>(t);
        seg[row + t] = 0;
      }
      continue;
    }
    const int64_t start = order[first + r] * T;
    // Document containing `start`: the last doc start <= start.
    auto it = std::upper_bound(doc_starts_.begin(), doc_starts_.end(), start);
    size_t next_doc = static_cast<size_t>(it - doc_starts_.begin());
    int64_t doc = *(it - 1);
    for (int64_t t = 0; t < T; ++t) {
      const int64_t i = start + t;
      if (i >= n) {
        // Past the stream's end: pad and mask.
        tok[row + t] = 0;
        tgt[row + t] = kIgnoreIndex;
        pos[row + t] = static_cast<int32_t>(t);
        seg[row + t] = static_cast<int32_t>(t);
        continue;
      }
      while (next_doc < doc_starts_.size() && doc_starts_[next_doc] <= i)
        doc = doc_starts_[next_doc++];
      tok[row + t] = tokens_[i];
      pos[row + t] = static_cast<int32_t>(i - doc);
      seg[row + t] = static_cast<int32_t>(std::max(doc, start) - start);
      if (i + 1 < n) {
        tgt[row + t] = tokens_[i + 1];
        ++valid;
      } else {
        tgt[row + t] = kIgnoreIndex;
      }
    }
  }
  return valid;
}

}  // namespace shardlm
