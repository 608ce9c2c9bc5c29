// The byte-level tokenizer: every byte is a token; three special tokens follow the bytes.
#include "shardlm/io/tokenizer.h"

namespace shardlm {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = static_cast<unsigned char>(text[i]);
  return ids;
}

std::string ByteTokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string s;
  s.reserve(ids.size());
  for (int32_t id : ids)
    if (id >= 0 && id < 256) s.push_back(static_cast<char>(id));
  return s;
}

}  // namespace shardlm
