// safetensors reading (mmap + validation) and streaming writing (safetensors.h).
#include "shardlm/io/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <system_error>

#include "posix_file.h"
#include "shardlm/core/check.h"
#include "shardlm/core/dtype.h"

namespace shardlm {

using json = nlohmann::json;
namespace fs = std::filesystem;

static_assert(std::endian::native == std::endian::little,
              "safetensors is little endian; a big-endian host needs byte swaps here");

namespace {

constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;  // the format's own limit

struct DTypeEntry {
  StDType type;
  const char* name;
  size_t size;
};
constexpr DTypeEntry kDTypes[] = {
    {StDType::kF64, "F64", 8},   {StDType::kF32, "F32", 4}, {StDType::kF16, "F16", 2},
    {StDType::kBF16, "BF16", 2}, {StDType::kI64, "I64", 8}, {StDType::kI32, "I32", 4},
    {StDType::kI16, "I16", 2},   {StDType::kI8, "I8", 1},   {StDType::kU8, "U8", 1},
    {StDType::kBool, "BOOL", 1},
};

std::string errno_text() { return std::system_category().message(errno); }

[[noreturn]] void fail(const std::string& file, const std::string& what) {
  SHARDLM_FAIL(ErrorKind::kData, "{}: {}", file, what);
}

float f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h >> 15) << 31;
  const uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float v = std::ldexp(float(mant), -24);
    return sign ? -v : v;
  }
  uint32_t bits;
  if (exp == 0x1f)
    bits = sign | 0x7f800000u | (mant << 13);  // inf, NaN (payload kept)
  else
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

}  // namespace

// The whole file mapped read-only; at least the 8 bytes of the header length.
SafetensorsFile::Mapping SafetensorsFile::map_whole_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, "cannot open: " + errno_text());
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    fail(path, "cannot stat: " + errno_text());
  }
  const size_t size = size_t(st.st_size);
  if (size < 8) {
    ::close(fd);
    fail(path, fmt::format("truncated: {} bytes, not even the 8-byte header length", size));
  }
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) fail(path, "cannot map: " + errno_text());
  return Mapping(map, size);
}

SafetensorsFile::Mapping::~Mapping() {
  if (addr != nullptr) ::munmap(addr, size);
}

