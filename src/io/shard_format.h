// The token-shard format's constants, header codec, CRC-32 and error helper, shared by the
// writer and the reader (the layout itself is documented in shardlm/io/shards.h). Internal to
// src/io: nothing outside the shard code includes it.
#pragma once

#include <zlib.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <system_error>

#include "shardlm/core/check.h"

namespace shardlm::shard_format {

// Shards are little endian and the reader copies integers straight out of the mapping.
static_assert(std::endian::native == std::endian::little,
              "token shards are little endian; a big-endian host needs byte swaps here");

constexpr char kMagic[8] = {'S', 'H', 'L', 'M', 'T', 'O', 'K', '1'};
constexpr uint32_t kVersion = 1;
constexpr uint64_t kHeaderBytes = 64;
constexpr uint32_t kFlagLossMask = 1;
constexpr size_t kIoBlock = size_t(1) << 20;  // write buffer and copy block
constexpr int64_t kMaxVocab = std::numeric_limits<int32_t>::max();
constexpr const char* kIndexName = "index.json";

struct ShardHeader {
  uint32_t version = kVersion;
  uint32_t token_bytes = 0;
  uint64_t n_tokens = 0;
  uint64_t n_docs = 0;
  uint32_t flags = 0;
  uint32_t checksum = 0;  // CRC-32 of everything after the header
  uint64_t vocab_size = 0;
  uint64_t reserved[2] = {0, 0};
};

template <class T>
inline void store(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof v);
}
template <class T>
inline T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void encode_header(const ShardHeader& h, uint8_t* out) {
  std::memcpy(out, kMagic, sizeof kMagic);
  store(out + 8, h.version);
  store(out + 12, h.token_bytes);
  store(out + 16, h.n_tokens);
  store(out + 24, h.n_docs);
  store(out + 32, h.flags);
  store(out + 36, h.checksum);
  store(out + 40, h.vocab_size);
  store(out + 48, h.reserved[0]);
  store(out + 56, h.reserved[1]);
}

inline ShardHeader decode_header(const uint8_t* p) {
  ShardHeader h;
  h.version = load<uint32_t>(p + 8);
  h.token_bytes = load<uint32_t>(p + 12);
  h.n_tokens = load<uint64_t>(p + 16);
  h.n_docs = load<uint64_t>(p + 24);
  h.flags = load<uint32_t>(p + 32);
  h.checksum = load<uint32_t>(p + 36);
  h.vocab_size = load<uint64_t>(p + 40);
  h.reserved[0] = load<uint64_t>(p + 48);
  h.reserved[1] = load<uint64_t>(p + 56);
  return h;
}

inline uint32_t token_bytes_for(uint64_t vocab_size) { return vocab_size <= 65536 ? 2 : 4; }

inline uint32_t crc_update(uint32_t crc, const uint8_t* p, size_t n) {
  while (n > 0) {
    const size_t k = std::min<size_t>(n, size_t(1) << 30);  // zlib takes a uInt length
    crc = static_cast<uint32_t>(::crc32(crc, p, static_cast<uInt>(k)));
    p += k;
    n -= k;
  }
  return crc;
}

inline std::string errno_text() { return std::system_category().message(errno); }

[[noreturn]] inline void data_error(const std::string& file, const std::string& what) {
  SHARDLM_FAIL(ErrorKind::kData, "{}: {}", file, what);
}

inline bool is_shard_name(const std::string& name) {
  // shard_NNNNN.bin with at least 5 digits
  if (name.size() < 15 || name.rfind("shard_", 0) != 0) return false;
  if (name.compare(name.size() - 4, 4, ".bin") != 0) return false;
  return std::all_of(name.begin() + 6, name.end() - 4, [](char c) { return c >= '0' && c <= '9'; });
}

}  // namespace shardlm::shard_format
