// A shardlm command run as a child process, its output in a file: the exit code and the child's
// peak resident set (wait4's ru_maxrss, the child's VmHWM), for tests that bound what a command
// holds in memory.
#pragma once

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "test_util.h"

namespace shardlm::test {

struct MeasuredChild {
  int code = -1;
  int64_t peak_rss = 0;  // bytes
};

// `shardlm args...` with stdout and stderr into `out`.
inline MeasuredChild run_measured(const std::vector<std::string>& args,
                                  const std::filesystem::path& out) {
  std::vector<std::string> argv_s{shardlm_binary()};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (std::string& a : argv_s) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {  // the child: exec or leave at once (no destructors of the test's state)
    const int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || ::dup2(fd, 1) < 0 || ::dup2(fd, 2) < 0) ::_exit(126);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  MeasuredChild c;
  int status = 0;
  struct rusage ru {};
  if (pid < 0 || ::wait4(pid, &status, 0, &ru) != pid) return c;
  c.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  c.peak_rss = int64_t(ru.ru_maxrss) * 1024;
  return c;
}

}  // namespace shardlm::test