namespace {

// The header's JSON object, refusing a tensor name that appears twice.
json parse_header(const std::string& path, const std::string& header) {
  // Duplicate names are legal JSON but ambiguous tensors: count keys at the top level.
  std::set<std::string> seen;
  std::string duplicate;
  json doc;
  try {
    doc = json::parse(header, [&](int depth, json::parse_event_t ev, json& parsed) {
      if (depth == 1 && ev == json::parse_event_t::key) {
        const std::string k = parsed.get<std::string>();
        if (!seen.insert(k).second && duplicate.empty()) duplicate = k;
      }
      return true;
    });
  } catch (const json::exception& e) {
    fail(path, fmt::format("the header is not valid JSON: {}", e.what()));
  }
  if (!duplicate.empty())
    fail(path, fmt::format("tensor '{}' appears twice in the header", duplicate));
  if (!doc.is_object()) fail(path, "the header is not a JSON object");
  return doc;
}

// One tensor's header entry, validated: a known dtype, a shape whose bytes its data_offsets
// span, within the data section of `data_bytes`.
StTensorInfo tensor_entry(const std::string& path, const std::string& name, const json& v,
                          uint64_t data_bytes) {
  auto bad = [&](const std::string& what) {
    fail(path, fmt::format("tensor '{}': {}", name, what));
  };
  if (!v.is_object()) bad("the entry is not an object with dtype, shape and data_offsets");
  StTensorInfo t;
  t.name = name;
  if (!v.contains("dtype") || !v["dtype"].is_string()) bad("no dtype string");
  const std::string dt = v["dtype"].get<std::string>();
  const auto* d = std::find_if(std::begin(kDTypes), std::end(kDTypes),
                               [&](const DTypeEntry& e) { return dt == e.name; });
  if (d == std::end(kDTypes))
    bad(fmt::format("unsupported dtype '{}' (F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL)",
                    dt));
  t.dtype = d->type;
  if (!v.contains("shape") || !v["shape"].is_array()) bad("no shape array");
  uint64_t numel = 1;
  for (const json& s : v["shape"]) {
    if (!s.is_number_integer() || s.get<int64_t>() < 0)
      bad("shape has a negative or non-integer size");
    const uint64_t dim = s.get<uint64_t>();
    if (dim != 0 && numel > std::numeric_limits<uint64_t>::max() / 8 / dim)
      bad("shape is too large");
    numel *= dim;
    t.shape.push_back(int64_t(dim));
  }
  const json& off = v.contains("data_offsets") ? v["data_offsets"] : json();
  if (!off.is_array() || off.size() != 2 || !off[0].is_number_unsigned() ||
      !off[1].is_number_unsigned())
    bad("data_offsets must be [begin, end] of non-negative integers");
  t.begin = off[0].get<uint64_t>();
  t.end = off[1].get<uint64_t>();
  if (t.begin > t.end || t.end > data_bytes)
    bad(fmt::format("data_offsets [{}, {}] lie outside the {}-byte data section (truncated file?)",
                    t.begin, t.end, data_bytes));
  if (t.end - t.begin != numel * d->size)
    bad(fmt::format("data_offsets span {} bytes but shape {} of {} needs {}", t.end - t.begin,
                    json(t.shape).dump(), dt, numel * d->size));
  return t;
}

// The data section is covered exactly: no overlaps, no holes (the format's rule). `tensors` in
// offset order.
void check_data_coverage(const std::string& path, const std::vector<StTensorInfo>& tensors,
                         uint64_t data_bytes) {
  uint64_t at = 0;
  for (const StTensorInfo& t : tensors) {
    if (t.begin < at && t.end > t.begin)
      fail(path, fmt::format("tensor '{}' overlaps the tensor before it (bytes {}..{})", t.name,
                             t.begin, at));
    if (t.begin > at)
      fail(path, fmt::format("bytes {}..{} of the data section belong to no tensor (before '{}')",
                             at, t.begin, t.name));
    at = std::max(at, t.end);
  }
  if (at != data_bytes)
    fail(path, fmt::format("bytes {}..{} at the end of the data section belong to no tensor", at,
                           data_bytes));
}

}  // namespace

const char* st_dtype_name(StDType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.name;
  return "?";
}

size_t st_dtype_size(StDType t) {
  for (const auto& d : kDTypes)
    if (d.type == t) return d.size;
  return 0;
}

int64_t StTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---- reading ---------------------------------------------------------------------------------

SafetensorsFile::SafetensorsFile(const std::string& path)
    : path_(path), map_(map_whole_file(path)) {
  const auto* base = static_cast<const std::byte*>(map_.addr);
  uint64_t n = 0;
  std::memcpy(&n, base, 8);
  if (n > kMaxHeaderBytes || n > map_.size - 8)
    fail(path, fmt::format("the header length {} runs past the end of the {}-byte file "
                           "(truncated, or not a safetensors file)",
                           n, map_.size));
  const std::string header(reinterpret_cast<const char*>(base + 8), size_t(n));
  data_ = base + 8 + n;
  const uint64_t data_bytes = map_.size - 8 - n;

  const json doc = parse_header(path, header);
  for (const auto& [name, v] : doc.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) fail(path, "__metadata__ is not an object of strings");
      for (const auto& [k, s] : v.items()) {
        if (!s.is_string()) fail(path, fmt::format("__metadata__ entry '{}' is not a string", k));
        metadata_[k] = s.get<std::string>();
      }
      continue;
    }
    tensors_.push_back(tensor_entry(path, name, v, data_bytes));
  }
  std::sort(tensors_.begin(), tensors_.end(), [](const StTensorInfo& a, const StTensorInfo& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  check_data_coverage(path, tensors_, data_bytes);
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
}

void SafetensorsFile::release_pages() const {
  // A private read-only mapping holds no changes of its own: dropped pages come back from the
  // file (or the page cache) when touched again.
  if (::madvise(map_.addr, map_.size, MADV_DONTNEED) != 0)
    fail(path_, "cannot release the mapping's pages: " + errno_text());
}

const StTensorInfo& SafetensorsFile::info(const std::string& name) const {
  const auto it = index_.find(name);
  if (it == index_.end()) fail(path_, fmt::format("no tensor named '{}'", name));
  return tensors_[it->second];
}

const std::byte* SafetensorsFile::data(const std::string& name) const {
  return data_ + info(name).begin;
}

void SafetensorsFile::read_f32(const std::string& name, float* out) const {
  const StTensorInfo& t = info(name);
  const std::byte* p = data_ + t.begin;
  const int64_t n = t.numel();
  switch (t.dtype) {
    case StDType::kF32:
      std::memcpy(out, p, size_t(n) * 4);
      return;
    case StDType::kBF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = bf16_to_f32(h);
      }
      return;
    case StDType::kF16:
      for (int64_t i = 0; i < n; ++i) {
        uint16_t h;
        std::memcpy(&h, p + 2 * i, 2);
        out[i] = f16_to_f32(h);
      }
      return;
    case StDType::kF64:
      for (int64_t i = 0; i < n; ++i) {
        double d;
        std::memcpy(&d, p + 8 * i, 8);
        out[i] = float(d);
      }
      return;
    default:
      fail(path_, fmt::format("tensor '{}' is {}, not a floating-point type", name,
                              st_dtype_name(t.dtype)));
  }
}

