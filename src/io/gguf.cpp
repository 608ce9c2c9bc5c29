// GGUF writing (gguf.h): the value and tensor encodings, the metadata's bytes and the streaming
// writer, whose head (header, metadata, tensor infos with their offsets) goes first.
#include "shardlm/io/gguf.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "posix_file.h"
#include "shardlm/core/check.h"
#include "shardlm/core/dtype.h"

namespace shardlm {

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr uint32_t kVersion = 3;
constexpr uint64_t kAlignment = 32;  // general.alignment's default, which the file keeps

// gguf_value_type's numbers.
enum ValueType : uint32_t {
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
};

template <typename T>
void put(std::string& out, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}

void put_string(std::string& out, const std::string& s) {
  put<uint64_t>(out, s.size());
  out += s;
}

uint64_t padded(uint64_t n) { return (n + kAlignment - 1) / kAlignment * kAlignment; }

// A value of 2^-24 units below the smallest normal half (2^-14), rounded to nearest even.
uint16_t f16_subnormal(uint32_t abs) {
  if (abs <= 0x33000000) return 0;  // at most 2^-25: the tie at 2^-25 goes to even (zero)
  const uint32_t e = abs >> 23;
  const uint32_t m = (abs & 0x7fffff) | 0x800000;
  const uint32_t shift = 126 - e;  // 14 .. 24
  uint32_t q = m >> shift;
  const uint32_t rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1))) ++q;
  return uint16_t(q);
}

void encode_q8_0(const float* in, int64_t n, std::byte* out) {
  for (int64_t b = 0; b < n / kGgufQ8Block; ++b) {
    const float* x = in + b * kGgufQ8Block;
    float amax = 0;
    for (int j = 0; j < kGgufQ8Block; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    std::byte* blk = out + b * 34;
    const uint16_t dh = f32_to_f16(d);
    std::memcpy(blk, &dh, 2);
    for (int j = 0; j < kGgufQ8Block; ++j) {
      const int8_t q = int8_t(std::round(x[j] * id));  // std::round: half away from zero
      std::memcpy(blk + 2 + j, &q, 1);
    }
  }
}

}  // namespace

uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = uint16_t((x >> 16) & 0x8000);
  const uint32_t abs = x & 0x7fffffff;
  if (abs > 0x7f800000) return sign | 0x7e00;   // NaN
  if (abs >= 0x477ff000) return sign | 0x7c00;  // at or past 65520 rounds to infinity
  if (abs < 0x38800000) return sign | f16_subnormal(abs);
  uint32_t h = (abs - 0x38000000) >> 13;  // exponent rebiased from 127 to 15, 10 mantissa bits
  const uint32_t rem = abs & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) ++h;  // a carry moves into the exponent
  return uint16_t(sign | h);
}

const char* gguf_type_name(GgufType t) {
  switch (t) {
    case GgufType::kF32:
      return "F32";
    case GgufType::kF16:
      return "F16";
    case GgufType::kQ8_0:
      return "Q8_0";
    case GgufType::kBF16:
      return "BF16";
  }
  return "?";
}

size_t gguf_type_bytes(GgufType t, int64_t n) {
  switch (t) {
    case GgufType::kF32:
      return size_t(n) * 4;
    case GgufType::kF16:
    case GgufType::kBF16:
      return size_t(n) * 2;
    case GgufType::kQ8_0:
      SHARDLM_CHECK(n % kGgufQ8Block == 0, "Q8_0 holds blocks of 32 values, not {}", n);
      return size_t(n / kGgufQ8Block) * 34;
  }
  return 0;
}

void gguf_encode(GgufType t, const float* in, int64_t n, std::byte* out) {
  switch (t) {
    case GgufType::kF32:
      std::memcpy(out, in, size_t(n) * 4);
      return;
    case GgufType::kF16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = f32_to_f16(in[i]);
        std::memcpy(out + 2 * i, &h, 2);
      }
      return;
    case GgufType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h = f32_to_bf16(in[i]);
        std::memcpy(out + 2 * i, &h, 2);
      }
      return;
    case GgufType::kQ8_0:
      SHARDLM_CHECK(n % kGgufQ8Block == 0, "Q8_0 holds blocks of 32 values, not {}", n);
      encode_q8_0(in, n, out);
      return;
  }
}

void GgufMetadata::begin(const std::string& key, uint32_t type) {
  SHARDLM_CHECK(keys_.insert(key).second, "GGUF metadata: key '{}' added twice", key);
  put_string(bytes_, key);
  put<uint32_t>(bytes_, type);
}

void GgufMetadata::add_u32(const std::string& key, uint32_t v) {
  begin(key, kU32);
  put(bytes_, v);
}

void GgufMetadata::add_i32(const std::string& key, int32_t v) {
  begin(key, kI32);
  put(bytes_, v);
}

void GgufMetadata::add_f32(const std::string& key, float v) {
  begin(key, kF32);
  put(bytes_, v);
}

void GgufMetadata::add_bool(const std::string& key, bool v) {
  begin(key, kBool);
  put<uint8_t>(bytes_, v ? 1 : 0);
}

void GgufMetadata::add_string(const std::string& key, const std::string& v) {
  begin(key, kString);
  put_string(bytes_, v);
}

void GgufMetadata::add_strings(const std::string& key, const std::vector<std::string>& v) {
  begin(key, kArray);
  put<uint32_t>(bytes_, kString);
  put<uint64_t>(bytes_, v.size());
  for (const std::string& s : v) put_string(bytes_, s);
}

void GgufMetadata::add_i32s(const std::string& key, const std::vector<int32_t>& v) {
  begin(key, kArray);
  put<uint32_t>(bytes_, kI32);
  put<uint64_t>(bytes_, v.size());
  for (int32_t x : v) put(bytes_, x);
}

void GgufMetadata::add_f32s(const std::string& key, const std::vector<float>& v) {
  begin(key, kArray);
  put<uint32_t>(bytes_, kF32);
  put<uint64_t>(bytes_, v.size());
  for (float x : v) put(bytes_, x);
}

struct GgufWriter::Impl {
  std::string path, tmp;
  posix::UniqueFd fd;
  std::vector<Decl> decls;
  std::vector<uint64_t> bytes;  // each tensor's data, unpadded
  size_t next = 0;              // the tensor due
  uint64_t written = 0;         // of the tensor due
  bool committed = false;

  // Zeros up to the next multiple of the alignment after `n` bytes.
  void pad(uint64_t n) {
    static const char zeros[kAlignment] = {};
    if (padded(n) > n) posix::write_all(fd.get(), zeros, padded(n) - n, tmp);
  }
};

namespace {

// The tensor infos, each data offset the padded sum of the data before it.
std::string tensor_infos(const std::vector<GgufWriter::Decl>& decls, std::vector<uint64_t>& bytes) {
  std::string out;
  std::set<std::string> names;
  uint64_t at = 0;
  for (const GgufWriter::Decl& d : decls) {
    SHARDLM_CHECK(names.insert(d.name).second, "GGUF writer: tensor '{}' declared twice", d.name);
    int64_t n = 1;
    for (int64_t s : d.shape) {
      SHARDLM_CHECK(s > 0, "GGUF writer: '{}' has a dimension of {}", d.name, s);
      n *= s;
    }
    put_string(out, d.name);
    put<uint32_t>(out, uint32_t(d.shape.size()));
    for (auto s = d.shape.rbegin(); s != d.shape.rend(); ++s) put<uint64_t>(out, uint64_t(*s));
    put<uint32_t>(out, uint32_t(d.type));
    put<uint64_t>(out, at);
    bytes.push_back(gguf_type_bytes(d.type, n));
    at += padded(bytes.back());
  }
  return out;
}

}  // namespace

GgufWriter::GgufWriter(const std::string& path, const GgufMetadata& metadata,
                       const std::vector<Decl>& tensors)
    : impl_(std::make_unique<Impl>()) {
  Impl& w = *impl_;
  w.path = path;
  w.tmp = path + ".tmp";
  w.decls = tensors;
  std::string head;
  put<uint32_t>(head, kMagic);
  put<uint32_t>(head, kVersion);
  put<uint64_t>(head, tensors.size());
  put<uint64_t>(head, metadata.count());
  head += metadata.bytes();
  head += tensor_infos(tensors, w.bytes);
  w.fd = posix::open_file(w.tmp, O_WRONLY | O_CREAT | O_TRUNC);
  posix::write_all(w.fd.get(), head.data(), head.size(), w.tmp);
  w.pad(head.size());  // the data section starts aligned
}

GgufWriter::~GgufWriter() {
  if (impl_ && !impl_->committed) {
    impl_->fd = posix::UniqueFd();
    ::unlink(impl_->tmp.c_str());
  }
}

void GgufWriter::write(const std::string& name, const void* bytes, size_t n) {
  Impl& w = *impl_;
  SHARDLM_CHECK(w.next < w.decls.size() && w.decls[w.next].name == name,
                "GGUF writer: '{}' written out of the declared order (due: '{}')", name,
                w.next < w.decls.size() ? w.decls[w.next].name : std::string("nothing"));
  SHARDLM_CHECK(w.written + n <= w.bytes[w.next], "GGUF writer: '{}' gets more than its {} bytes",
                name, w.bytes[w.next]);
  posix::write_all(w.fd.get(), bytes, n, w.tmp);
  w.written += n;
  if (w.written == w.bytes[w.next]) {
    w.pad(w.written);
    ++w.next;
    w.written = 0;
  }
}

void GgufWriter::commit() {
  Impl& w = *impl_;
  SHARDLM_CHECK(w.next == w.decls.size(), "GGUF writer: '{}' was never written",
                w.next < w.decls.size() ? w.decls[w.next].name : std::string());
  posix::fsync_fd(w.fd.get(), w.tmp);
  w.fd.close(w.tmp);
  posix::rename_path(w.tmp, w.path);
  w.committed = true;
  const std::string parent = std::filesystem::path(w.path).parent_path().string();
  posix::fsync_dir(parent.empty() ? "." : parent);
}

}  // namespace shardlm
