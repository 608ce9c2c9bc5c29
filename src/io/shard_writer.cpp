// ShardWriter: streams documents into token shards (shardlm/io/shards.h). Tokens go to a
// temporary file as they come, the loss mask to a side file; each finished shard is fsynced
// and renamed into place, and index.json is written last, so that a crash never leaves an
// index that names a partial shard.
#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>

#include "posix_file.h"
#include "shard_format.h"
#include "shardlm/io/shards.h"

namespace shardlm {

using namespace shard_format;
namespace fs = std::filesystem;

namespace {

// A file being written under a temporary name: buffered appends (with a running CRC-32 of
// what was appended), positioned writes, and commit() = fsync + rename. Destroyed without
// commit, it removes itself.
class TempFile {
 public:
  TempFile(std::string path, uint64_t first_append_offset)
      : path_(std::move(path)),
        fd_(posix::open_file(path_, O_RDWR | O_CREAT | O_TRUNC)),
        pos_(first_append_offset) {
    buf_.reserve(kIoBlock);
  }
  ~TempFile() {
    fd_ = posix::UniqueFd();
    if (!committed_) ::unlink(path_.c_str());
  }
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  void append(const uint8_t* p, size_t n) {
    while (n > 0) {
      const size_t k = std::min(n, kIoBlock - buf_.size());
      buf_.insert(buf_.end(), p, p + k);
      p += k;
      n -= k;
      if (buf_.size() == kIoBlock) flush();
    }
  }
  void append_repeated(uint8_t byte, size_t n) {
    while (n > 0) {
      const size_t k = std::min(n, kIoBlock - buf_.size());
      buf_.insert(buf_.end(), k, byte);
      n -= k;
      if (buf_.size() == kIoBlock) flush();
    }
  }
  void flush() {
    if (buf_.empty()) return;
    crc_ = crc_update(crc_, buf_.data(), buf_.size());
    write_at(pos_, buf_.data(), buf_.size());
    pos_ += buf_.size();
    buf_.clear();
  }
  // CRC-32 of every appended byte (flushes first).
  uint32_t crc() {
    flush();
    return crc_;
  }
  uint64_t end() const { return pos_ + buf_.size(); }

  void write_at(uint64_t offset, const uint8_t* p, size_t n) {
    posix::pwrite_all(fd_.get(), p, n, offset, path_);
  }
  void read_at(uint64_t offset, uint8_t* p, size_t n) const {
    while (n > 0) {
      const ssize_t r = ::pread(fd_.get(), p, n, static_cast<off_t>(offset));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) data_error(path_, "cannot read back: " + errno_text());
      p += r;
      n -= size_t(r);
      offset += uint64_t(r);
    }
  }
  void commit(const std::string& final_path) {
    flush();
    posix::fsync_fd(fd_.get(), path_);
    fd_.close(path_);
    posix::rename_path(path_, final_path);
    committed_ = true;
  }

 private:
  std::string path_;
  posix::UniqueFd fd_;
  uint64_t pos_;              // file offset of the next flush
  uint32_t crc_ = 0;          // of the bytes flushed so far
  std::vector<uint8_t> buf_;  // [<= kIoBlock] appended, not yet written
  bool committed_ = false;
};

}  // namespace

struct ShardWriter::Impl {
  struct Entry {
    std::string file;
    int64_t n_tokens, n_docs;
    bool has_mask;
  };

  std::string dir;
  int64_t max_shard_tokens;
  uint32_t token_bytes;
  CorpusInfo info;
  std::vector<Entry> entries;
  bool finished = false;

  // The shard being written.
  std::unique_ptr<TempFile> shard;  // header placeholder, then tokens as they come
  std::unique_ptr<TempFile> mask;   // the loss mask, from the first masked document on
  int64_t shard_tokens = 0;
  std::vector<uint64_t> offsets;  // [documents so far] start of each document
  std::vector<uint8_t> staging;   // [<= kIoBlock] tokens converted to the on-disk width

  std::string shard_path(size_t i) const {
    return (fs::path(dir) / fmt::format("shard_{:05d}.bin", i)).string();
  }

  void open_shard() {
    const std::string final_path = shard_path(entries.size());
    shard = std::make_unique<TempFile>(final_path + ".tmp", kHeaderBytes);
    shard_tokens = 0;
    offsets.clear();
  }

  // The first masked document of a shard: earlier documents were all targets.
  void start_mask() {
    mask = std::make_unique<TempFile>(shard_path(entries.size()) + ".mask.tmp", 0);
    mask->append_repeated(1, static_cast<size_t>(shard_tokens));
  }

  void close_shard() {
    offsets.push_back(static_cast<uint64_t>(shard_tokens));
    shard->append(reinterpret_cast<const uint8_t*>(offsets.data()), offsets.size() * 8);
    if (mask) {
      mask->flush();
      std::vector<uint8_t> block(std::min<size_t>(kIoBlock, size_t(shard_tokens)));
      for (uint64_t at = 0; at < uint64_t(shard_tokens); at += block.size()) {
        const size_t k = std::min<uint64_t>(block.size(), uint64_t(shard_tokens) - at);
        mask->read_at(at, block.data(), k);
        shard->append(block.data(), k);
      }
    }
    ShardHeader h;
    h.token_bytes = token_bytes;
    h.n_tokens = uint64_t(shard_tokens);
    h.n_docs = offsets.size() - 1;
    h.flags = mask ? kFlagLossMask : 0;
    h.checksum = shard->crc();
    h.vocab_size = uint64_t(info.vocab_size);
    uint8_t header[kHeaderBytes];
    encode_header(h, header);
    shard->write_at(0, header, kHeaderBytes);
    const std::string final_path = shard_path(entries.size());
    shard->commit(final_path);
    entries.push_back({fs::path(final_path).filename().string(), shard_tokens,
                       int64_t(offsets.size()) - 1, mask != nullptr});
    info.has_loss_mask = info.has_loss_mask || mask != nullptr;
    shard.reset();
    mask.reset();  // removes the side file
  }