SafetensorsDir::SafetensorsDir(const std::string& dir) : dir_(dir) {
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  const fs::path single = fs::path(dir) / "model.safetensors";
  if (fs::exists(index)) {
    std::ifstream f(index);
    json doc;
    try {
      f >> doc;
    } catch (const json::exception& e) {
      fail(index.string(), fmt::format("not valid JSON: {}", e.what()));
    }
    if (!doc.is_object() || !doc.contains("weight_map") || !doc["weight_map"].is_object())
      fail(index.string(), "no weight_map object");
    for (const auto& [name, file] : doc["weight_map"].items()) {
      if (!file.is_string())
        fail(index.string(), fmt::format("weight_map['{}'] is not a file name", name));
      const std::string fname = file.get<std::string>();
      if (fname.find('/') != std::string::npos || fname == "..")
        fail(index.string(),
             fmt::format("weight_map['{}'] = '{}' is not a file in the directory", name, fname));
      if (!fs::exists(fs::path(dir) / fname))
        fail(index.string(), fmt::format("tensor '{}' is in '{}', which is missing", name, fname));
      where_[name] = fname;
    }
  } else if (fs::exists(single)) {
    open_[single.filename().string()] = std::make_unique<SafetensorsFile>(single.string());
    for (const StTensorInfo& t : open_.begin()->second->tensors())
      where_[t.name] = "model.safetensors";
  } else {
    SHARDLM_FAIL(ErrorKind::kData,
                 "{}: no model.safetensors or model.safetensors.index.json (PyTorch .bin "
                 "weights are not read: save the model with safe_serialization=True)",
                 dir);
  }
}

SafetensorsDir::~SafetensorsDir() = default;

void SafetensorsDir::release_pages() const {
  for (const auto& [name, f] : open_)
    if (f) f->release_pages();
}

const SafetensorsFile& SafetensorsDir::file_of(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end()) SHARDLM_FAIL(ErrorKind::kData, "{}: no tensor named '{}'", dir_, name);
  auto& f = open_[it->second];
  if (!f) f = std::make_unique<SafetensorsFile>((fs::path(dir_) / it->second).string());
  if (!f->contains(name))
    fail(f->path(), fmt::format("the index says '{}' is here, but it is not", name));
  return *f;
}

std::vector<std::string> SafetensorsDir::names() const {
  std::vector<std::string> out;
  for (const auto& [n, f] : where_) out.push_back(n);
  return out;
}

// ---- writing -----------------------------------------------------------------------------------

namespace {

std::string parent_dir(const std::string& path) {
  const std::string p = fs::path(path).parent_path().string();
  return p.empty() ? "." : p;
}

}  // namespace

struct SafetensorsWriter::Impl {
  std::string path, tmp;
  posix::UniqueFd fd;
  std::vector<Decl> decls;
  std::vector<uint64_t> bytes;
  size_t next = 0;       // the tensor due
  uint64_t written = 0;  // of the tensor due
  bool committed = false;
};

