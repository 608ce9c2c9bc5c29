// Token shards: the on-disk corpus format written by `shardlm tokenize` and read by the
// data loader. A corpus directory holds index.json and shard_NNNNN.bin files; each shard is
//   header (64 bytes, little endian): magic "SHLMTOK1", u32 version (1), u32 token width in
//     bytes (2 when vocab_size <= 65536, else 4), u64 n_tokens, u64 n_docs, u32 flags (bit 0:
//     has a loss mask; other bits 0), u32 crc32 (zlib) of everything after the header,
//     u64 vocab_size, u64 reserved x 2 (0)
//   tokens [n_tokens] (u16 or u32)
//   doc_offsets [n_docs + 1] u64 (token index where each document starts; strictly
//     ascending: documents are never empty; first = 0, last = n_tokens)
//   loss_mask [n_tokens] u8 when flagged (1 = the token is a training target, else 0)
// The file is exactly that long. A document never spans shards; a shard holds at most
// max_shard_tokens tokens unless one document is longer (then it gets a shard of its own).
// The mask flag is per shard: a shard has a mask when any of its documents has one, and the
// corpus has one (index.json "has_loss_mask") when any shard has; shards without a mask read
// as all 1s. index.json (written last, after every shard is fsynced and renamed):
//   {"format": "shardlm-tokens", "version": 1, "tokenizer", "vocab_size", "token_bytes",
//    "n_tokens", "n_docs", "has_loss_mask",
//    "shards": [{"file", "n_tokens", "n_docs", "has_loss_mask"}, ...]}
// Reading maps the files (memory independent of corpus size, apart from the document
// starts); every header field, size and offset is validated and a bad shard is Error(kData)
// naming the file, never a crash.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace shardlm {

struct CorpusInfo {
  std::string tokenizer;  // "byte" or a tokenizer file's name ("" for a lone shard file)
  int64_t vocab_size = 0;
  int64_t n_tokens = 0;
  int64_t n_docs = 0;
  bool has_loss_mask = false;
};

// Streams documents into shards of at most max_shard_tokens tokens. Tokens go to a temporary
// file as they come (the mask to a side file), so memory is a few I/O buffers plus one
// shard's document offsets. Each shard is fsynced and renamed into place when full; the
// constructor removes an earlier corpus's index.json and shard files from `dir`. Errors
// writing are Error(kData) naming the file; a writer destroyed before finish() leaves no
// index.json (and so no readable corpus).
class ShardWriter {
 public:
  ShardWriter(const std::string& dir, const std::string& tokenizer, int64_t vocab_size,
              int64_t max_shard_tokens = int64_t(1) << 28);
  ~ShardWriter();
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;
  // n >= 1 token ids in [0, vocab_size). mask: null (every token is a target) or n bytes of
  // 0/1.
  void add_document(const int32_t* tokens, int64_t n, const uint8_t* mask = nullptr);
  // Writes the last shard and index.json; returns the totals.
  CorpusInfo finish();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A read-only view of a corpus directory (with index.json) or of one shard file. Opening
// checks every header, file size and document offset (and the shards against index.json);
// payload checksums are left to verify_checksums(), which the data loader calls once at
// start. Token ids and mask bytes are range-checked as read() copies them.
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
  int64_t num_shards() const;
  // The host memory it holds: its document starts and its shards' first tokens (the shards'
  // tokens and masks are mapped: their pages are the kernel's page cache, not counted).
  int64_t host_bytes() const;
  // Fully re-reads the payloads and checks every shard's CRC-32 (kData naming the file).
  void verify_checksums() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardlm
