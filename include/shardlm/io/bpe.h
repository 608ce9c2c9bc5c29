// Byte-level BPE from a Hugging Face `tokenizer.json` (GPT-2, Llama-3 and Qwen2 families).
//
// Encoding: added tokens (tokenizer.json `added_tokens`, matched longest first) are cut out of
// the text and map to their ids; the rest is split by the pre-tokenizer (ByteLevel with
// GPT-2's regex, or Split with the file's regex followed by ByteLevel without one; the regex
// runs in PCRE2 with Unicode properties), each piece's bytes are mapped to the byte-level
// alphabet and merged by rank (`ignore_merges`: a piece that is itself in the vocabulary is
// taken whole, as Llama-3 does). Bytes that are not valid UTF-8 are never matched by the regex
// and pass through as byte-level pieces, so decode(encode(x)) == x for any input. Decoding
// maps the byte-level alphabet back to bytes; added tokens decode to their text unless special.
//
// Anything tokenizer.json asks for that this does not do (another model type, a normalizer,
// another pre-tokenizer or decoder, byte fallback, continuing-subword prefixes, dropout) is
// Error(kConfig) naming the file and the field.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "shardlm/io/tokenizer.h"

namespace shardlm {

class BpeTokenizer final : public Tokenizer {
 public:
  // `path`: a tokenizer.json file. bos/eos come from tokenizer_config.json beside it when it
  // names them, else from the family's special tokens (<|begin_of_text|>, <|end_of_text|>,
  // <|endoftext|>); -1 when there is none. The chat template is tokenizer_config.json's
  // "chat_template" (a string, or the list entry named "default"), else chat_template.jinja.
  static std::unique_ptr<BpeTokenizer> from_file(const std::string& path);
  // GPT-2's own format: vocab.json (byte-level token -> id) and merges.txt ("#version" line,
  // then "a b" per merge, by rank), with GPT-2's pre-tokenizer; <|endoftext|>, when the
  // vocabulary has it, is a special token.
  static std::unique_ptr<BpeTokenizer> from_vocab_merges(const std::string& vocab_json,
                                                         const std::string& merges_txt);
  // A tiktoken rank file ("<base64 token bytes> <rank>" per line; the rank is the id and the
  // merge priority: adjacent parts merge lowest rank of their concatenation first). 128000
  // ranks are Llama-3's (its regex and its special tokens at 128000-128255), 50256 GPT-2's
  // (its regex, <|endoftext|> = 50256); any other size gets GPT-2's regex and no special
  // tokens.
  static std::unique_ptr<BpeTokenizer> from_tiktoken(const std::string& path);
  ~BpeTokenizer() override;

  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int32_t vocab_size() const override { return vocab_size_; }
  int32_t bos_id() const override { return bos_; }
  int32_t eos_id() const override { return eos_; }
  std::string name() const override { return name_; }
  int32_t special_token(std::string_view text) const override;
  std::string_view chat_template() const override { return chat_template_; }
  // The id of an added or regular token's exact text, or -1.
  int32_t token_id(const std::string& text) const;

  struct Impl;  // public so that the file's helpers can fill it; defined in bpe_impl.h

 private:
  BpeTokenizer();
  // Added tokens sorted, the id table, vocab_size, bos/eos (tokenizer_config.json beside
  // `path`, else the families' names) and the name.
  void finish(int32_t max_id, const std::string& path);
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  void encode_ordinary(std::string_view text, std::vector<int32_t>& out) const;

  std::unique_ptr<Impl> impl_;
  std::string name_;
  std::string chat_template_;
  int32_t vocab_size_ = 0;
  int32_t bos_ = -1, eos_ = -1;
};

}  // namespace shardlm