SafetensorsWriter::SafetensorsWriter(const std::string& path, const std::vector<Decl>& tensors,
                                     const std::map<std::string, std::string>& metadata)
    : impl_(std::make_unique<Impl>()) {
  Impl& w = *impl_;
  w.path = path;
  w.tmp = path + ".tmp";
  w.decls = tensors;
  json header = json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t at = 0;
  std::set<std::string> names;
  for (const Decl& d : tensors) {
    SHARDLM_CHECK(d.name != "__metadata__" && names.insert(d.name).second,
                  "safetensors writer: tensor name '{}' is reserved or repeated", d.name);
    uint64_t n = 1;
    for (int64_t s : d.shape) {
      SHARDLM_CHECK(s >= 0, "safetensors writer: '{}' has a negative size", d.name);
      n *= uint64_t(s);
    }
    const uint64_t b = n * st_dtype_size(d.dtype);
    header[d.name] = {
        {"dtype", st_dtype_name(d.dtype)}, {"shape", d.shape}, {"data_offsets", {at, at + b}}};
    w.bytes.push_back(b);
    at += b;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // the data section starts 8-byte aligned
  try {
    w.fd = posix::open_file(w.tmp, O_WRONLY | O_CREAT | O_TRUNC);
    const uint64_t n = text.size();
    posix::write_all(w.fd.get(), &n, 8, w.tmp);
    posix::write_all(w.fd.get(), text.data(), text.size(), w.tmp);
  } catch (const Error&) {
    ::unlink(w.tmp.c_str());  // the destructor does not run for a constructor that throws
    throw;
  }
}

SafetensorsWriter::~SafetensorsWriter() {
  if (impl_ && !impl_->committed) {
    impl_->fd = posix::UniqueFd();
    ::unlink(impl_->tmp.c_str());
  }
}

void SafetensorsWriter::write(const std::string& name, const void* bytes, size_t n) {
  Impl& w = *impl_;
  // Empty tensors need no write: skip those due before this one.
  while (w.next < w.decls.size() && w.bytes[w.next] == 0 && w.decls[w.next].name != name) ++w.next;
  SHARDLM_CHECK(w.next < w.decls.size() && w.decls[w.next].name == name,
                "safetensors writer: '{}' written out of the declared order (due: '{}')", name,
                w.next < w.decls.size() ? w.decls[w.next].name : std::string("nothing"));
  SHARDLM_CHECK(w.written + n <= w.bytes[w.next],
                "safetensors writer: '{}' gets more than its {} bytes", name, w.bytes[w.next]);
  if (n > 0) posix::write_all(w.fd.get(), bytes, n, w.tmp);
  w.written += n;
  if (w.written == w.bytes[w.next]) {
    ++w.next;
    w.written = 0;
  }
}

void SafetensorsWriter::commit() {
  Impl& w = *impl_;
  while (w.next < w.decls.size() && w.bytes[w.next] == 0) ++w.next;
  SHARDLM_CHECK(w.next == w.decls.size(), "safetensors writer: '{}' was never written",
                w.next < w.decls.size() ? w.decls[w.next].name : std::string());
  posix::fsync_fd(w.fd.get(), w.tmp);
  w.fd.close(w.tmp);
  posix::rename_path(w.tmp, w.path);
  w.committed = true;
  posix::fsync_dir(parent_dir(w.path));
}

ShardPlan plan_safetensors_shards(const std::vector<size_t>& tensor_bytes, size_t max_shard_bytes) {
  ShardPlan p;
  size_t in_shard = 0;
  int shard = -1;
  for (size_t b : tensor_bytes) {
    if (shard < 0 || (in_shard > 0 && in_shard + b > max_shard_bytes)) {
      ++shard;
      in_shard = 0;
    }
    p.shard_of.push_back(shard);
    in_shard += b;
  }
  const int n = shard + 1;
  if (n <= 1) {
    p.files = {"model.safetensors"};
  } else {
    for (int i = 0; i < n; ++i)
      p.files.push_back(fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, n));
  }
  return p;
}

void write_safetensors_index(const std::string& dir,
                             const std::map<std::string, std::string>& weight_map,
                             uint64_t total_size) {
  const json doc = {{"metadata", {{"total_size", total_size}}}, {"weight_map", weight_map}};
  posix::replace_file((fs::path(dir) / "model.safetensors.index.json").string(),
                      doc.dump(2) + "\n");
}

}  // namespace shardlm
