// Durable-write helpers of src/io (file_util.h).
#include "file_util.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>

#include "shardlm/core/check.h"

namespace shardlm::io_detail {

void fsync_directory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    SHARDLM_FAIL(ErrorKind::kData, "{}: cannot open the directory to fsync it: {}", dir,
                 std::system_category().message(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0)
    SHARDLM_FAIL(ErrorKind::kData, "{}: cannot fsync the directory: {}", dir,
                 std::system_category().message(err));
}

}  // namespace shardlm::io_detail
