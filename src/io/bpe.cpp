// Byte-level BPE encoding and decoding (bpe.h): added tokens split out first, NFC where the
// tokenizer asks for it, the PCRE2 pre-tokenizer's pieces, then the merge loop by rank over each
// piece (cached). Loading a tokenizer: bpe_load.cpp.
#include "shardlm/io/bpe.h"

#include <unicode/normalizer2.h>
#include <unicode/unistr.h>

#include <algorithm>
#include <limits>
#include <mutex>

#include "bpe_impl.h"
#include "shardlm/core/check.h"

namespace shardlm {

namespace {

// Decodes one UTF-8 code point at s[i] (i advanced); false at an invalid sequence.
bool next_utf8(std::string_view s, size_t& i, uint32_t& cp) {
  const auto c = uint8_t(s[i]);
  int n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
  if (n == 0 || i + size_t(n) > s.size()) return false;
  cp = n == 1 ? c : n == 2 ? (c & 0x1f) : n == 3 ? (c & 0x0f) : (c & 0x07);
  for (int k = 1; k < n; ++k) {
    const auto d = uint8_t(s[i + size_t(k)]);
    if ((d >> 6) != 2) return false;
    cp = (cp << 6) | (d & 0x3f);
  }
  i += size_t(n);
  return true;
}

bool valid_utf8(std::string_view s) {
  size_t i = 0;
  uint32_t cp;
  while (i < s.size())
    if (!next_utf8(s, i, cp)) return false;
  return true;
}

// Unicode NFC of valid UTF-8 text (ICU).
std::string nfc(std::string_view text) {
  UErrorCode st = U_ZERO_ERROR;
  const icu::Normalizer2* n = icu::Normalizer2::getNFCInstance(st);
  SHARDLM_CHECK(U_SUCCESS(st), "ICU: no NFC normalizer ({})", u_errorName(st));
  const icu::UnicodeString u =
      icu::UnicodeString::fromUTF8(icu::StringPiece(text.data(), int32_t(text.size())));
  if (n->isNormalized(u, st) && U_SUCCESS(st)) return std::string(text);
  st = U_ZERO_ERROR;
  const icu::UnicodeString out = n->normalize(u, st);
  SHARDLM_CHECK(U_SUCCESS(st), "ICU: NFC failed ({})", u_errorName(st));
  std::string r;
  out.toUTF8String(r);
  return r;
}

}  // namespace

int32_t BpeTokenizer::special_token(std::string_view text) const {
  for (const auto& a : impl_->added)
    if (a.content == text) return a.id;
  return -1;
}

int32_t BpeTokenizer::token_id(const std::string& text) const {
  for (const auto& a : impl_->added)
    if (a.content == text) return a.id;
  const auto it = impl_->vocab.find(text);
  return it == impl_->vocab.end() ? -1 : it->second;
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  const Impl& m = *impl_;
  const std::string key(piece);
  Impl::CacheShard& shard = m.cache[std::hash<std::string>{}(key) % Impl::kCacheShards];
  {
    std::lock_guard<std::mutex> lock(shard.mu);
    const auto it = shard.ids.find(key);
    if (it != shard.ids.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<std::string> sym;
  sym.reserve(piece.size());
  std::string whole;
  for (char c : piece) {
    sym.push_back(m.byte_str[uint8_t(c)]);
    whole += sym.back();
  }
  std::vector<int32_t> ids;
  const auto direct = m.ignore_merges ? m.vocab.find(whole) : m.vocab.end();
  if (direct != m.vocab.end()) {
    ids.push_back(direct->second);
  } else {
    // Merge the lowest-ranked adjacent pair, every occurrence left to right, until none.
    std::string pair;
    while (sym.size() > 1) {
      int32_t best = std::numeric_limits<int32_t>::max();
      size_t at = 0;
      for (size_t i = 0; i + 1 < sym.size(); ++i) {
        pair.assign(sym[i]).append(1, '\x01').append(sym[i + 1]);
        const auto r = m.merge_rank.find(pair);
        if (r != m.merge_rank.end() && r->second < best) {
          best = r->second;
          at = i;
        }
      }
      if (best == std::numeric_limits<int32_t>::max()) break;
      const std::string a = sym[at], b = sym[at + 1];
      std::vector<std::string> next;
      next.reserve(sym.size());
      for (size_t i = 0; i < sym.size(); ++i) {
        if (i + 1 < sym.size() && sym[i] == a && sym[i + 1] == b) {
          next.push_back(a + b);
          ++i;
        } else {
          next.push_back(sym[i]);
        }
      }
      sym.swap(next);
    }
    for (const std::string& s : sym) {
      const auto it = m.vocab.find(s);
      if (it == m.vocab.end())
        SHARDLM_FAIL(ErrorKind::kData, "{}: the token '{}' is not in the vocabulary", m.file, s);
      ids.push_back(it->second);
    }
  }
  out.insert(out.end(), ids.begin(), ids.end());
  std::lock_guard<std::mutex> lock(shard.mu);
  if (shard.ids.size() > (size_t{1} << 12)) shard.ids.clear();
  shard.ids.emplace(key, std::move(ids));
}

void BpeTokenizer::encode_ordinary(std::string_view text, std::vector<int32_t>& out) const {
  const Impl& m = *impl_;
  if (text.empty()) return;
  // NFC applies to valid UTF-8 (bytes that are not are left as they are, to round-trip).
  std::string normalized;
  if (m.nfc && valid_utf8(text)) {
    normalized = nfc(text);
    text = normalized;
  }
  if (!m.regex) {
    encode_piece(text, out);
    return;
  }
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(m.regex->code, nullptr);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t gap = 0, from = 0;
  while (from < text.size()) {
    const int rc = pcre2_match(m.regex->code, subject, text.size(), from, 0, md, nullptr);
    if (rc < 0) break;  // no match to the end: the rest is one gap
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t s = ov[0], e = ov[1];
    if (e == s) {  // an empty match: look again one character on
      size_t i = s;
      uint32_t cp;
      if (i >= text.size()) break;
      if (!next_utf8(text, i, cp)) i = s + 1;
      from = i;
      continue;
    }
    if (s > gap) encode_piece(text.substr(gap, s - gap), out);
    encode_piece(text.substr(s, e - s), out);
    gap = from = e;
  }
  pcre2_match_data_free(md);
  if (gap < text.size()) encode_piece(text.substr(gap), out);
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text) const {
  const Impl& m = *impl_;
  std::string prefixed;
  if (m.add_prefix_space && !text.empty() && text[0] != ' ') {
    prefixed = ' ';
    prefixed += text;
    text = prefixed;
  }
  std::vector<int32_t> out;
  size_t start = 0, i = 0;
  while (i < text.size()) {
    const Impl::Added* hit = nullptr;
    if (m.added_first[uint8_t(text[i])])
      for (const auto& a : m.added)  // longest first
        if (text.compare(i, a.content.size(), a.content) == 0) {
          hit = &a;
          break;
        }
    if (hit == nullptr) {
      ++i;
      continue;
    }
    encode_ordinary(text.substr(start, i - start), out);
    out.push_back(hit->id);
    i += hit->content.size();
    start = i;
  }
  encode_ordinary(text.substr(start), out);
  return out;
}

std::string BpeTokenizer::decode(const std::vector<int32_t>& ids) const {
  const Impl& m = *impl_;
  std::string out;
  for (const int32_t id : ids) {
    const auto a = m.added_of_id.find(id);
    if (a != m.added_of_id.end()) {
      if (!m.added[a->second].special) out += m.added[a->second].content;
      continue;
    }
    SHARDLM_CHECK_KIND(ErrorKind::kData,
                       id >= 0 && id < vocab_size_ && !m.id_to_token[size_t(id)].empty(),
                       "{}: token id {} is not in the vocabulary", m.file, id);
    const std::string& tok = m.id_to_token[size_t(id)];
    size_t i = 0;
    while (i < tok.size()) {
      uint32_t cp = 0;
      const size_t at = i;
      if (!next_utf8(tok, i, cp)) {
        out += tok[at];
        i = at + 1;
        continue;
      }
      const auto b = m.char_byte.find(cp);
      if (b != m.char_byte.end())
        out += char(b->second);
      else
        out.append(tok, at, i - at);  // not in the byte alphabet: kept as it is
    }
  }
  return out;
}

}  // namespace shardlm
