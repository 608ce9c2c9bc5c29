// SentencePiece tokenizer.model (sentencepiece.h) through libsentencepiece; the piece types
// that the library's public API does not expose (user-defined) are read from the protobuf here.
#include "shardlm/io/sentencepiece.h"

#include <sentencepiece_processor.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "shardlm/core/check.h"

namespace shardlm {

namespace {

// SentencePiece's ModelProto.SentencePiece.Type values.
constexpr uint64_t kTypeControl = 3, kTypeUserDefined = 4;

// The types of the model's pieces, in id order, from the serialized ModelProto (field 1:
// repeated SentencePiece {1: piece, 2: score, 3: type}); empty when the bytes do not parse.
std::vector<uint8_t> piece_types(std::string_view proto) {
  struct Reader {
    std::string_view s;
    size_t i = 0;
    bool ok = true;
    uint64_t varint() {
      uint64_t v = 0;
      for (int shift = 0; shift < 64 && i < s.size(); shift += 7) {
        const auto b = uint8_t(s[i++]);
        v |= uint64_t(b & 0x7f) << shift;
        if ((b & 0x80) == 0) return v;
      }
      ok = false;
      return 0;
    }
    // Skips a field of `wire` type; a length-delimited one is returned.
    std::string_view field(uint64_t wire) {
      size_t n = 0;
      switch (wire) {
        case 0:
          varint();
          return {};
        case 1:
          n = 8;
          break;
        case 2:
          n = size_t(varint());
          break;
        case 5:
          n = 4;
          break;
        default:
          ok = false;
          return {};
      }
      if (!ok || n > s.size() - i) {
        ok = false;
        return {};
      }
      const std::string_view v = s.substr(i, n);
      i += n;
      return v;
    }
  };
  std::vector<uint8_t> types;
  Reader top{proto};
  while (top.ok && top.i < top.s.size()) {
    const uint64_t key = top.varint();
    const std::string_view v = top.field(key & 7);
    if ((key >> 3) != 1 || (key & 7) != 2) continue;
    Reader piece{v};
    uint64_t type = 1;  // NORMAL, the default
    while (piece.ok && piece.i < piece.s.size()) {
      const uint64_t k = piece.varint();
      if ((k >> 3) == 3 && (k & 7) == 0)
        type = piece.varint();
      else
        piece.field(k & 7);
    }
    types.push_back(uint8_t(type));
  }
  if (!top.ok) types.clear();
  return types;
}

}  // namespace

struct SentencePieceTokenizer::Impl {
  std::string file;
  sentencepiece::SentencePieceProcessor sp;
  std::vector<uint8_t> types;  // [vocab_size] the pieces' ModelProto types
};

SentencePieceTokenizer::SentencePieceTokenizer() : impl_(std::make_unique<Impl>()) {}
SentencePieceTokenizer::~SentencePieceTokenizer() = default;

bool SentencePieceTokenizer::is_model(const std::string& bytes) {
  sentencepiece::SentencePieceProcessor sp;
  return sp.LoadFromSerializedProto(bytes).ok() && sp.GetPieceSize() > 0;
}

std::unique_ptr<SentencePieceTokenizer> SentencePieceTokenizer::from_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) SHARDLM_FAIL(ErrorKind::kConfig, "{}: cannot read the tokenizer file", path);
  std::stringstream ss;
  ss << f.rdbuf();
  const std::string bytes = ss.str();
  std::unique_ptr<SentencePieceTokenizer> t(new SentencePieceTokenizer());
  Impl& m = *t->impl_;
  m.file = path;
  const auto status = m.sp.LoadFromSerializedProto(bytes);
  if (!status.ok() || m.sp.GetPieceSize() <= 0)
    SHARDLM_FAIL(ErrorKind::kConfig, "{}: not a SentencePiece model ({})", path,
                 status.ok() ? "no pieces" : status.ToString());
  t->vocab_size_ = m.sp.GetPieceSize();
  m.types = piece_types(bytes);
  if (m.types.size() != size_t(t->vocab_size_))
    SHARDLM_FAIL(ErrorKind::kConfig, "{}: the model's piece list does not parse ({} of {} pieces)",
                 path, m.types.size(), t->vocab_size_);
  t->bos_ = m.sp.bos_id();
  t->eos_ = m.sp.eos_id();
  t->name_ = std::filesystem::absolute(path).lexically_normal().string();
  return t;
}

std::vector<int32_t> SentencePieceTokenizer::encode(std::string_view text) const {
  std::vector<int> ids;
  const auto status = impl_->sp.Encode(text, &ids);
  if (!status.ok())
    SHARDLM_FAIL(ErrorKind::kData, "{}: SentencePiece cannot encode the text: {}", impl_->file,
                 status.ToString());
  return std::vector<int32_t>(ids.begin(), ids.end());
}

std::string SentencePieceTokenizer::decode(const std::vector<int32_t>& ids) const {
  for (const int32_t id : ids)
    SHARDLM_CHECK_KIND(ErrorKind::kData, id >= 0 && id < vocab_size_,
                       "{}: token id {} is not in the vocabulary (size {})", impl_->file, id,
                       vocab_size_);
  std::string out;
  const auto status = impl_->sp.Decode(std::vector<int>(ids.begin(), ids.end()), &out);
  if (!status.ok())
    SHARDLM_FAIL(ErrorKind::kData, "{}: SentencePiece cannot decode: {}", impl_->file,
                 status.ToString());
  return out;
}

int32_t SentencePieceTokenizer::special_token(std::string_view text) const {
  const Impl& m = *impl_;
  const int id = m.sp.PieceToId(text);
  if (id < 0 || id >= vocab_size_ || m.sp.IdToPiece(id) != text) return -1;
  const uint8_t type = m.types[size_t(id)];
  return type == kTypeControl || type == kTypeUserDefined ? id : -1;
}

SentencePieceTokenizer::Piece SentencePieceTokenizer::piece(int32_t id) const {
  const Impl& m = *impl_;
  SHARDLM_CHECK(id >= 0 && id < vocab_size_, "{}: piece {} of {}", m.file, id, vocab_size_);
  return {m.sp.IdToPiece(id), m.sp.GetScore(id), int(m.types[size_t(id)])};
}

int32_t SentencePieceTokenizer::unk_id() const { return impl_->sp.unk_id(); }
int32_t SentencePieceTokenizer::pad_id() const { return impl_->sp.pad_id(); }

}  // namespace shardlm
