// SentencePiece `tokenizer.model` files (Llama-2, Mistral): the protobuf model run by
// libsentencepiece, so that BPE and unigram models, their normalizer (the precompiled charsmap),
// the dummy-prefix "▁", byte fallback (<0xNN> pieces) and <unk> behave exactly as the model
// says. Only this file's implementation sees the library's headers.
//
// encode() is SentencePiece's own Encode: no bos/eos added, control symbols (<s>, </s>) in the
// text are plain text, user-defined symbols are matched. decode() drops control symbols and
// writes <unk> as SentencePiece does (" ⁇ ").
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "shardlm/io/tokenizer.h"

namespace shardlm {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  // Throws Error(kConfig) naming `path` when it cannot be read or is not a SentencePiece model.
  static std::unique_ptr<SentencePieceTokenizer> from_file(const std::string& path);
  // True when `bytes` (a file's content) parses as a SentencePiece model.
  static bool is_model(const std::string& bytes);
  ~SentencePieceTokenizer() override;

  // Thread-safe (the processor is immutable after loading).
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(const std::vector<int32_t>& ids) const override;
  int32_t vocab_size() const override { return vocab_size_; }
  int32_t bos_id() const override { return bos_; }
  int32_t eos_id() const override { return eos_; }
  std::string name() const override { return name_; }
  // Control (<s>, </s>, ...) and user-defined pieces by their text; -1 for any other text.
  int32_t special_token(std::string_view text) const override;

  // A piece as the model file holds it, for exports (GGUF): its text, score and ModelProto
  // type (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte).
  struct Piece {
    std::string text;
    float score = 0;
    int type = 1;
  };
  Piece piece(int32_t id) const;
  int32_t unk_id() const;  // -1 without one
  int32_t pad_id() const;  // -1 without one

  struct Impl;  // the processor and the piece types; defined in sentencepiece.cpp

 private:
  SentencePieceTokenizer();
  std::unique_ptr<Impl> impl_;
  std::string name_;
  int32_t vocab_size_ = 0;
  int32_t bos_ = -1, eos_ = -1;
};

}  // namespace shardlm
