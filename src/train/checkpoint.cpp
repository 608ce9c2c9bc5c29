// Checkpoint storage (checkpoint.h): the writer streams files (whole or piece by piece) into a
// temporary directory with their CRC-32, commits with manifest + fsync + rename + `latest`,
// and rotates old checkpoints; the reader verifies every file against the manifest (sizes,
// and contents unless told not to) before anything is read, and re-checks sizes on reads.
// It stores bytes only: what a checkpoint holds is the trainer's business.
#include "shardlm/train/checkpoint.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <system_error>

#include "io/posix_file.h"
#include "shardlm/core/check.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr int kManifestFormat = 1;
constexpr const char* kManifestName = "manifest.json";
constexpr const char* kLatestName = "latest";
constexpr const char* kTmpPrefix = ".tmp-";
constexpr size_t kIoChunk = size_t{4} << 20;  // streaming unit for CRC and copies

std::string step_dir_name(int64_t step) { return fmt::format("step_{:08d}", step); }

// The step of a "step_<digits>" name, or -1.
int64_t parse_step_dir_name(const std::string& name) {
  if (name.size() <= 5 || name.compare(0, 5, "step_") != 0 || name.size() > 5 + 18) return -1;
  int64_t step = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    step = step * 10 + (name[i] - '0');
  }
  return step;
}

bool valid_file_name(const std::string& name) {
  return !name.empty() && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos && name.find("..") == std::string::npos &&
         name != ".";
}

uint32_t crc32_update(uint32_t crc, const void* data, size_t bytes) {
  const auto* p = static_cast<const Bytef*>(data);
  while (bytes > 0) {
    const uInt n = static_cast<uInt>(std::min(bytes, kIoChunk));
    crc = static_cast<uint32_t>(::crc32(crc, p, n));
    p += n;
    bytes -= n;
  }
  return crc;
}

std::string crc_hex(uint32_t crc) { return fmt::format("{:08x}", crc); }

bool is_dir(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec);
}

bool is_file(const std::string& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec);
}

// Entry names in `dir`; none when it does not exist. Listed before anything is removed.
std::vector<std::string> dir_entries(const std::string& dir) {
  std::vector<std::string> names;
  std::error_code ec;
  if (!fs::exists(dir, ec)) return names;
  fs::directory_iterator it(dir, ec), end;
  for (; !ec && it != end; it.increment(ec)) names.push_back(it->path().filename().string());
  if (ec) SHARDLM_FAIL(ErrorKind::kData, "{}: cannot list: {}", dir, ec.message());
  return names;
}

// Removes a directory tree by first renaming it to a `.tmp-` name, so that an interrupted
// removal leaves something the next writer cleans up rather than a half-deleted checkpoint.
void remove_dir_safely(const std::string& parent, const std::string& name) {
  const std::string from = parent + "/" + name;
  const std::string doomed = parent + "/" + kTmpPrefix + "delete-" + name;
  std::error_code ec;
  fs::remove_all(doomed, ec);
  if (::rename(from.c_str(), doomed.c_str()) != 0) posix::fail_errno(from, "rename", errno);
  fs::remove_all(doomed, ec);
  if (ec) SHARDLM_FAIL(ErrorKind::kData, "{}: remove failed: {}", doomed, ec.message());
}

// `latest`'s step directory name, "" when there is no `latest`. Throws kData when it exists
// but does not name a step directory.
std::string read_latest_name(const std::string& checkpoints_dir) {
  const std::string path = checkpoints_dir + "/" + kLatestName;
  if (!is_file(path)) return "";
  posix::UniqueFd fd = posix::open_file(path, O_RDONLY);
  char buf[64];
  const size_t n = posix::read_up_to(fd.get(), buf, sizeof(buf), path);
  std::string name(buf, n);
  while (!name.empty() && (name.back() == '\n' || name.back() == '\r' || name.back() == ' '))
    name.pop_back();
  if (parse_step_dir_name(name) < 0)
    SHARDLM_FAIL(ErrorKind::kData,
                 "{}: does not name a checkpoint (expected \"step_NNNNNNNN\"); delete it or "
                 "write the name of a complete checkpoint into it",
                 path);
  return name;
}

