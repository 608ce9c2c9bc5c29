// GGUF, ggml's model file (docs/gguf.md in ggml-org/ggml), written: the format only, no model
// knowledge (the export's mapping is checkpoint/gguf_export.h).
//
// A file is, little-endian: "GGUF", version 3 (u32), tensor count and metadata count (u64);
// the metadata, each a key (u64 length + UTF-8 bytes), a value type (u32) and the value
// (arrays: element type u32, count u64, elements); one info per tensor: name, number of
// dimensions (u32), the dimensions innermost first (ggml's ne, u64 each), the ggml type (u32)
// and the data's offset (u64) from the start of the data section; padding to 32 bytes; then
// each tensor's data, itself padded to 32 bytes. Every offset follows from the declarations,
// so the writer puts the whole head first and then streams the data in the declared order,
// never holding more than the caller's buffer; the file is written as PATH.tmp, fsynced and
// renamed into place.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

namespace shardlm {

// The tensor types written (ggml_type's numbers).
enum class GgufType : uint32_t { kF32 = 0, kF16 = 1, kQ8_0 = 8, kBF16 = 30 };
const char* gguf_type_name(GgufType t);  // "F32", "F16", "Q8_0", "BF16"
// Q8_0's block: 32 values as an f16 scale d and 32 int8 q (x = d q), 34 bytes.
constexpr int64_t kGgufQ8Block = 32;
// The bytes of n values of type t (Q8_0: n a multiple of kGgufQ8Block).
size_t gguf_type_bytes(GgufType t, int64_t n);
// n f32 values into out [gguf_type_bytes(t, n)]: f16 and bf16 rounded to nearest even; Q8_0
// as ggml's reference quantizer (d = max |x| / 127 rounded to f16, q = x / d rounded half away
// from zero with the f32 d), so that the bytes equal llama.cpp's.
void gguf_encode(GgufType t, const float* in, int64_t n, std::byte* out);
// f32 -> IEEE half, round to nearest even (overflow to infinity, NaN stays NaN).
uint16_t f32_to_f16(float f);

// The metadata, in the order added. A key added twice is a bug (kInternal).
class GgufMetadata {
 public:
  void add_u32(const std::string& key, uint32_t v);
  void add_i32(const std::string& key, int32_t v);
  void add_f32(const std::string& key, float v);
  void add_bool(const std::string& key, bool v);
  void add_string(const std::string& key, const std::string& v);
  void add_strings(const std::string& key, const std::vector<std::string>& v);
  void add_i32s(const std::string& key, const std::vector<int32_t>& v);
  void add_f32s(const std::string& key, const std::vector<float>& v);
  bool has(const std::string& key) const { return keys_.count(key) != 0; }
  uint64_t count() const { return keys_.size(); }
  const std::string& bytes() const { return bytes_; }  // the encoded key-value pairs

 private:
  void begin(const std::string& key, uint32_t type);
  std::string bytes_;
  std::set<std::string> keys_;
};

// Streaming writer of one file: every tensor declared up front, then each one's bytes (already
// in its type, gguf_encode) in the declared order with write(), whole or in consecutive parts;
// commit() pads, fsyncs and renames the file into place. Destroyed without commit(), the
// temporary file is removed.
class GgufWriter {
 public:
  struct Decl {
    std::string name;
    GgufType type;
    std::vector<int64_t> shape;  // outermost first, as PyTorch's (written innermost first)
  };
  GgufWriter(const std::string& path, const GgufMetadata& metadata,
             const std::vector<Decl>& tensors);
  ~GgufWriter();
  GgufWriter(const GgufWriter&) = delete;
  GgufWriter& operator=(const GgufWriter&) = delete;
  // The next declared tensor's bytes (kInternal when `name` is not the one due, or more bytes
  // than declared arrive).
  void write(const std::string& name, const void* bytes, size_t n);
  void commit();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace shardlm
