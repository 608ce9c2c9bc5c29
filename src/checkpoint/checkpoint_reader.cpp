// Checkpoint storage, reading side (checkpoint.h): the reader parses the manifest, checks that
// every listed file is there with its size and that each sharded vector's ranges tile it,
// verifies contents (every file's and every range's CRC-32, on one process or split over a
// group), and reads files, byte ranges of them, and element ranges of vectors wherever they
// lie, re-checking sizes on disk at each read.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <nlohmann/json.hpp>

#include "checkpoint_files.h"
#include "io/posix_file.h"
#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/core/check.h"

namespace shardlm {

using json = nlohmann::json;
using namespace checkpoint_files;

namespace {

template <class Range>
RunShape shape_of(const Range& r) {
  return {r.begin, r.count, r.stride, r.repeat};
}

}  // namespace

CheckpointReader::CheckpointReader(const std::string& dir, Verify verify) {
  // A checkpoints directory has `latest`; a step directory has its manifest.
  const std::string latest = is_file(dir + "/" + kManifestName) ? "" : read_latest_name(dir);
  dir_ = latest.empty() ? dir : dir + "/" + latest;
  const std::string manifest_path = dir_ + "/" + kManifestName;
  if (!is_file(manifest_path)) {
    SHARDLM_FAIL(
        ErrorKind::kData, "{}: missing{}", manifest_path,
        latest.empty() ? fmt::format(" (and there is no {}/{} to follow)", dir, kLatestName) : "");
  }
  parse_manifest(manifest_path);
  // Size first (cheap, and the clearest message), then a streaming CRC-32 of the contents.
  for (const File& f : files_) check_size(f);
  if (verify == Verify::kContents) verify_contents(0, 1);
}

void CheckpointReader::parse_manifest(const std::string& manifest_path) {
  try {
    posix::UniqueFd fd = posix::open_file(manifest_path, O_RDONLY);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) posix::fail_errno(manifest_path, "stat", errno);
    std::string text(static_cast<size_t>(st.st_size), '\0');
    text.resize(posix::read_up_to(fd.get(), text.data(), text.size(), manifest_path));
    const json manifest = json::parse(text);
    const int format = manifest.at("format").get<int>();
    if (format < kOldestManifestFormat || format > kManifestFormat)
      throw std::runtime_error(fmt::format("format {}, expected {} to {}", format,
                                           kOldestManifestFormat, kManifestFormat));
    step_ = manifest.at("step").get<int64_t>();
    if (manifest.contains("vectors"))
      for (const auto& [name, v] : manifest.at("vectors").items()) {
        Vector vec;
        vec.elem_bytes = v.at("elem_bytes").get<size_t>();
        vec.elems = v.at("elems").get<int64_t>();
        if (vec.elem_bytes == 0 || vec.elems < 0)
          throw std::runtime_error(fmt::format("bad shape of vector \"{}\"", name));
        vectors_.emplace_back(name, std::move(vec));
      }
    for (const auto& [name, entry] : manifest.at("files").items()) {
      if (!valid_file_name(name) || name == kManifestName)
        throw std::runtime_error(fmt::format("bad file name \"{}\"", name));
      File f;
      f.name = name;
      f.bytes = entry.at("bytes").get<size_t>();
      f.crc = parse_crc_hex(entry.at("crc32").get<std::string>(), name);
      if (entry.contains("vector")) {
        f.vector = entry.at("vector").get<std::string>();
        for (const json& r : entry.at("ranges")) {
          // [begin, count, offset, crc32], and from format 3 a strided run's stride and repeat
          if (r.size() != 4 && !(r.size() == 6 && format >= 3))
            throw std::runtime_error(fmt::format("{}: a range of {} fields", name, r.size()));
          Range range{r.at(0).get<int64_t>(), r.at(1).get<int64_t>()};
          if (r.size() == 6) {
            range.stride = r.at(4).get<int64_t>();
            range.repeat = r.at(5).get<int64_t>();
          }
          range.offset = r.at(2).get<uint64_t>();
          range.crc = parse_crc_hex(r.at(3).get<std::string>(), name);
          f.ranges.push_back(range);
        }
      }
      files_.push_back(std::move(f));
    }
    index_vectors();
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    SHARDLM_FAIL(ErrorKind::kData, "{}: manifest unreadable ({})", manifest_path, e.what());
  }
}

