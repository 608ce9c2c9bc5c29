// POSIX file helpers for durable writes (checkpoints, reports): an owning file descriptor,
// write/read loops that survive partial transfers and EINTR, fsync of files and directories,
// and replace-a-file-atomically. Internal to src/io (token shards, safetensors, GGUF) and the
// layers above (checkpoints, exports, reports); failures throw Error(kData) naming the operation,
// the path and the system's reason. Nothing here knows what the bytes mean. Every write-side call
// (open for writing, write, fsync, directory fsync, rename, mkdir) passes the fault-injection
// seam (shardlm/core/fault_injection.h), so every writer above can be tested failing at each.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace shardlm::posix {

// Owns one file descriptor; closes it (ignoring errors) unless close() was called.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd();
  UniqueFd(UniqueFd&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  UniqueFd& operator=(UniqueFd&& o) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  // Closes and reports a failure (a deferred write error can surface here).
  void close(const std::string& path);

 private:
  int fd_ = -1;
};

// open(2) with O_CLOEXEC; throws naming `path` on failure.
UniqueFd open_file(const std::string& path, int flags, int mode = 0644);

// Writes all `bytes`, looping over partial writes and EINTR.
void write_all(int fd, const void* data, size_t bytes, const std::string& path);
// Same at byte `offset` (pwrite: the file position is neither used nor moved).
void pwrite_all(int fd, const void* data, size_t bytes, uint64_t offset, const std::string& path);
// Reads up to `bytes`, stopping early only at end of file; returns the count read.
size_t read_up_to(int fd, void* data, size_t bytes, const std::string& path);
// Same from byte `offset` (pread: the file position is neither used nor moved).
size_t pread_up_to(int fd, void* data, size_t bytes, uint64_t offset, const std::string& path);

void fsync_fd(int fd, const std::string& path);
// fsyncs a directory so that entries created, renamed or removed in it are durable.
void fsync_dir(const std::string& dir);

// rename(2) of `from` to `to`: 0, or the errno it failed with (for callers that handle some).
int try_rename(const std::string& from, const std::string& to);
// The same, throwing naming both on any failure.
void rename_path(const std::string& from, const std::string& to);
// mkdir(2) with mode 0755; throws naming `path` (an existing directory too).
void make_dir(const std::string& path);

// Writes `content` to path + ".tmp", fsyncs it, renames it over `path` and fsyncs the
// directory: a reader sees the old file or the new one, never a part.
void replace_file(const std::string& path, const std::string& content);

// Copies the file `from` to `to` through replace_file (whole, in memory: small files).
void copy_small_file(const std::string& from, const std::string& to);

// "<path>: <what> failed: <strerror(err)>" as Error(kData).
[[noreturn]] void fail_errno(const std::string& path, const char* what, int err);

}  // namespace shardlm::posix