// Complete checkpoints as (step, name), newest first.
std::vector<std::pair<int64_t, std::string>> complete_checkpoints(const std::string& dir) {
  std::vector<std::pair<int64_t, std::string>> out;
  for (const std::string& name : dir_entries(dir)) {
    const int64_t step = parse_step_dir_name(name);
    if (step < 0 || !is_dir(dir + "/" + name)) continue;
    if (!is_file(dir + "/" + name + "/" + kManifestName)) continue;
    out.emplace_back(step, name);
  }
  std::sort(out.begin(), out.end(), std::greater<>());
  return out;
}

}  // namespace

// ---- CheckpointWriter ---------------------------------------------------------------------------

struct CheckpointWriter::Impl {
  std::string checkpoints_dir;
  int64_t step = 0;
  std::string tmp_dir;
  std::map<std::string, std::pair<uint64_t, uint32_t>> files;  // name -> (bytes, crc32)
  bool committed = false;
  // The file between begin_file and end_file (open_name empty when none).
  std::string open_name;
  std::string open_path;
  posix::UniqueFd open_fd;
  uint64_t open_bytes = 0;
  uint32_t open_crc = 0;
};

CheckpointWriter::CheckpointWriter(const std::string& checkpoints_dir, int64_t step)
    : impl_(new Impl) {
  std::unique_ptr<Impl> impl(impl_);
  SHARDLM_CHECK(step >= 0, "checkpoint step must be >= 0, got {}", step);
  impl->checkpoints_dir = checkpoints_dir;
  impl->step = step;
  std::error_code ec;
  fs::create_directories(checkpoints_dir, ec);
  if (ec)
    SHARDLM_FAIL(ErrorKind::kData, "{}: cannot create checkpoint directory: {}", checkpoints_dir,
                 ec.message());
  // Anything under a temporary name is left over from a write or removal that was
  // interrupted: no complete checkpoint lives there (one writer per directory at a time).
  for (const std::string& name : dir_entries(checkpoints_dir)) {
    if (name.rfind(kTmpPrefix, 0) != 0 && name != std::string(kLatestName) + ".tmp") continue;
    fs::remove_all(checkpoints_dir + "/" + name, ec);
    if (ec)
      SHARDLM_FAIL(ErrorKind::kData, "{}/{}: cannot remove stale temporary: {}", checkpoints_dir,
                   name, ec.message());
  }
  impl->tmp_dir = checkpoints_dir + "/" + kTmpPrefix + step_dir_name(step);
  if (::mkdir(impl->tmp_dir.c_str(), 0755) != 0) posix::fail_errno(impl->tmp_dir, "mkdir", errno);
  impl.release();
}

CheckpointWriter::~CheckpointWriter() {
  if (!impl_->committed) {
    std::error_code ec;
    fs::remove_all(impl_->tmp_dir, ec);
  }
  delete impl_;
}

void CheckpointWriter::begin_file(const std::string& name) {
  SHARDLM_CHECK(!impl_->committed, "checkpoint {} is already committed", impl_->step);
  SHARDLM_CHECK(impl_->open_name.empty(),
                "checkpoint file \"{}\" begun while \"{}\" is still open (call end_file first)",
                name, impl_->open_name);
  SHARDLM_CHECK(valid_file_name(name) && name != kManifestName,
                "invalid checkpoint file name \"{}\" (no '/', no \"..\", not {})", name,
                kManifestName);
  SHARDLM_CHECK(impl_->files.count(name) == 0, "checkpoint file \"{}\" added twice", name);
  const std::string path = impl_->tmp_dir + "/" + name;
  impl_->open_fd = posix::open_file(path, O_WRONLY | O_CREAT | O_EXCL);
  impl_->open_name = name;
  impl_->open_path = path;
  impl_->open_bytes = 0;
  impl_->open_crc = static_cast<uint32_t>(::crc32(0, Z_NULL, 0));
}

void CheckpointWriter::append(const void* data, size_t bytes) {
  SHARDLM_CHECK(!impl_->open_name.empty(), "checkpoint append with no file open (call begin_file)");
  const char* p = static_cast<const char*>(data);
  // Chunk by chunk, so that each chunk is still in cache when it is written.
  for (size_t done = 0; done < bytes;) {
    const size_t n = std::min(kIoChunk, bytes - done);
    impl_->open_crc = crc32_update(impl_->open_crc, p + done, n);
    posix::write_all(impl_->open_fd.get(), p + done, n, impl_->open_path);
    done += n;
  }
  impl_->open_bytes += bytes;
}