// Each vector's ranges by element, checked to lie inside their files and to tile the vector
// (row by row through the runs, never a table of rows).
void CheckpointReader::index_vectors() {
  for (size_t i = 0; i < files_.size(); ++i) {
    const File& f = files_[i];
    if (f.vector.empty()) continue;
    auto it = std::find_if(vectors_.begin(), vectors_.end(),
                           [&](const auto& v) { return v.first == f.vector; });
    if (it == vectors_.end())
      throw std::runtime_error(fmt::format("{}: undeclared vector \"{}\"", f.name, f.vector));
    uint64_t at = 0;  // the ranges fill the file in order
    for (const Range& r : f.ranges) {
      const std::string bad = run_shape_error(shape_of(r), it->second.elems);
      if (!bad.empty() || r.offset != at)
        throw std::runtime_error(fmt::format("{}: bad range of \"{}\" ({})", f.name, f.vector,
                                             bad.empty() ? "not where the file's bytes" : bad));
      at += uint64_t(r.count) * uint64_t(r.repeat) * it->second.elem_bytes;
      it->second.ranges.emplace_back(r, i);
    }
    if (at != f.bytes)
      throw std::runtime_error(
          fmt::format("{}: ranges of {} bytes in a file of {}", f.name, at, f.bytes));
  }
  for (auto& [name, v] : vectors_) {
    std::sort(v.ranges.begin(), v.ranges.end(),
              [](const auto& a, const auto& b) { return a.first.begin < b.first.begin; });
    std::vector<RunShape> shapes;
    for (const auto& [r, file] : v.ranges) {
      shapes.push_back(shape_of(r));
      v.reach.push_back(std::max(v.reach.empty() ? 0 : v.reach.back(), shapes.back().end()));
    }
    const std::string gap = tiling_error(shapes, v.elems);
    if (!gap.empty()) throw std::runtime_error(fmt::format("vector \"{}\": {}", name, gap));
  }
}

const CheckpointReader::File* CheckpointReader::find(const std::string& name) const {
  for (const File& f : files_)
    if (f.name == name) return &f;
  return nullptr;
}

std::string CheckpointReader::holds_text(const File& f) const {
  if (f.vector.empty() || f.ranges.empty()) return "";
  std::string text = fmt::format(" (holds {} elements", f.vector);
  const size_t shown = std::min<size_t>(f.ranges.size(), 3);
  for (size_t i = 0; i < shown; ++i)
    text += fmt::format("{} {}", i ? "," : "", run_text(shape_of(f.ranges[i])));
  if (shown < f.ranges.size()) text += fmt::format(" and {} more ranges", f.ranges.size() - shown);
  return text + ")";
}

void CheckpointReader::check_size(const File& f) const {
  const std::string path = dir_ + "/" + f.name;
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) SHARDLM_FAIL(ErrorKind::kData, "{}: missing{}", path, holds_text(f));
    posix::fail_errno(path, "stat", errno);
  }
  const auto actual = static_cast<size_t>(st.st_size);
  if (actual < f.bytes)
    SHARDLM_FAIL(ErrorKind::kData, "{}: truncated ({} of {} bytes){}", path, actual, f.bytes,
                 holds_text(f));
  if (actual > f.bytes)
    SHARDLM_FAIL(ErrorKind::kData, "{}: wrong size ({} bytes, the manifest says {}){}", path,
                 actual, f.bytes, holds_text(f));
}

void CheckpointReader::verify_contents(int part, int parts) const {
  SHARDLM_CHECK(parts >= 1 && part >= 0 && part < parts, "verify_contents: part {} of {}", part,
                parts);
  for (size_t i = size_t(part); i < files_.size(); i += size_t(parts)) verify_file(files_[i]);
}

