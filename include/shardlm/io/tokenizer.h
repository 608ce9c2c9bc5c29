// Tokenizer interface and the built-in byte-level tokenizer (256 bytes + special tokens).
// Byte-level BPE (bpe.h) and SentencePiece (sentencepiece.h) implement the same interface;
// load_tokenizer (tokenize.h) picks one from a path.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace shardlm {

// encode and decode are thread-safe: `shardlm tokenize --threads` calls them from several
// threads at once.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // Special tokens are dropped from the text; bytes that are not valid UTF-8 are kept as is.
  virtual std::string decode(const std::vector<int32_t>& ids) const = 0;
  virtual int32_t vocab_size() const = 0;  // ids are in [0, vocab_size)
  virtual int32_t bos_id() const = 0;
  virtual int32_t eos_id() const = 0;
  // Recorded in token corpora so that a corpus is read with the tokenizer that wrote it:
  // "byte", or the tokenizer file's name.
  virtual std::string name() const = 0;
  // The id of a special (added) token by its text, or -1: how chat templates find their
  // markers (<|start_header_id|>, <|im_start|>, ...).
  virtual int32_t special_token(std::string_view text) const { return -1; }
  // The Jinja chat template that came with the tokenizer (tokenizer_config.json's
  // "chat_template" or chat_template.jinja beside the file), "" when none: a signal for
  // which of shardlm's templates applies (chat_template_for), never interpreted.
  virtual std::string_view chat_template() const { return {}; }
};

// The Jinja chat template stored beside a tokenizer file: tokenizer_config.json's
// "chat_template" (a string, or the entry named "default" of a list of {"name", "template"}),
// else chat_template.jinja's text; "" when neither is there (chat_template.cpp).
std::string chat_template_beside(const std::string& tokenizer_file);

// Byte b -> id b; then <bos> = 256, <eos> = 257, <pad> = 258.
class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int32_t kBos = 256, kEos = 257, kPad = 258, kVocab = 259;
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int32_t vocab_size() const override { return kVocab; }
  int32_t bos_id() const override { return kBos; }
  int32_t eos_id() const override { return kEos; }
  std::string name() const override { return "byte"; }
};

}  // namespace shardlm