void CheckpointWriter::end_file() {
  SHARDLM_CHECK(!impl_->open_name.empty(), "checkpoint end_file with no file open");
  posix::fsync_fd(impl_->open_fd.get(), impl_->open_path);
  impl_->open_fd.close(impl_->open_path);
  impl_->files[impl_->open_name] = {impl_->open_bytes, impl_->open_crc};
  impl_->open_name.clear();
  impl_->open_path.clear();
}

void CheckpointWriter::add_file(const std::string& name, const void* data, size_t bytes) {
  begin_file(name);
  append(data, bytes);
  end_file();
}

void CheckpointWriter::add_json(const std::string& name, const nlohmann::json& value) {
  const std::string text = value.dump(2) + "\n";
  add_file(name, text.data(), text.size());
}

std::string CheckpointWriter::commit(int64_t keep_last) {
  SHARDLM_CHECK(!impl_->committed, "checkpoint {} is already committed", impl_->step);
  SHARDLM_CHECK(keep_last >= 0, "keep_last must be >= 0, got {}", keep_last);
  SHARDLM_CHECK(impl_->open_name.empty(),
                "checkpoint {} committed while file \"{}\" is still open (call end_file first)",
                impl_->step, impl_->open_name);
  const std::string& dir = impl_->checkpoints_dir;

  json files = json::object();
  for (const auto& [name, info] : impl_->files)
    files[name] = {{"bytes", info.first}, {"crc32", crc_hex(info.second)}};
  const json manifest = {{"format", kManifestFormat}, {"step", impl_->step}, {"files", files}};
  const std::string text = manifest.dump(2) + "\n";
  const std::string manifest_path = impl_->tmp_dir + "/" + kManifestName;
  {
    posix::UniqueFd fd = posix::open_file(manifest_path, O_WRONLY | O_CREAT | O_EXCL);
    posix::write_all(fd.get(), text.data(), text.size(), manifest_path);
    posix::fsync_fd(fd.get(), manifest_path);
    fd.close(manifest_path);
  }
  posix::fsync_dir(impl_->tmp_dir);

  const std::string name = step_dir_name(impl_->step);
  const std::string final_dir = dir + "/" + name;
  if (::rename(impl_->tmp_dir.c_str(), final_dir.c_str()) != 0) {
    if (errno != EEXIST && errno != ENOTEMPTY) posix::fail_errno(final_dir, "rename", errno);
    // A checkpoint of this step exists already (a resumed run came past it again): swap the
    // new one in atomically, so that `latest` never names a missing directory.
    if (::renameat2(AT_FDCWD, impl_->tmp_dir.c_str(), AT_FDCWD, final_dir.c_str(),
                    RENAME_EXCHANGE) != 0) {
      if (errno != EINVAL && errno != ENOSYS) posix::fail_errno(final_dir, "rename", errno);
      // No exchange on this file system: move the old one aside first (a short window in
      // which `latest` may name a missing directory; list_checkpoints still finds the rest).
      const std::string aside = dir + "/" + kTmpPrefix + "replaced-" + name;
      std::error_code ec;
      fs::remove_all(aside, ec);
      if (::rename(final_dir.c_str(), aside.c_str()) != 0)
        posix::fail_errno(final_dir, "rename", errno);
      if (::rename(impl_->tmp_dir.c_str(), final_dir.c_str()) != 0)
        posix::fail_errno(final_dir, "rename", errno);
      fs::remove_all(aside, ec);
    }
    std::error_code ec;
    fs::remove_all(impl_->tmp_dir, ec);  // now the old checkpoint; a leftover is cleaned later
  }
  impl_->committed = true;
  posix::fsync_dir(dir);
  posix::replace_file(dir + "/" + kLatestName, name + "\n");

  if (keep_last > 0) {
    const std::string latest = read_latest_name(dir);
    int64_t kept = 0;
    for (const auto& [step, old] : complete_checkpoints(dir)) {
      if (kept < keep_last || old == name || old == latest) {
        ++kept;
        continue;
      }
      remove_dir_safely(dir, old);
    }
    posix::fsync_dir(dir);
  }
  return final_dir;
}