void CheckpointReader::verify_contents_for(const std::vector<std::string>& vectors) const {
  for (const File& f : files_)
    if (f.vector.empty() || std::find(vectors.begin(), vectors.end(), f.vector) != vectors.end())
      verify_file(f);
}

void CheckpointReader::verify_file(const File& f) const {
  const std::string path = dir_ + "/" + f.name;
  posix::UniqueFd fd = posix::open_file(path, O_RDONLY);
  std::vector<char> buf(kIoChunk);
  uint32_t crc = crc32_empty();
  size_t total = 0;
  // Streams [total, end) into the file's CRC and returns that stretch's own CRC.
  auto stream_to = [&](size_t end) {
    uint32_t part = crc32_empty();
    while (total < end) {
      const size_t want = std::min(buf.size(), end - total);
      const size_t n = posix::read_up_to(fd.get(), buf.data(), want, path);
      if (n == 0)
        SHARDLM_FAIL(ErrorKind::kData, "{}: truncated ({} of {} bytes){}", path, total, f.bytes,
                     holds_text(f));
      crc = crc32_update(crc, buf.data(), n);
      part = crc32_update(part, buf.data(), n);
      total += n;
    }
    return part;
  };
  size_t eb = 0;  // of the file's vector (index_vectors checked that it is declared)
  for (const auto& [name, v] : vectors_)
    if (name == f.vector) eb = v.elem_bytes;
  for (const Range& r : f.ranges) {
    const uint32_t got = stream_to(size_t(r.offset) + size_t(r.count) * size_t(r.repeat) * eb);
    if (got != r.crc)
      SHARDLM_FAIL(ErrorKind::kData,
                   "{}: checksum mismatch in {} elements {} (crc32 {}, the manifest says {})", path,
                   f.vector, run_text(shape_of(r)), crc_hex(got), crc_hex(r.crc));
  }
  stream_to(f.bytes);
  if (posix::read_up_to(fd.get(), buf.data(), 1, path) != 0)
    SHARDLM_FAIL(ErrorKind::kData, "{}: wrong size (longer than the manifest's {} bytes)", path,
                 f.bytes);
  if (crc != f.crc)
    SHARDLM_FAIL(ErrorKind::kData, "{}: checksum mismatch (crc32 {}, the manifest says {})", path,
                 crc_hex(crc), crc_hex(f.crc));
}

bool CheckpointReader::has(const std::string& name) const { return find(name) != nullptr; }

size_t CheckpointReader::size(const std::string& name) const {
  if (const File* f = find(name)) return f->bytes;
  SHARDLM_FAIL(ErrorKind::kData, "{}/{}: missing (not in the checkpoint's manifest)", dir_, name);
}

void CheckpointReader::read(const std::string& name, void* dst, size_t bytes) const {
  const size_t expected = size(name);
  if (bytes != expected)
    SHARDLM_FAIL(ErrorKind::kData,
                 "{}/{}: holds {} bytes but {} were expected (a checkpoint of a different model?)",
                 dir_, name, expected, bytes);
  read_range(name, 0, dst, bytes);
}

void CheckpointReader::read_range(const std::string& name, uint64_t offset, void* dst,
                                  size_t bytes) const {
  const size_t expected = size(name);
  const std::string path = dir_ + "/" + name;
  if (offset > expected || bytes > expected - offset)
    SHARDLM_FAIL(ErrorKind::kData,
                 "{}: cannot read bytes [{}, {}): past the end of the file ({} bytes)", path,
                 offset, static_cast<unsigned __int128>(offset) + bytes, expected);
  // The size is checked again on disk: the file may have changed since it was verified, and a
  // kSizesOnly reader never saw its contents.
  posix::UniqueFd fd = posix::open_file(path, O_RDONLY);
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) posix::fail_errno(path, "stat", errno);
  const auto actual = static_cast<size_t>(st.st_size);
  if (actual < expected)
    SHARDLM_FAIL(ErrorKind::kData, "{}: truncated ({} of {} bytes)", path, actual, expected);
  if (actual > expected)
    SHARDLM_FAIL(ErrorKind::kData, "{}: wrong size (longer than the manifest's {} bytes)", path,
                 expected);
  const size_t n = posix::pread_up_to(fd.get(), dst, bytes, offset, path);
  if (n < bytes)
    SHARDLM_FAIL(ErrorKind::kData, "{}: truncated (ends before byte {}; the manifest says {})",
                 path, offset + bytes, expected);
}

