// BpeTokenizer::Impl, the state that loading a tokenizer (bpe_load.cpp) fills and encoding
// (bpe.cpp) reads: the vocabulary, the merge ranks, the byte alphabet, the added tokens, the
// compiled pre-tokenizer and the cache of encoded pieces. Internal to src/io.
#pragma once

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "shardlm/core/check.h"
#include "shardlm/io/bpe.h"

namespace shardlm {

// The compiled pre-tokenizer regex; frees it.
struct Pcre2Regex {
  pcre2_code* code = nullptr;
  ~Pcre2Regex() {
    if (code != nullptr) pcre2_code_free(code);
  }
};

struct BpeTokenizer::Impl {
  std::string file;
  std::unordered_map<std::string, int32_t> vocab;       // byte-level token -> id
  std::vector<std::string> id_to_token;                 // id -> byte-level token ("" if unused)
  std::unordered_map<std::string, int32_t> merge_rank;  // "a\x01b" -> rank
  bool ignore_merges = false;
  bool nfc = false;  // normalizer NFC (Qwen2): applied to the text between added tokens
  bool add_prefix_space = false;
  std::unique_ptr<Pcre2Regex> regex;                // null: the whole text is one piece
  std::string byte_str[256];                        // byte -> its byte-level character (UTF-8)
  std::unordered_map<uint32_t, uint8_t> char_byte;  // byte-level code point -> byte
  struct Added {
    std::string content;
    int32_t id;
    bool special;
  };
  std::vector<Added> added;    // longest first
  bool added_first[256] = {};  // bytes an added token starts with
  std::unordered_map<int32_t, size_t> added_of_id;
  // Pieces already encoded, in shards by hash so that threads encoding at once (tokenize
  // --threads) seldom wait on the same lock.
  struct CacheShard {
    std::mutex mu;
    std::unordered_map<std::string, std::vector<int32_t>> ids;
  };
  static constexpr size_t kCacheShards = 64;
  mutable CacheShard cache[kCacheShards];

  [[noreturn]] void fail(const std::string& what) const {
    SHARDLM_FAIL(ErrorKind::kConfig, "{}: {}", file, what);
  }
};

}  // namespace shardlm
