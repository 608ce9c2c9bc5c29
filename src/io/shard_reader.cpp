// TokenCorpus: maps token shards (shardlm/io/shards.h) read-only and validates every header
// field, file size, document offset and index.json entry before any is trusted, so that no
// byte sequence on disk can make a read leave its mapping; token ids and mask bytes are
// range-checked as they are copied out.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <utility>

#include "shard_format.h"
#include "shardlm/io/shards.h"

namespace shardlm {

using namespace shard_format;
namespace fs = std::filesystem;

namespace {

// A whole file mapped read-only; the mapping outlives the descriptor.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) data_error(path, "cannot open: " + errno_text());
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const std::string err = errno_text();
      ::close(fd);
      data_error(path, "cannot stat: " + err);
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      data_error(path, "not a regular file");
    }
    size_ = static_cast<size_t>(st.st_size);
    if (size_ > 0) {
      void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const std::string err = errno_text();
        ::close(fd);
        data_error(path, "cannot map: " + err);
      }
      data_ = static_cast<const uint8_t*>(p);
    }
    ::close(fd);
  }
  ~MappedFile() {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
  }
  MappedFile(MappedFile&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  MappedFile& operator=(MappedFile&&) = delete;

  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

struct Shard {
  std::string path;
  MappedFile map;
  ShardHeader header;
  int64_t begin = 0;                // first token, in corpus coordinates
  const uint8_t* tokens = nullptr;  // [n_tokens] u16 or u32
  const uint8_t* mask = nullptr;    // [n_tokens] u8, or null

  int64_t n_tokens() const { return static_cast<int64_t>(header.n_tokens); }
  bool has_mask() const { return mask != nullptr; }
};

// Maps and validates one shard; appends its document starts (shifted by `begin`).
Shard open_shard(const std::string& path, int64_t begin, std::vector<int64_t>& doc_starts) {
  Shard s{path, MappedFile(path), {}, begin};
  const uint64_t size = s.map.size();
  const uint8_t* p = s.map.data();
  if (size < kHeaderBytes)
    data_error(path, fmt::format("truncated: {} bytes, shorter than the {}-byte shard header", size,
                                 kHeaderBytes));
  if (std::memcmp(p, kMagic, sizeof kMagic) != 0)
    data_error(path, "not a shardlm token shard (bad magic; expected \"SHLMTOK1\")");
  const ShardHeader& h = s.header = decode_header(p);
  if (h.version != kVersion)
    data_error(path, fmt::format("shard format version {} is not supported (this build reads "
                                 "version {}); re-run shardlm tokenize",
                                 h.version, kVersion));
  if (h.vocab_size == 0 || h.vocab_size > uint64_t(kMaxVocab))
    data_error(path, fmt::format("corrupt header: vocab_size {} is outside [1, {}]", h.vocab_size,
                                 kMaxVocab));
  if (h.token_bytes != token_bytes_for(h.vocab_size))
    data_error(path, fmt::format("corrupt header: token width {} bytes does not match vocab_size "
                                 "{} (expected {})",
                                 h.token_bytes, h.vocab_size, token_bytes_for(h.vocab_size)));
  if ((h.flags & ~kFlagLossMask) != 0)
    data_error(path, fmt::format("corrupt header: unknown flag bits 0x{:x}", h.flags));
  if (h.reserved[0] != 0 || h.reserved[1] != 0)
    data_error(path, "corrupt header: reserved bytes are not zero");
  const bool has_mask = (h.flags & kFlagLossMask) != 0;
  const uint64_t payload = size - kHeaderBytes;
  // Bounding the counts by the file size first keeps the arithmetic below far from overflow.
  if (h.n_tokens > payload || h.n_docs > payload)
    data_error(path, fmt::format("corrupt header or truncated file: {} tokens and {} documents "
                                 "cannot fit in {} payload bytes",
                                 h.n_tokens, h.n_docs, payload));
  const uint64_t token_area = h.n_tokens * h.token_bytes;
  const uint64_t offset_area = (h.n_docs + 1) * 8;
  const uint64_t need = token_area + offset_area + (has_mask ? h.n_tokens : 0);
  if (need != payload)
    data_error(path, fmt::format("file is {} bytes but its header ({} tokens, {} documents{}) "
                                 "needs {}: truncated or corrupt",
                                 size, h.n_tokens, h.n_docs, has_mask ? ", a loss mask" : "",
                                 kHeaderBytes + need));
  s.tokens = p + kHeaderBytes;
  const uint8_t* offsets = s.tokens + token_area;
  if (has_mask) s.mask = offsets + offset_area;

  uint64_t prev = load<uint64_t>(offsets);
  if (prev != 0)
    data_error(path, fmt::format("corrupt document offsets: the first is {}, not 0", prev));
  doc_starts.reserve(doc_starts.size() + h.n_docs);
  for (uint64_t d = 1; d <= h.n_docs; ++d) {
    doc_starts.push_back(begin + static_cast<int64_t>(prev));
    const uint64_t next = load<uint64_t>(offsets + 8 * d);
    if (next <= prev || next > h.n_tokens)
      data_error(path, fmt::format("corrupt document offsets: offset {} is {} after {} (offsets "
                                   "ascend strictly to n_tokens = {})",
                                   d, next, prev, h.n_tokens));
    prev = next;
  }
  if (prev != h.n_tokens)
    data_error(path, fmt::format("corrupt document offsets: the last is {}, not n_tokens = {}",
                                 prev, h.n_tokens));
  return s;
}

// Field access for index.json: a missing or mistyped field is Error(kData) naming the file.
int64_t index_int(const nlohmann::json& j, const char* key, const std::string& file) {
  const auto it = j.find(key);
  if (it == j.end()) data_error(file, fmt::format("missing \"{}\"", key));
  if (it->is_number_unsigned() && it->get<uint64_t>() <= uint64_t(INT64_MAX))
    return static_cast<int64_t>(it->get<uint64_t>());
  if (it->is_number_integer() && !it->is_number_unsigned() && it->get<int64_t>() >= 0)
    return it->get<int64_t>();
  data_error(file, fmt::format("\"{}\" must be a non-negative integer", key));
}
std::string index_string(const nlohmann::json& j, const char* key, const std::string& file) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_string())
    data_error(file, fmt::format("\"{}\" must be a string", key));
  return it->get<std::string>();
}
bool index_bool(const nlohmann::json& j, const char* key, const std::string& file) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_boolean())
    data_error(file, fmt::format("\"{}\" must be true or false", key));
  return it->get<bool>();
}

}  // namespace

