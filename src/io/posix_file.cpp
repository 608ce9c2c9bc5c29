// POSIX file helpers behind checkpoints and reports: EINTR-safe read/write loops, fsync of
// files and directories, and atomic replacement of a small file (see posix_file.h).
#include "posix_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <system_error>

#include "shardlm/core/check.h"
#include "shardlm/core/fault_injection.h"

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
  if ((flags & (O_WRONLY | O_RDWR | O_CREAT)) != 0)
    if (const int err = fault::io_fault(fault::Call::kOpen, path)) fail_errno(path, "open", err);
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) fail_errno(path, "open", errno);
  return UniqueFd(fd);
}

namespace {

// Calls write_some(src, n, done) (write(2) or pwrite(2) of at most n bytes, `done` already
// written) until all `bytes` are written. An injected fault fails one call, after writing part
// of the chunk when it asks for a short write (what a filling disk does).
template <typename WriteSome>
void write_loop(const void* data, size_t bytes, const std::string& path, WriteSome write_some) {
  const char* p = static_cast<const char*>(data);
  size_t done = 0;
  while (done < bytes) {
    // Linux transfers at most ~2 GiB per call; ask for less so every call can complete.
    const size_t chunk = bytes - done < (size_t{1} << 30) ? bytes - done : (size_t{1} << 30);
    bool short_write = false;
    if (const int err = fault::io_fault(fault::Call::kWrite, path, &short_write)) {
      if (short_write && chunk > 1) (void)write_some(p + done, chunk / 2, done);
      fail_errno(path, "write", err);
    }
    const ssize_t n = write_some(p + done, chunk, done);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail_errno(path, "write", errno);
    }
    if (n == 0) fail_errno(path, "write", EIO);
    done += static_cast<size_t>(n);
  }
}

}  // namespace

void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  write_loop(data, bytes, path,
             [fd](const char* src, size_t n, size_t) { return ::write(fd, src, n); });
}

void pwrite_all(int fd, const void* data, size_t bytes, uint64_t offset, const std::string& path) {
  write_loop(data, bytes, path, [fd, offset](const char* src, size_t n, size_t done) {
    return ::pwrite(fd, src, n, static_cast<off_t>(offset + done));
  });
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

namespace {

void fsync_as(int fd, const std::string& path, fault::Call call, const char* what) {
  if (const int err = fault::io_fault(call, path)) fail_errno(path, what, err);
  while (::fsync(fd) != 0) {
    if (errno != EINTR) fail_errno(path, what, errno);
  }
}

}  // namespace

void fsync_fd(int fd, const std::string& path) { fsync_as(fd, path, fault::Call::kFsync, "fsync"); }

void fsync_dir(const std::string& dir) {
  UniqueFd fd = open_file(dir, O_RDONLY | O_DIRECTORY);
  fsync_as(fd.get(), dir, fault::Call::kDirFsync, "directory fsync");
  fd.close(dir);
}

int try_rename(const std::string& from, const std::string& to) {
  if (const int err = fault::io_fault(fault::Call::kRename, from)) return err;
  return ::rename(from.c_str(), to.c_str()) == 0 ? 0 : errno;
}

void rename_path(const std::string& from, const std::string& to) {
  if (const int err = try_rename(from, to))
    SHARDLM_FAIL(ErrorKind::kData, "{}: rename to {} failed: {}", from, to,
                 std::error_code(err, std::generic_category()).message());
}

void make_dir(const std::string& path) {
  int err = fault::io_fault(fault::Call::kMkdir, path);
  if (err == 0 && ::mkdir(path.c_str(), 0755) != 0) err = errno;
  if (err != 0) fail_errno(path, "mkdir", err);
}

void replace_file(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp";
  try {
    UniqueFd fd = open_file(tmp, O_WRONLY | O_CREAT | O_TRUNC);
    write_all(fd.get(), content.data(), content.size(), tmp);
    fsync_fd(fd.get(), tmp);
    fd.close(tmp);
    rename_path(tmp, path);
  } catch (const Error&) {
    ::unlink(tmp.c_str());  // the old file, if any, is untouched
    throw;
  }
  std::string parent = std::filesystem::path(path).parent_path().string();
  fsync_dir(parent.empty() ? "." : parent);
}

void copy_small_file(const std::string& from, const std::string& to) {
  UniqueFd fd = open_file(from, O_RDONLY);
  std::string content;
  char buf[1 << 16];
  for (size_t n; (n = read_up_to(fd.get(), buf, sizeof(buf), from)) > 0;) content.append(buf, n);
  fd.close(from);
  replace_file(to, content);
}

}  // namespace shardlm::posix
