// POSIX file helpers behind checkpoints and reports: EINTR-safe read/write loops, fsync of
// files and directories, and atomic replacement of a small file (see posix_file.h).
#include "posix_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <system_error>

#include "shardlm/core/check.h"

namespace shardlm::posix {

void fail_errno(const std::string& path, const char* what, int err) {
  SHARDLM_FAIL(ErrorKind::kData, "{}: {} failed: {}", path, what,
               std::error_code(err, std::generic_category()).message());
}

UniqueFd::~UniqueFd() {
  if (fd_ >= 0) ::close(fd_);
}

UniqueFd& UniqueFd::operator=(UniqueFd&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

void UniqueFd::close(const std::string& path) {
  const int fd = fd_;
  fd_ = -1;
  // Linux releases the descriptor even when close fails (EINTR included): never retry.
  if (fd >= 0 && ::close(fd) != 0 && errno != EINTR) fail_errno(path, "close", errno);
}

UniqueFd open_file(const std::string& path, int flags, int mode) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) fail_errno(path, "open", errno);
  return UniqueFd(fd);
}

void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    // Linux transfers at most ~2 GiB per call; ask for less so every call can complete.
    const size_t chunk = bytes < (size_t{1} << 30) ? bytes : (size_t{1} << 30);
    const ssize_t n = ::write(fd, p, chunk);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail_errno(path, "write", errno);
    }
    if (n == 0) fail_errno(path, "write", EIO);
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

namespace {

// Calls read_some(dst, n, done) (read(2) or pread(2) of at most n bytes, `done` already read)
// until `bytes` are read or it reports end of file; returns the count read.
template <typename ReadSome>
size_t read_loop(void* data, size_t bytes, const std::string& path, ReadSome read_some) {
  char* p = static_cast<char*>(data);
  size_t done = 0;
  while (done < bytes) {
    const size_t chunk = bytes - done < (size_t{1} << 30) ? bytes - done : (size_t{1} << 30);
    const ssize_t n = read_some(p + done, chunk, done);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail_errno(path, "read", errno);
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  return done;
}

}  // namespace

size_t read_up_to(int fd, void* data, size_t bytes, const std::string& path) {
  return read_loop(data, bytes, path,
                   [fd](char* dst, size_t n, size_t) { return ::read(fd, dst, n); });
}

size_t pread_up_to(int fd, void* data, size_t bytes, uint64_t offset, const std::string& path) {
  return read_loop(data, bytes, path, [fd, offset](char* dst, size_t n, size_t done) {
    return ::pread(fd, dst, n, static_cast<off_t>(offset + done));
  });
}

void fsync_fd(int fd, const std::string& path) {
  while (::fsync(fd) != 0) {
    if (errno != EINTR) fail_errno(path, "fsync", errno);
  }
}

void fsync_dir(const std::string& dir) {
  UniqueFd fd = open_file(dir, O_RDONLY | O_DIRECTORY);
  fsync_fd(fd.get(), dir);
  fd.close(dir);
}

void replace_file(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp";
  {
    UniqueFd fd = open_file(tmp, O_WRONLY | O_CREAT | O_TRUNC);
    write_all(fd.get(), content.data(), content.size(), tmp);
    fsync_fd(fd.get(), tmp);
    fd.close(tmp);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    fail_errno(path, "rename", err);
  }
  std::string parent = std::filesystem::path(path).parent_path().string();
  fsync_dir(parent.empty() ? "." : parent);
}

}  // namespace shardlm::posix