  void write_index() {
    nlohmann::ordered_json j;
    j["format"] = "shardlm-tokens";
    j["version"] = kVersion;
    j["tokenizer"] = info.tokenizer;
    j["vocab_size"] = info.vocab_size;
    j["token_bytes"] = token_bytes;
    j["n_tokens"] = info.n_tokens;
    j["n_docs"] = info.n_docs;
    j["has_loss_mask"] = info.has_loss_mask;
    j["shards"] = nlohmann::ordered_json::array();
    for (const Entry& e : entries)
      j["shards"].push_back({{"file", e.file},
                             {"n_tokens", e.n_tokens},
                             {"n_docs", e.n_docs},
                             {"has_loss_mask", e.has_mask}});
    const std::string text = j.dump(1) + "\n";
    const std::string path = (fs::path(dir) / kIndexName).string();
    TempFile f(path + ".tmp", 0);
    f.append(reinterpret_cast<const uint8_t*>(text.data()), text.size());
    f.commit(path);
    posix::fsync_dir(dir);
  }
};

ShardWriter::ShardWriter(const std::string& dir, const std::string& tokenizer, int64_t vocab_size,
                         int64_t max_shard_tokens)
    : impl_(std::make_unique<Impl>()) {
  SHARDLM_CHECK(vocab_size >= 1 && vocab_size <= kMaxVocab, "vocab_size {} outside [1, {}]",
                vocab_size, kMaxVocab);
  SHARDLM_CHECK(max_shard_tokens >= 1, "max_shard_tokens must be >= 1, got {}", max_shard_tokens);
  Impl& w = *impl_;
  w.dir = dir;
  w.max_shard_tokens = max_shard_tokens;
  w.token_bytes = token_bytes_for(uint64_t(vocab_size));
  w.info.tokenizer = tokenizer;
  w.info.vocab_size = vocab_size;
  w.staging.reserve(kIoBlock);

  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) data_error(dir, "cannot create the output directory: " + ec.message());
  if (!fs::is_directory(dir, ec)) data_error(dir, "the output path is not a directory");
  // An earlier corpus here: its index goes first, so that no index ever names new shards.
  const fs::path index = fs::path(dir) / kIndexName;
  if (fs::exists(index, ec) && !fs::remove(index, ec))
    data_error(index.string(), "cannot remove the earlier corpus's index: " + ec.message());
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const bool temp = name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0 &&
                      (name.rfind("shard_", 0) == 0 || name.rfind(kIndexName, 0) == 0);
    if (is_shard_name(name) || temp) fs::remove(entry.path(), ec);
  }
}

ShardWriter::~ShardWriter() = default;

void ShardWriter::add_document(const int32_t* tokens, int64_t n, const uint8_t* mask) {
  Impl& w = *impl_;
  SHARDLM_CHECK(!w.finished, "add_document after finish()");
  SHARDLM_CHECK(n >= 1, "a document needs at least one token, got {}", n);
  // Checked before anything is written, so that a refused document leaves the writer as it was.
  const uint32_t vocab = static_cast<uint32_t>(w.info.vocab_size);
  for (int64_t i = 0; i < n; ++i)
    SHARDLM_CHECK(static_cast<uint32_t>(tokens[i]) < vocab,
                  "token {} of a document is {}, outside the vocabulary [0, {})", i, tokens[i],
                  vocab);
  if (mask)
    for (int64_t i = 0; i < n; ++i)
      SHARDLM_CHECK(mask[i] <= 1, "loss mask byte {} is {}; masks hold 0 or 1", i, mask[i]);

  if (w.shard && w.shard_tokens > 0 && w.shard_tokens + n > w.max_shard_tokens) w.close_shard();
  if (!w.shard) w.open_shard();
  if (mask && !w.mask) w.start_mask();
  w.offsets.push_back(static_cast<uint64_t>(w.shard_tokens));
  const int64_t per_block = int64_t(kIoBlock / w.token_bytes);
  for (int64_t at = 0; at < n; at += per_block) {
    const int64_t k = std::min(per_block, n - at);
    w.staging.resize(size_t(k) * w.token_bytes);
    uint8_t* out = w.staging.data();
    if (w.token_bytes == 2)
      for (int64_t i = 0; i < k; ++i) store(out + 2 * i, static_cast<uint16_t>(tokens[at + i]));
    else
      for (int64_t i = 0; i < k; ++i) store(out + 4 * i, static_cast<uint32_t>(tokens[at + i]));
    w.shard->append(w.staging.data(), w.staging.size());
  }
  if (w.mask) {
    if (mask)
      w.mask->append(mask, size_t(n));
    else
      w.mask->append_repeated(1, size_t(n));
  }
  w.shard_tokens += n;
  w.info.n_tokens += n;
  w.info.n_docs += 1;
}

CorpusInfo ShardWriter::finish() {
  Impl& w = *impl_;
  SHARDLM_CHECK(!w.finished, "finish() called twice");
  if (w.shard) w.close_shard();
  w.write_index();
  w.finished = true;
  return w.info;
}

}  // namespace shardlm