struct TokenCorpus::Impl {
  CorpusInfo info;
  std::vector<Shard> shards;
  std::vector<int64_t> shard_begins;  // [shards] first token of each, ascending
  std::vector<int64_t> doc_starts;    // [n_docs]

  void open_directory(const std::string& dir);
  void open_single(const std::string& path);
};

void TokenCorpus::Impl::open_directory(const std::string& dir) {
  const std::string index_path = (fs::path(dir) / kIndexName).string();
  std::error_code ec;
  if (!fs::exists(index_path, ec))
    data_error(dir, "no index.json: not a token corpus (write one with `shardlm tokenize`)");
  std::ifstream f(index_path, std::ios::binary);
  if (!f) data_error(index_path, "cannot open");
  std::stringstream text;
  text << f.rdbuf();
  if (f.bad()) data_error(index_path, "read error");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text.str());
  } catch (const nlohmann::json::exception& e) {
    data_error(index_path, fmt::format("not valid JSON ({})", e.what()));
  }
  if (!j.is_object()) data_error(index_path, "not a JSON object");
  if (index_string(j, "format", index_path) != "shardlm-tokens")
    data_error(index_path, "\"format\" is not \"shardlm-tokens\"");
  const int64_t version = index_int(j, "version", index_path);
  if (version != kVersion)
    data_error(index_path, fmt::format("corpus format version {} is not supported (this build "
                                       "reads version {}); re-run shardlm tokenize",
                                       version, kVersion));
  info.tokenizer = index_string(j, "tokenizer", index_path);
  info.vocab_size = index_int(j, "vocab_size", index_path);
  if (info.vocab_size < 1 || info.vocab_size > kMaxVocab)
    data_error(index_path,
               fmt::format("vocab_size {} is outside [1, {}]", info.vocab_size, kMaxVocab));
  const int64_t token_bytes = index_int(j, "token_bytes", index_path);
  if (token_bytes != token_bytes_for(uint64_t(info.vocab_size)))
    data_error(index_path, fmt::format("token_bytes {} does not match vocab_size {}", token_bytes,
                                       info.vocab_size));
  const int64_t n_tokens = index_int(j, "n_tokens", index_path);
  const int64_t n_docs = index_int(j, "n_docs", index_path);
  const bool has_mask = index_bool(j, "has_loss_mask", index_path);
  const auto list = j.find("shards");
  if (list == j.end() || !list->is_array()) data_error(index_path, "\"shards\" must be a list");

  bool any_mask = false;
  for (size_t i = 0; i < list->size(); ++i) {
    const nlohmann::json& e = (*list)[i];
    const std::string where = fmt::format("{} (shards[{}])", index_path, i);
    if (!e.is_object()) data_error(where, "not a JSON object");
    const std::string file = index_string(e, "file", where);
    if (file.empty() || file == "." || file == ".." || file.find('/') != std::string::npos)
      data_error(where, fmt::format("\"{}\" is not a file name inside the corpus", file));
    const int64_t entry_tokens = index_int(e, "n_tokens", where);
    const int64_t entry_docs = index_int(e, "n_docs", where);
    const bool entry_mask = index_bool(e, "has_loss_mask", where);
    const std::string path = (fs::path(dir) / file).string();
    const int64_t begin = shard_begins.empty() ? 0 : shard_begins.back() + shards.back().n_tokens();
    Shard s = open_shard(path, begin, doc_starts);
    const ShardHeader& h = s.header;
    if (h.vocab_size != uint64_t(info.vocab_size))
      data_error(path, fmt::format("vocab_size {} differs from index.json's {}", h.vocab_size,
                                   info.vocab_size));
    if (h.n_tokens != uint64_t(entry_tokens) || h.n_docs != uint64_t(entry_docs))
      data_error(path, fmt::format("holds {} tokens and {} documents; index.json says {} and {}",
                                   h.n_tokens, h.n_docs, entry_tokens, entry_docs));
    if (s.has_mask() != entry_mask)
      data_error(path, fmt::format("loss mask flag is {} but index.json says {}", s.has_mask(),
                                   entry_mask));
    any_mask = any_mask || entry_mask;
    shard_begins.push_back(begin);
    shards.push_back(std::move(s));
    if (shard_begins.back() > INT64_MAX - shards.back().n_tokens())
      data_error(index_path, "the shards together hold more than 2^63 tokens");
  }
  info.n_tokens = shards.empty() ? 0 : shard_begins.back() + shards.back().n_tokens();
  info.n_docs = int64_t(doc_starts.size());
  if (info.n_tokens != n_tokens || info.n_docs != n_docs)
    data_error(index_path, fmt::format("says {} tokens and {} documents but its shards hold {} "
                                       "and {}",
                                       n_tokens, n_docs, info.n_tokens, info.n_docs));
  if (any_mask != has_mask)
    data_error(index_path, fmt::format("has_loss_mask is {} but {} shard has a loss mask", has_mask,
                                       any_mask ? "a" : "no"));
  info.has_loss_mask = has_mask;
}