std::vector<char> CheckpointReader::read_all(const std::string& name) const {
  std::vector<char> data(size(name));
  read(name, data.data(), data.size());
  return data;
}

nlohmann::json CheckpointReader::read_json(const std::string& name) const {
  const std::vector<char> data = read_all(name);
  try {
    return json::parse(data.begin(), data.end());
  } catch (const json::exception& e) {
    SHARDLM_FAIL(ErrorKind::kData, "{}/{}: not valid JSON ({})", dir_, name, e.what());
  }
}

bool CheckpointReader::has_vector(const std::string& name) const {
  return std::any_of(vectors_.begin(), vectors_.end(),
                     [&](const auto& v) { return v.first == name; }) ||
         has(name + ".bin");
}

size_t CheckpointReader::vector_bytes(const std::string& name) const {
  for (const auto& [n, v] : vectors_)
    if (n == name) return size_t(v.elems) * v.elem_bytes;
  if (has(name + ".bin")) return size(name + ".bin");
  SHARDLM_FAIL(ErrorKind::kData, "{}: holds no vector \"{}\" (neither in the manifest nor {}.bin)",
               dir_, name, name);
}

void CheckpointReader::read_vector(const std::string& name, uint64_t offset, void* dst,
                                   size_t bytes) const {
  auto it = std::find_if(vectors_.begin(), vectors_.end(),
                         [&](const auto& v) { return v.first == name; });
  if (it == vectors_.end()) return read_range(name + ".bin", offset, dst, bytes);
  const Vector& v = it->second;
  const size_t eb = v.elem_bytes;
  if (offset % eb != 0 || bytes % eb != 0 || offset + bytes > size_t(v.elems) * eb)
    SHARDLM_FAIL(ErrorKind::kData,
                 "{}: vector \"{}\" cannot be read at bytes [{}, {}) ({} of {} "
                 "bytes each)",
                 dir_, name, offset, offset + bytes, v.elems, eb);
  int64_t at = int64_t(offset / eb);
  const int64_t end = at + int64_t(bytes / eb);
  auto* out = static_cast<char*>(dst);
  while (at < end) {
    const auto [entry, k] = locate(name, v, at);
    const Range& range = entry->first;
    const int64_t row = range.begin + k * range.stride;
    const int64_t n = std::min(end, row + range.count) - at;
    const uint64_t in_file = uint64_t(k * range.count + (at - row)) * eb;
    read_range(files_[entry->second].name, range.offset + in_file, out, size_t(n) * eb);
    out += size_t(n) * eb;
    at += n;
  }
}

std::pair<const std::pair<CheckpointReader::Range, size_t>*, int64_t> CheckpointReader::locate(
    const std::string& name, const Vector& v, int64_t at) const {
  // Ranges starting at or before `at`, latest first, while one of them can still reach it.
  auto it = std::upper_bound(v.ranges.begin(), v.ranges.end(), at,
                             [](int64_t x, const auto& e) { return x < e.first.begin; });
  for (size_t i = size_t(it - v.ranges.begin()); i > 0 && v.reach[i - 1] > at; --i) {
    const Range& r = v.ranges[i - 1].first;
    const int64_t from = at - r.begin;
    const int64_t k = r.repeat == 1 ? 0 : from / r.stride;
    if (k < r.repeat && from - k * r.stride < r.count) return {&v.ranges[i - 1], k};
  }
  SHARDLM_FAIL(ErrorKind::kData, "{}: vector \"{}\": element {} is in no file", dir_, name, at);
}

}  // namespace shardlm
