// Checkpoint storage, writing side (checkpoint.h): the writer streams files (whole, piece by
// piece, or as ranges of sharded vectors) into a temporary directory with their CRC-32s,
// commits with manifest + fsync + rename + `latest` (in a group of ranks after one collective
// agrees that every rank's files are durable), and rotates old checkpoints; plus the directory
// queries. The reader is checkpoint_reader.cpp. It stores bytes only: what a checkpoint holds
// is the trainer's business.
#include "shardlm/checkpoint/checkpoint.h"

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <system_error>

#include "checkpoint_files.h"
#include "io/posix_file.h"
#include "shardlm/comm/communicator.h"
#include "shardlm/core/check.h"
#include "shardlm/core/fault_injection.h"
#include "shardlm/core/tensor.h"

namespace shardlm {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace checkpoint_files {

bool is_dir(const std::string& path) {
  std::error_code ec;
  return fs::is_directory(path, ec);
}

bool is_file(const std::string& path) {
  std::error_code ec;
  return fs::is_regular_file(path, ec);
}

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

}  // namespace checkpoint_files

namespace {

using namespace checkpoint_files;

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
  posix::rename_path(from, doomed);
  fs::remove_all(doomed, ec);
  if (ec) SHARDLM_FAIL(ErrorKind::kData, "{}: remove failed: {}", doomed, ec.message());
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

// Every rank's text on rank 0 (in rank order; empty elsewhere). Collectives only, a broadcast
// from each rank in turn (the texts are short): a point-to-point transfer would make a
// transport such as NCCL connect rank 0 with every rank in the middle of the run.
std::vector<std::string> gather_text(Communicator& group, const std::string& text) {
  std::vector<int64_t> sizes(size_t(group.size()), 0);
  int64_t mine = int64_t(text.size());
  group.all_gather(Tensor(&mine, DType::kI64, {1}, MemPool::kHost),
                   Tensor(sizes.data(), DType::kI64, {group.size()}, MemPool::kHost));
  std::vector<std::string> out;
  for (int r = 0; r < group.size(); ++r) {
    const int64_t n = sizes[size_t(r)];
    std::vector<int32_t> words(size_t((n + 3) / 4), 0);
    if (group.rank() == r) std::memcpy(words.data(), text.data(), text.size());
    if (!words.empty())
      group.broadcast(Tensor(words.data(), DType::kI32, {int64_t(words.size())}, MemPool::kHost),
                      r);
    if (group.rank() == 0) out.emplace_back(reinterpret_cast<const char*>(words.data()), size_t(n));
  }
  return out;
}

// A manifest range, [begin, count, offset, "crc32"] or (a strided run) [begin, count, offset,
// "crc32", stride, repeat], as its shape.
RunShape run_shape_of(const json& r) {
  RunShape shape{r.at(0).get<int64_t>(), r.at(1).get<int64_t>()};
  if (r.size() == 6)
    shape = {shape.begin, shape.count, r.at(4).get<int64_t>(), r.at(5).get<int64_t>()};
  return shape;
}

}  // namespace

// ---- CheckpointWriter ---------------------------------------------------------------------------

struct CheckpointWriter::Impl {
  struct Range {  // a run of the vector's elements at byte `offset` of the file, its CRC-32
    RunShape shape;
    uint64_t offset = 0;
    uint32_t crc = 0;
  };
  struct FileRecord {
    uint64_t bytes = 0;
    uint32_t crc = 0;
    std::string vector;
    std::vector<Range> ranges;
  };
  std::string checkpoints_dir;
  int64_t step = 0;
  std::string tmp_dir;
  Communicator* group = nullptr;  // the multi-rank form's; null for one writer
  bool lead = true;               // rank 0 of the group (or the one writer)
  std::map<std::string, FileRecord> files;
  std::map<std::string, std::pair<size_t, int64_t>> vectors;  // name -> (elem bytes, elems)
  json layout;
  bool committed = false;
  // The file between begin_file and end_file (open_name empty when none).
  std::string open_name;
  std::string open_path;
  posix::UniqueFd open_fd;
  FileRecord open;

