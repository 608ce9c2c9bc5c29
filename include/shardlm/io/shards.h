// Token shards: the on-disk corpus format written by `shardlm tokenize` and read by the
// data loader. A corpus directory holds index.json and shard_NNNNN.bin files; each shard is
//   header (64 bytes, little endian): magic "SHLMTOK1", u32 version, u32 token width in bytes
//     (2 or 4), u64 n_tokens, u64 n_docs, u32 flags (bit 0: has a loss mask), u32 crc32 of
//     everything after the header, u64 reserved x 2
//   tokens [n_tokens] (u16 or u32)
//   doc_offsets [n_docs + 1] u64 (token index where each document starts; last = n_tokens)
//   loss_mask [n_tokens] u8 when flagged (1 = the token is a training target)
// Reading maps the files (memory independent of corpus size); every header, size and offset
// is validated and a bad shard is Error(kData) naming the file, never a crash.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace shardlm {

struct CorpusInfo {
  std::string tokenizer;  // "byte" or a tokenizer file's name
  int64_t vocab_size = 0;
  int64_t n_tokens = 0;
  int64_t n_docs = 0;
  bool has_loss_mask = false;
};

// Streams documents into shards of at most max_shard_tokens tokens.
class ShardWriter {
 public:
  ShardWriter(const std::string& dir, const std::string& tokenizer, int64_t vocab_size,
              int64_t max_shard_tokens = int64_t(1) << 28);
  ~ShardWriter();
  // mask: empty (every token is a target) or one byte per token.
  void add_document(const int32_t* tokens, int64_t n, const uint8_t* mask = nullptr);
  // Writes the last shard and index.json; returns the totals.
  CorpusInfo finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A read-only view of a corpus directory (or of one shard file).
class TokenCorpus {
 public:
  explicit TokenCorpus(const std::string& path);
  ~TokenCorpus();
  TokenCorpus(TokenCorpus&&) noexcept;

  const CorpusInfo& info() const;
  // Copies tokens [begin, begin + n) of the whole corpus (shards concatenated) into out,
  // and the loss mask into mask (1s when the corpus has none) when mask is not null.
  void read(int64_t begin, int64_t n, int32_t* out, uint8_t* mask) const;
  // Start token of every document, ascending, in corpus coordinates.
  const std::vector<int64_t>& doc_starts() const;
  // Fully re-reads the payloads and checks every shard's CRC-32 (kData naming the file).
  void verify_checksums() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardlm
