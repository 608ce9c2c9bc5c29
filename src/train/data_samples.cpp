// Samples packing (train/data.h): whole documents into windows by best-fit decreasing, the
// overlong rule, the packing's accounting, and a window's rows; data.packing's "auto".
#include <algorithm>
#include <numeric>
#include <set>
#include <utility>

#include <fmt/format.h>

#include "shardlm/core/check.h"
#include "shardlm/train/data.h"

namespace shardlm {

PackingOptions packing_options(const std::string& packing, const std::string& overlong,
                               const TokenSource& source) {
  PackingOptions o;
  if (packing == "samples" || (packing == "auto" && source.has_loss_mask()))
    o.packing = Packing::kSamples;
  else
    SHARDLM_CHECK(packing == "stream" || packing == "auto", "data.packing \"{}\"", packing);
  if (overlong == "drop")
    o.overlong = Overlong::kDrop;
  else if (overlong == "error")
    o.overlong = Overlong::kError;
  else
    SHARDLM_CHECK(overlong == "truncate", "data.overlong \"{}\"", overlong);
  return o;
}

std::string_view packing_name(Packing p) { return p == Packing::kSamples ? "samples" : "stream"; }

std::string packing_line(const Dataset& data) {
  const PackingStats& st = data.packing_stats();
  const int64_t positions = data.num_windows() * data.seq_len();
  const std::string padding =
      fmt::format("padding {} of {} positions per epoch ({:.1f}%)", st.padding, positions,
                  positions > 0 ? 100.0 * double(st.padding) / double(positions) : 0.0);
  if (data.packing().packing == Packing::kStream)
    return "packing: stream (documents continue across windows); " + padding;
  std::string overlong = fmt::format("none longer than data.seq_len = {}", data.seq_len());
  if (st.truncated + st.dropped > 0)
    overlong = fmt::format("{} longer than data.seq_len = {} {} ({} tokens, {} targets)",
                           st.truncated + st.dropped, data.seq_len(),
                           st.truncated > 0 ? "truncated" : "dropped", st.overlong_tokens,
                           st.overlong_targets);
  return fmt::format(
      "packing: samples: {} documents whole in {} windows (best-fit decreasing); "
      "{}; {}",
      st.samples, data.num_windows(), padding, overlong);
}

PackedBins pack_best_fit_decreasing(const std::vector<int64_t>& lengths, int64_t capacity) {
  const int64_t n = int64_t(lengths.size());
  std::vector<int64_t> by_length(size_t(n), 0);
  std::iota(by_length.begin(), by_length.end(), int64_t{0});
  std::stable_sort(by_length.begin(), by_length.end(),
                   [&](int64_t a, int64_t b) { return lengths[a] > lengths[b]; });
  // Open bins by (room left, bin): the first with room >= the item's length is the best fit.
  std::set<std::pair<int64_t, int64_t>> open;
  std::vector<int64_t> bin_of(size_t(n), 0);
  int64_t bins = 0;
  for (const int64_t i : by_length) {
    const int64_t len = lengths[i];
    SHARDLM_CHECK(len >= 1 && len <= capacity, "item {} of length {} into bins of {}", i, len,
                  capacity);
    auto it = open.lower_bound({len, int64_t{-1}});
    int64_t bin = 0, room = 0;
    if (it == open.end()) {
      bin = bins++;
      room = capacity;
    } else {
      std::tie(room, bin) = *it;
      open.erase(it);
    }
    bin_of[i] = bin;
    if (room - len > 0) open.insert({room - len, bin});
  }
  // Counting sort by bin, keeping the placement order within each.
  PackedBins out;
  out.offsets.assign(size_t(bins + 1), 0);
  for (const int64_t i : by_length) ++out.offsets[bin_of[i] + 1];
  std::partial_sum(out.offsets.begin(), out.offsets.end(), out.offsets.begin());
  out.items.resize(size_t(n));
  std::vector<int64_t> next(out.offsets.begin(), out.offsets.end() - 1);
  for (const int64_t i : by_length) out.items[next[bin_of[i]]++] = i;
  return out;
}

// Targets among document d's first `keep` tokens: its mask's 1s after its first token (every
// token after the first without a mask).
int64_t Dataset::doc_targets(int64_t d, int64_t keep) {
  if (!source_->has_loss_mask()) return keep - 1;
  const int64_t n = doc_length(d);
  tok_buf_.resize(size_t(std::max<int64_t>(n, seq_len_ + 1)));
  mask_buf_.resize(tok_buf_.size());
  source_->read(source_->doc_starts()[d], n, tok_buf_.data(), mask_buf_.data());
  return std::count(mask_buf_.begin() + 1, mask_buf_.begin() + keep, uint8_t{1});
}

// Pairs (documents d, d + 1) as items of both lengths; an overlong pair by data.overlong, its
// two sequences cut to the largest common length m that fits T under "truncate".
void Dataset::pack_pairs(std::vector<int64_t>& lengths, std::vector<int64_t>& doc_of,
                         std::vector<int64_t>& targets) {
  const int64_t T = seq_len_;
  pair_keep_.assign(size_t((end_doc_ - first_doc_) / 2), 0);
  for (int64_t d = first_doc_; d < end_doc_; d += 2) {
    const int64_t c = doc_length(d), r = doc_length(d + 1);
    // A sequence takes at least one token of its row: B rows hold at most B * T sequences,
    // the bound the preference step's buffers are sized by (plan/preference_step.h).
    if (c == 0 || r == 0)
      SHARDLM_FAIL(ErrorKind::kData, "{}: preference pair {} has an empty {} sequence",
                   source_->name(), d / 2, c == 0 ? "chosen" : "rejected");
    int64_t m = std::max(c, r);
    if (c + r > T) {
      if (packing_.overlong == Overlong::kError)
        SHARDLM_FAIL(ErrorKind::kData,
                     "{}: preference pair {} has {} + {} tokens, more than data.seq_len = {}; set "
                     "data.overlong = \"truncate\" or \"drop\", or a longer data.seq_len",
                     source_->name(), d / 2, c, r, T);
      // the largest m with min(c, m) + min(r, m) <= T
      m = std::min(c, r) * 2 <= T ? T - std::min(c, r) : T / 2;
    }
    const int64_t kc = std::min(c, m), kr = std::min(r, m);
    const int64_t tc = doc_targets(d, kc), tr = doc_targets(d + 1, kr);
    const bool drop = c + r > T && (packing_.overlong == Overlong::kDrop || tc == 0 || tr == 0);
    if (c + r > T) {
      (drop ? stats_.dropped : stats_.truncated) += 1;
      stats_.overlong_tokens += drop ? c + r : c + r - kc - kr;
      stats_.overlong_targets += drop ? doc_targets(d, c) + doc_targets(d + 1, r)
                                      : doc_targets(d, c) - tc + doc_targets(d + 1, r) - tr;
      if (drop) continue;
    }
    pair_keep_[size_t((d - first_doc_) / 2)] = m;
    lengths.push_back(kc + kr);
    doc_of.push_back(d);
    targets.push_back(tc + tr);
  }
}

// The documents' lengths (cut to T, or left out by data.overlong), their windows, and each
// window's tokens and targets: one pass over the documents (reading the mask when there is one).
void Dataset::pack_samples() {
  const int64_t T = seq_len_;
  std::vector<int64_t> lengths, doc_of;  // placed items: length in the window, source index
  std::vector<int64_t> targets;          // [placed] targets of each
  if (source_->paired()) pack_pairs(lengths, doc_of, targets);
  for (int64_t d = first_doc_; d < end_doc_ && !source_->paired(); ++d) {
    const int64_t n = doc_length(d);
    if (n > T && packing_.overlong == Overlong::kError)
      SHARDLM_FAIL(ErrorKind::kData,
                   "{}: document {} has {} tokens, more than data.seq_len = {}; set "
                   "data.overlong = \"truncate\" or \"drop\", or a longer data.seq_len",
                   source_->name(), d, n, T);
    const int64_t kept_targets = doc_targets(d, std::min(n, T));
    if (n > T) {
      const int64_t all_targets = doc_targets(d, n);
      const bool drop = packing_.overlong == Overlong::kDrop;
      (drop ? stats_.dropped : stats_.truncated) += 1;
      stats_.overlong_tokens += drop ? n : n - T;
      stats_.overlong_targets += drop ? all_targets : all_targets - kept_targets;
      if (drop) continue;
    }
    lengths.push_back(std::min(n, T));
    doc_of.push_back(d);
    targets.push_back(kept_targets);
  }
  if (lengths.empty())
    SHARDLM_FAIL(ErrorKind::kData,
                 "{}: every {} is longer than data.seq_len = {} and data.overlong left none to "
                 "train on",
                 source_->name(), source_->paired() ? "preference pair" : "document", T);
  bins_ = pack_best_fit_decreasing(lengths, T);
  stats_.samples = int64_t(lengths.size());
  window_targets_.assign(size_t(bins_.size()), 0);
  window_tokens_.assign(size_t(bins_.size()), 0);
  for (int64_t b = 0; b < bins_.size(); ++b) {
    for (int64_t k = bins_.offsets[b]; k < bins_.offsets[b + 1]; ++k) {
      const int64_t i = bins_.items[k];
      window_tokens_[b] += lengths[i];
      window_targets_[b] += targets[i];
      bins_.items[k] = doc_of[i];  // the window's items, by their (first) document's index
    }
    stats_.padding += T - window_tokens_[b];
    targets_per_epoch_ += window_targets_[b];
  }
}

int64_t Dataset::kept_length(int64_t d) const {
  const int64_t n = doc_length(d);
  if (!source_->paired()) return std::min(n, seq_len_);
  return std::min(n, pair_keep_[size_t((d - first_doc_) / 2)]);
}

std::vector<int64_t> Dataset::window_documents(int64_t w) const {
  std::vector<int64_t> out(size_t(window_document_count(w)));
  for (size_t i = 0; i < out.size(); ++i) out[i] = window_document_length(w, int64_t(i));
  return out;
}

int64_t Dataset::window_document_count(int64_t w) const {
  return (bins_.offsets[w + 1] - bins_.offsets[w]) * (source_->paired() ? 2 : 1);
}

// Document i of window w: a bin item's document, or under a paired source item i / 2's
// chosen (i even) or rejected (i odd) one.
int64_t Dataset::window_document_length(int64_t w, int64_t i) const {
  const int64_t per_item = source_->paired() ? 2 : 1;
  return kept_length(bins_.items[bins_.offsets[w] + i / per_item] + i % per_item);
}

// Samples window w into one row: each document as if alone (positions from 0, its own start),
// its first min(length, T) tokens; its last token's input predicts nothing. Returns the tokens.
int64_t Dataset::fill_samples_row(int64_t w, int32_t* tok, int32_t* tgt, int32_t* pos,
                                  int32_t* seg) {
  const int64_t T = seq_len_;
  int64_t at = 0;
  for (int64_t k = bins_.offsets[w]; k < bins_.offsets[w + 1]; ++k) {
    const int64_t first = bins_.items[k];
    for (int64_t d = first; d < first + (source_->paired() ? 2 : 1); ++d) {
      const int64_t n = kept_length(d);
      SHARDLM_CHECK(at + n <= T, "window {} overfull", w);
      source_->read(source_->doc_starts()[d], n, tok_buf_.data(), mask_buf_.data());
      for (int64_t j = 0; j < n; ++j) {
        tok[at + j] = tok_buf_[j];
        pos[at + j] = int32_t(j);
        seg[at + j] = int32_t(at);
        tgt[at + j] = j + 1 < n && mask_buf_[j + 1] ? tok_buf_[j + 1] : kIgnoreIndex;
      }
      at += n;
    }
  }
  return at;
}

}  // namespace shardlm