void TokenCorpus::Impl::open_single(const std::string& path) {
  shards.push_back(open_shard(path, 0, doc_starts));
  shard_begins.push_back(0);
  const Shard& s = shards.back();
  info.tokenizer = "";
  info.vocab_size = int64_t(s.header.vocab_size);
  info.n_tokens = s.n_tokens();
  info.n_docs = int64_t(s.header.n_docs);
  info.has_loss_mask = s.has_mask();
}

TokenCorpus::TokenCorpus(const std::string& path) : impl_(std::make_unique<Impl>()) {
  std::error_code ec;
  if (fs::is_directory(path, ec))
    impl_->open_directory(path);
  else
    impl_->open_single(path);
  // Held for the corpus's life: no slack past what it holds (host_bytes()).
  impl_->doc_starts.shrink_to_fit();
  impl_->shard_begins.shrink_to_fit();
}

TokenCorpus::~TokenCorpus() = default;
TokenCorpus::TokenCorpus(TokenCorpus&&) noexcept = default;

const CorpusInfo& TokenCorpus::info() const { return impl_->info; }
const std::vector<int64_t>& TokenCorpus::doc_starts() const { return impl_->doc_starts; }
int64_t TokenCorpus::num_shards() const { return int64_t(impl_->shards.size()); }
int64_t TokenCorpus::host_bytes() const {
  return int64_t((impl_->doc_starts.capacity() + impl_->shard_begins.capacity()) * sizeof(int64_t));
}