// ---- CheckpointReader ---------------------------------------------------------------------------

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
  std::vector<std::string> crcs;  // parallel to files_
  try {
    posix::UniqueFd fd = posix::open_file(manifest_path, O_RDONLY);
    struct stat st {};
    if (::fstat(fd.get(), &st) != 0) posix::fail_errno(manifest_path, "stat", errno);
    std::string text(static_cast<size_t>(st.st_size), '\0');
    text.resize(posix::read_up_to(fd.get(), text.data(), text.size(), manifest_path));
    const json manifest = json::parse(text);
    if (manifest.at("format").get<int>() != kManifestFormat)
      throw std::runtime_error(
          fmt::format("format {}, expected {}", manifest.at("format").dump(), kManifestFormat));
    step_ = manifest.at("step").get<int64_t>();
    for (const auto& [name, entry] : manifest.at("files").items()) {
      if (!valid_file_name(name) || name == kManifestName)
        throw std::runtime_error(fmt::format("bad file name \"{}\"", name));
      const std::string crc = entry.at("crc32").get<std::string>();
      if (crc.size() != 8 || crc.find_first_not_of("0123456789abcdef") != std::string::npos)
        throw std::runtime_error(fmt::format("bad crc32 \"{}\" for {}", crc, name));
      files_.emplace_back(name, entry.at("bytes").get<size_t>());
      crcs.push_back(crc);
    }
  } catch (const std::exception& e) {
    SHARDLM_FAIL(ErrorKind::kData, "{}: manifest unreadable ({})", manifest_path, e.what());
  }

  // Size first (cheap, and the clearest message), then a streaming CRC-32 of the contents.
  std::vector<char> buf(verify == Verify::kContents ? kIoChunk : 0);
  for (size_t i = 0; i < files_.size(); ++i) {
    const auto& [name, expected] = files_[i];
    const std::string path = dir_ + "/" + name;
    struct stat st {};
    if (::stat(path.c_str(), &st) != 0) {
      if (errno == ENOENT) SHARDLM_FAIL(ErrorKind::kData, "{}: missing", path);
      posix::fail_errno(path, "stat", errno);
    }
    const auto actual = static_cast<size_t>(st.st_size);
    if (actual < expected)
      SHARDLM_FAIL(ErrorKind::kData, "{}: truncated ({} of {} bytes)", path, actual, expected);
    if (actual > expected)
      SHARDLM_FAIL(ErrorKind::kData, "{}: wrong size ({} bytes, the manifest says {})", path,
                   actual, expected);
    if (verify == Verify::kSizesOnly) continue;
    posix::UniqueFd fd = posix::open_file(path, O_RDONLY);
    uint32_t crc = static_cast<uint32_t>(::crc32(0, Z_NULL, 0));
    size_t total = 0;
    for (;;) {
      const size_t n = posix::read_up_to(fd.get(), buf.data(), buf.size(), path);
      crc = crc32_update(crc, buf.data(), n);
      total += n;
      if (n < buf.size()) break;
    }
    if (total != expected)
      SHARDLM_FAIL(ErrorKind::kData, "{}: truncated ({} of {} bytes)", path, total, expected);
    if (crc_hex(crc) != crcs[i])
      SHARDLM_FAIL(ErrorKind::kData, "{}: checksum mismatch (crc32 {}, the manifest says {})", path,
                   crc_hex(crc), crcs[i]);
  }
}

bool CheckpointReader::has(const std::string& name) const {
  return std::any_of(files_.begin(), files_.end(), [&](const auto& f) { return f.first == name; });
}

size_t CheckpointReader::size(const std::string& name) const {
  for (const auto& [n, bytes] : files_)
    if (n == name) return bytes;
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

// ---- directory queries ----------------------------------------------------------------------

std::string latest_checkpoint(const std::string& checkpoints_dir) {
  const std::string name = read_latest_name(checkpoints_dir);
  return name.empty() ? "" : checkpoints_dir + "/" + name;
}

std::vector<std::string> list_checkpoints(const std::string& checkpoints_dir) {
  std::vector<std::string> out;
  for (const auto& [step, name] : complete_checkpoints(checkpoints_dir))
    out.push_back(checkpoints_dir + "/" + name);
  return out;
}

}  // namespace shardlm