  // Removes stale temporaries, creates tmp_dir.
  void prepare_directory();
  json file_list() const;
  // Rank 0: the group's file lists merged and checked, manifest written, renamed, `latest`.
  std::string publish(const json& files_of_all, int64_t keep_last);
  std::string rename_into_place();
};

void CheckpointWriter::Impl::prepare_directory() {
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
  posix::make_dir(tmp_dir);
}

CheckpointWriter::CheckpointWriter(const std::string& checkpoints_dir, int64_t step)
    : impl_(new Impl) {
  std::unique_ptr<Impl> impl(impl_);
  SHARDLM_CHECK(step >= 0, "checkpoint step must be >= 0, got {}", step);
  impl->checkpoints_dir = checkpoints_dir;
  impl->step = step;
  impl->tmp_dir = checkpoints_dir + "/" + kTmpPrefix + step_dir_name(step);
  impl->prepare_directory();
  impl.release();
}

CheckpointWriter::CheckpointWriter(const std::string& checkpoints_dir, int64_t step,
                                   Communicator& group)
    : impl_(new Impl) {
  std::unique_ptr<Impl> impl(impl_);
  SHARDLM_CHECK(step >= 0, "checkpoint step must be >= 0, got {}", step);
  impl->checkpoints_dir = checkpoints_dir;
  impl->step = step;
  impl->group = &group;
  impl->lead = group.rank() == 0;
  impl->tmp_dir = checkpoints_dir + "/" + kTmpPrefix + step_dir_name(step);
  std::string failure;
  if (impl->lead) {
    try {
      impl->prepare_directory();
    } catch (const Error& e) {
      failure = e.what();
    }
  }
  // Nobody writes before the directory exists; everybody fails when it could not be made.
  failure = broadcast_text(group, failure, 0);
  if (!failure.empty()) {
    impl->committed = true;  // nothing of ours to remove
    SHARDLM_FAIL(ErrorKind::kData, "checkpoint {}: {}", step, failure);
  }
  impl.release();
}

CheckpointWriter::~CheckpointWriter() {
  if (!impl_->committed && impl_->lead) {
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
  impl_->open = Impl::FileRecord{};
  impl_->open.crc = crc32_empty();
}

void CheckpointWriter::append(const void* data, size_t bytes) {
  SHARDLM_CHECK(!impl_->open_name.empty(), "checkpoint append with no file open (call begin_file)");
  SHARDLM_CHECK(impl_->open.vector.empty(),
                "checkpoint file \"{}\" holds ranges of \"{}\": use append_elements",
                impl_->open_name, impl_->open.vector);
  const char* p = static_cast<const char*>(data);
  // Chunk by chunk, so that each chunk is still in cache when it is written.
  for (size_t done = 0; done < bytes;) {
    const size_t n = std::min(kIoChunk, bytes - done);
    impl_->open.crc = crc32_update(impl_->open.crc, p + done, n);
    posix::write_all(impl_->open_fd.get(), p + done, n, impl_->open_path);
    done += n;
  }
  impl_->open.bytes += bytes;
}

void CheckpointWriter::end_file() {
  SHARDLM_CHECK(!impl_->open_name.empty(), "checkpoint end_file with no file open");
  posix::fsync_fd(impl_->open_fd.get(), impl_->open_path);
  impl_->open_fd.close(impl_->open_path);
  impl_->files[impl_->open_name] = std::move(impl_->open);
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

void CheckpointWriter::declare_vector(const std::string& name, size_t elem_bytes, int64_t elems) {
  SHARDLM_CHECK(!name.empty() && elem_bytes > 0 && elems >= 0,
                "checkpoint vector \"{}\": elem_bytes {} and elems {} (need a name, > 0, >= 0)",
                name, elem_bytes, elems);
  SHARDLM_CHECK(impl_->vectors.count(name) == 0, "checkpoint vector \"{}\" declared twice", name);
  impl_->vectors[name] = {elem_bytes, elems};
}

void CheckpointWriter::begin_vector_file(const std::string& name, const std::string& vector) {
  SHARDLM_CHECK(impl_->vectors.count(vector) == 1,
                "checkpoint file \"{}\": vector \"{}\" was not declared (declare_vector)", name,
                vector);
  begin_file(name);
  impl_->open.vector = vector;
}

namespace {

// Extends `run` by elements [begin, begin + count) written right after it in the file when the
// result is still one run: a plain range grows by a contiguous one, or becomes a run of two rows
// by another of its length further on; a run of rows takes the next row at its stride. False
// (run unchanged) otherwise, e.g. a shorter row, a gap that breaks the stride, a range before it.
bool fold_into(RunShape& run, int64_t begin, int64_t count) {
  if (run.repeat == 1 && begin == run.begin + run.count) {
    run.count += count;
    return true;
  }
  if (count != run.count) return false;
  if (run.repeat == 1 && begin - run.begin > count) {
    run.stride = begin - run.begin;
    run.repeat = 2;
    return true;
  }
  if (run.repeat > 1 && begin == run.row_begin(run.repeat)) {
    ++run.repeat;
    return true;
  }
  return false;
}

}  // namespace

void CheckpointWriter::append_elements(int64_t begin, const void* data, int64_t count) {
  SHARDLM_CHECK(!impl_->open_name.empty() && !impl_->open.vector.empty(),
                "checkpoint append_elements with no vector file open (call begin_vector_file)");
  const auto [eb, elems] = impl_->vectors.at(impl_->open.vector);
  SHARDLM_CHECK(begin >= 0 && count >= 0 && begin + count <= elems,
                "checkpoint vector \"{}\": elements [{}, {}) out of [0, {})", impl_->open.vector,
                begin, begin + count, elems);
  if (count == 0) return;
  const size_t bytes = size_t(count) * eb;
  const uint32_t crc = crc32_update(crc32_empty(), data, bytes);
  posix::write_all(impl_->open_fd.get(), data, bytes, impl_->open_path);
  Impl::FileRecord& f = impl_->open;
  if (!f.ranges.empty() && fold_into(f.ranges.back().shape, begin, count)) {
    Impl::Range& last = f.ranges.back();
    last.crc = uint32_t(::crc32_combine(last.crc, crc, z_off_t(bytes)));
  } else {
    f.ranges.push_back({RunShape{begin, count}, f.bytes, crc});
  }
  f.crc = uint32_t(::crc32_combine(f.crc, crc, z_off_t(bytes)));
  f.bytes += bytes;
}

void CheckpointWriter::set_layout(const nlohmann::json& layout) { impl_->layout = layout; }

json CheckpointWriter::Impl::file_list() const {
  json out = json::object();
  for (const auto& [name, f] : files) {
    json entry = {{"bytes", f.bytes}, {"crc32", crc_hex(f.crc)}};
    if (!f.vector.empty()) {
      json ranges = json::array();
      for (const Range& r : f.ranges) {
        json range = {r.shape.begin, r.shape.count, r.offset, crc_hex(r.crc)};
        if (r.shape.repeat > 1) {
          range.push_back(r.shape.stride);
          range.push_back(r.shape.repeat);
        }
        ranges.push_back(std::move(range));
      }
      entry["vector"] = f.vector;
      entry["ranges"] = std::move(ranges);
    }
    out[name] = std::move(entry);
  }
  return out;
}

std::string CheckpointWriter::commit(int64_t keep_last, const std::string& failure) {
  SHARDLM_CHECK(!impl_->committed, "checkpoint {} is already committed", impl_->step);
  SHARDLM_CHECK(keep_last >= 0, "keep_last must be >= 0, got {}", keep_last);
  if (!failure.empty() && !impl_->open_name.empty()) {
    // The save failed inside a file (a write or its fsync): the file is abandoned with the
    // rest of the temporary directory, and the failure is what gets reported.
    impl_->open_fd = posix::UniqueFd();
    impl_->open_name.clear();
    impl_->open_path.clear();
  }
  SHARDLM_CHECK(impl_->open_name.empty(),
                "checkpoint {} committed while file \"{}\" is still open (call end_file first)",
                impl_->step, impl_->open_name);
  if (impl_->group == nullptr) {
    if (!failure.empty()) SHARDLM_FAIL(ErrorKind::kData, "checkpoint {}: {}", impl_->step, failure);
    const std::string dir = impl_->publish(json::array({impl_->file_list()}), keep_last);
    impl_->committed = true;
    return dir;
  }
  // Every rank's files are fsynced (end_file) before it gets here: the one collective below
  // is the agreement that all of them are durable.
  Communicator& group = *impl_->group;
  const json mine = {{"error", failure}, {"files", impl_->file_list()}};
  const std::vector<std::string> texts = gather_text(group, mine.dump());
  std::string outcome;  // rank 0: "ok <final dir>" or "error <message>"
  if (impl_->lead) {
    try {
      json all = json::array();
      for (size_t r = 0; r < texts.size(); ++r) {
        json j = json::parse(texts[r]);
        const std::string err = j.at("error").get<std::string>();
        if (!err.empty()) throw std::runtime_error(fmt::format("rank {}: {}", r, err));
        all.push_back(std::move(j.at("files")));
      }
      outcome = "ok " + impl_->publish(all, keep_last);
    } catch (const std::exception& e) {
      outcome = std::string("error ") + e.what();
    }
  }
  outcome = broadcast_text(group, outcome, 0);
  if (outcome.rfind("ok ", 0) != 0) {
    if (!impl_->lead) impl_->committed = true;  // rank 0 removes the temporary directory
    SHARDLM_FAIL(ErrorKind::kData, "checkpoint {} not written: {}", impl_->step, outcome.substr(6));
  }
  impl_->committed = true;
  return outcome.substr(3);
}

std::string CheckpointWriter::Impl::publish(const json& files_of_all, int64_t keep_last) {
  json merged = json::object();
  std::map<std::string, std::vector<RunShape>> held;
  bool strided = false;  // any run of rows: format 3; else format 2, which older readers take
  for (const json& list : files_of_all)
    for (const auto& [name, entry] : list.items()) {
      if (merged.contains(name))
        SHARDLM_FAIL(ErrorKind::kInternal, "checkpoint file \"{}\" written by two ranks", name);
      if (entry.contains("vector")) {
        const std::string v = entry.at("vector").get<std::string>();
        if (vectors.count(v) == 0)
          SHARDLM_FAIL(ErrorKind::kInternal, "checkpoint file \"{}\": undeclared vector \"{}\"",
                       name, v);
        for (const json& r : entry.at("ranges")) {
          held[v].push_back(run_shape_of(r));
          strided = strided || held[v].back().repeat > 1;
        }
      }
      merged[name] = entry;
    }
  json vector_list = json::object();
  for (const auto& [v, shape] : vectors) {
    const std::string gap = tiling_error(held[v], shape.second);
    if (!gap.empty()) SHARDLM_FAIL(ErrorKind::kInternal, "checkpoint vector \"{}\": {}", v, gap);
    vector_list[v] = {{"elem_bytes", shape.first}, {"elems", shape.second}};
  }
  json manifest = {{"format", strided ? kManifestFormat : kPlainRangesManifestFormat},
                   {"step", step},
                   {"files", merged}};
  if (!vectors.empty()) manifest["vectors"] = vector_list;
  if (!layout.is_null()) manifest["layout"] = layout;
  const std::string text = manifest.dump(1) + "\n";
  const std::string manifest_path = tmp_dir + "/" + kManifestName;
  {
    posix::UniqueFd fd = posix::open_file(manifest_path, O_WRONLY | O_CREAT | O_EXCL);
    posix::write_all(fd.get(), text.data(), text.size(), manifest_path);
    posix::fsync_fd(fd.get(), manifest_path);
    fd.close(manifest_path);
  }
  posix::fsync_dir(tmp_dir);
  const std::string final_dir = rename_into_place();
  committed = true;
  const std::string& dir = checkpoints_dir;
  const std::string name = step_dir_name(step);
  posix::fsync_dir(dir);
  posix::replace_file(dir + "/" + kLatestName, name + "\n");
  if (keep_last > 0) {
    const std::string latest = read_latest_name(dir);
    int64_t kept = 0;
    for (const auto& [st, old] : complete_checkpoints(dir)) {
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

std::string CheckpointWriter::Impl::rename_into_place() {
  const std::string& dir = checkpoints_dir;
  const std::string name = step_dir_name(step);
  const std::string final_dir = dir + "/" + name;
  const int err = posix::try_rename(tmp_dir, final_dir);
  if (err == 0) return final_dir;
  if (err != EEXIST && err != ENOTEMPTY) posix::fail_errno(tmp_dir, "rename into place", err);
  // A checkpoint of this step exists already (a resumed run came past it again): swap the
  // new one in atomically, so that `latest` never names a missing directory.
  int xerr = fault::io_fault(fault::Call::kRename, tmp_dir);
  if (xerr == 0 &&
      ::renameat2(AT_FDCWD, tmp_dir.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) != 0)
    xerr = errno;
  if (xerr != 0) {
    if (xerr != EINVAL && xerr != ENOSYS) posix::fail_errno(tmp_dir, "rename (exchange)", xerr);
    // No exchange on this file system: move the old one aside first (a short window in
    // which `latest` may name a missing directory; list_checkpoints still finds the rest).
    const std::string aside = dir + "/" + kTmpPrefix + "replaced-" + name;
    std::error_code ec;
    fs::remove_all(aside, ec);
    posix::rename_path(final_dir, aside);
    posix::rename_path(tmp_dir, final_dir);
    fs::remove_all(aside, ec);
  }
  std::error_code ec;
  fs::remove_all(tmp_dir, ec);  // now the old checkpoint; a leftover is cleaned later
  return final_dir;
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