void TokenCorpus::read(int64_t begin, int64_t n, int32_t* out, uint8_t* mask) const {
  const Impl& c = *impl_;
  SHARDLM_CHECK(begin >= 0 && n >= 0 && begin <= c.info.n_tokens - n,
                "read of tokens [{}, {} + {}) outside the corpus of {} tokens", begin, begin, n,
                c.info.n_tokens);
  if (n == 0) return;
  // The last shard starting at or before `begin` (empty shards share their successor's start).
  size_t si = size_t(std::upper_bound(c.shard_begins.begin(), c.shard_begins.end(), begin) -
                     c.shard_begins.begin()) -
              1;
  const uint32_t vocab = static_cast<uint32_t>(c.info.vocab_size);
  while (n > 0) {
    const Shard& s = c.shards[si++];
    const int64_t local = begin - s.begin;
    const int64_t k = std::min(n, s.n_tokens() - local);
    if (k <= 0) continue;
    const uint32_t width = s.header.token_bytes;
    const uint8_t* src = s.tokens + uint64_t(local) * width;
    for (int64_t i = 0; i < k; ++i) {
      const uint32_t t = width == 2 ? load<uint16_t>(src + 2 * i) : load<uint32_t>(src + 4 * i);
      if (t >= vocab) [[unlikely]]
        data_error(s.path, fmt::format("corrupt token: token {} is {}, outside the vocabulary "
                                       "of {}; run verify_checksums or re-tokenize",
                                       local + i, t, vocab));
      out[i] = static_cast<int32_t>(t);
    }
    if (mask) {
      if (s.mask) {
        const uint8_t* m = s.mask + local;
        for (int64_t i = 0; i < k; ++i) {
          if (m[i] > 1) [[unlikely]]
            data_error(s.path, fmt::format("corrupt loss mask: byte {} is {}, not 0 or 1",
                                           local + i, m[i]));
          mask[i] = m[i];
        }
      } else {
        std::fill_n(mask, k, uint8_t{1});
      }
      mask += k;
    }
    out += k;
    begin += k;
    n -= k;
  }
}

void TokenCorpus::verify_checksums() const {
  for (const Shard& s : impl_->shards) {
    const uint32_t crc =
        crc_update(0, s.map.data() + kHeaderBytes, s.map.size() - size_t(kHeaderBytes));
    if (crc != s.header.checksum)
      data_error(s.path, fmt::format("CRC-32 mismatch (stored 0x{:08x}, computed 0x{:08x}): the "
                                     "shard is corrupt; re-run shardlm tokenize",
                                     s.header.checksum, crc));
  }
}

}  // namespace shardlm
