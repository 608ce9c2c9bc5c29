// safetensors: Hugging Face's tensor file format. A file is an 8-byte little-endian header
// length N, N bytes of JSON ({"name": {"dtype": "BF16", "shape": [..], "data_offsets": [b, e]},
// "__metadata__": {"k": "v"}}) and the data section the offsets index. Models too large for
// one file are split into `model-0000X-of-0000N.safetensors` with `model.safetensors.index.json`
// ({"metadata": {...}, "weight_map": {"name": "file"}}).
//
// Reading maps the file (no copy) and validates everything before handing out a byte: header
// length against the file size, the JSON, each tensor's dtype, shape, offsets (inside the data
// section, span = elements x dtype size, no overlaps) and duplicate names. Any fault is
// Error(kData) naming the file and the tensor. Writing streams: the header (every tensor's
// name, dtype and shape) first, then each tensor's bytes in order, never the whole file in
// memory; the file is written under a temporary name, fsynced and renamed into place.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace shardlm {

// The element types shardlm reads and writes (safetensors' names). Others (F8_*, U16, ...)
// are refused by name.
enum class StDType : uint8_t { kF64, kF32, kF16, kBF16, kI64, kI32, kI16, kI8, kU8, kBool };
const char* st_dtype_name(StDType t);
size_t st_dtype_size(StDType t);

struct StTensorInfo {
  std::string name;
  StDType dtype = StDType::kF32;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets in the data section
  int64_t numel() const;
};

class SafetensorsFile {
 public:
  // Maps and validates `path`; throws Error(kData) naming the file (and tensor).
  explicit SafetensorsFile(const std::string& path);
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<StTensorInfo>& tensors() const { return tensors_; }  // in offset order
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  // Throws Error(kData) naming the file when `name` is not in it.
  const StTensorInfo& info(const std::string& name) const;
  const std::byte* data(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

  // The tensor's values as f32 into out[numel] (F32, BF16, F16, F64 convert; integers refused).
  void read_f32(const std::string& name, float* out) const;
  // Drops the mapping's resident pages (madvise DONTNEED): a reader that streams a model
  // through the file calls it after each part, so that what it has read does not stay in its
  // resident set. The data stays readable (pages fault back in from the file).
  void release_pages() const;

 private:
  // The whole file mapped read-only, unmapped by its destructor: a member, so that a
  // constructor that throws after mapping (a malformed header) unmaps it too.
  struct Mapping {
    void* addr = nullptr;
    size_t size = 0;
    Mapping(void* a, size_t n) : addr(a), size(n) {}
    Mapping(const Mapping&) = delete;
    Mapping& operator=(const Mapping&) = delete;
    ~Mapping();
  };
  static Mapping map_whole_file(const std::string& path);

  std::string path_;
  Mapping map_;
  const std::byte* data_ = nullptr;  // start of the data section
  std::vector<StTensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A Hugging Face directory's weights: `model.safetensors`, or the shards that
// `model.safetensors.index.json` lists (each opened on first use).
class SafetensorsDir {
 public:
  // Throws Error(kData) naming the directory when it has neither, or naming the index when a
  // shard it lists is missing.
  explicit SafetensorsDir(const std::string& dir);
  ~SafetensorsDir();
  const std::string& dir() const { return dir_; }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  // The file holding `name` (opened on first use); Error(kData) when no file has it.
  const SafetensorsFile& file_of(const std::string& name) const;
  std::vector<std::string> names() const;
  // release_pages() of every file opened so far.
  void release_pages() const;

 private:
  std::string dir_;
  std::map<std::string, std::string> where_;  // tensor -> file name
  mutable std::map<std::string, std::unique_ptr<SafetensorsFile>> open_;
};

// Streaming writer of one file. Declare every tensor (name, dtype, shape) up front, then write
// each one's bytes in the declared order with write(); commit() fsyncs and renames the file
// into place. Destroyed without commit(), the temporary file is removed.
class SafetensorsWriter {
 public:
  struct Decl {
    std::string name;
    StDType dtype;
    std::vector<int64_t> shape;
  };
  SafetensorsWriter(const std::string& path, const std::vector<Decl>& tensors,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  // The next declared tensor's bytes, whole or in consecutive parts (kInternal when the name
  // is not the one due, or more bytes than declared arrive).
  void write(const std::string& name, const void* bytes, size_t n);
  void commit();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The shards of a model of `total_bytes` at most `max_shard_bytes` each: tensor i goes to shard
// shard_of[i] (tensors in order, a new shard when the next tensor would overflow the current
// one; a tensor larger than the limit gets a shard of its own). File names follow Hugging
// Face: model.safetensors when there is one shard, model-0000X-of-0000N.safetensors otherwise.
struct ShardPlan {
  std::vector<int> shard_of;
  std::vector<std::string> files;
};
ShardPlan plan_safetensors_shards(const std::vector<size_t>& tensor_bytes, size_t max_shard_bytes);

// Writes model.safetensors.index.json (atomically) for a sharded model.
void write_safetensors_index(const std::string& dir,
                             const std::map<std::string, std::string>& weight_map,
                             uint64_t total_size);

}  // namespace shardlm
