// launch_local: fork, the torchrun-style variables, exec; then a polling wait that forwards
// signals and, after the first failure, ends the remaining ranks.
#include "shardlm/comm/launcher.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "comm/socket_io.h"
#include "shardlm/core/check.h"

namespace shardlm {

namespace {

volatile std::sig_atomic_t g_forward = 0;  // a signal to pass on to the ranks; 0: none

extern "C" void remember_signal(int sig) { g_forward = sig; }

int free_port() {
  net::Fd probe = net::listen_any(0, 1);
  SHARDLM_CHECK(probe.fd >= 0, "shardlm launch: cannot find a free port: {}", std::strerror(errno));
  return net::bound_port(probe.fd);
}

[[noreturn]] void exec_rank(const LocalLaunch& launch, int rank, int port) {
  ::setpgid(0, 0);
  const std::string world = std::to_string(launch.nproc), r = std::to_string(rank);
  ::setenv("RANK", r.c_str(), 1);
  ::setenv("LOCAL_RANK", r.c_str(), 1);
  ::setenv("WORLD_SIZE", world.c_str(), 1);
  ::setenv("LOCAL_WORLD_SIZE", world.c_str(), 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
  std::vector<char*> argv;
  for (const std::string& a : launch.command) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execvp(argv[0], argv.data());
  std::fprintf(stderr, "shardlm launch: rank %d: cannot run %s: %s\n", rank, argv[0],
               std::strerror(errno));
  std::_Exit(127);
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

int launch_local(const LocalLaunch& launch) {
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, launch.nproc >= 1,
                     "shardlm launch: --nproc {} must be at least 1", launch.nproc);
  SHARDLM_CHECK_KIND(ErrorKind::kConfig, !launch.command.empty(),
                     "shardlm launch: no command after --");
  if (std::getenv("OMP_NUM_THREADS") == nullptr) {
    const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
    ::setenv("OMP_NUM_THREADS",
             std::to_string(std::max(1u, cores / unsigned(launch.nproc))).c_str(), 1);
  }
  const int port = free_port();
  struct sigaction act {
  }, old_int{}, old_term{};
  act.sa_handler = remember_signal;
  sigemptyset(&act.sa_mask);
  ::sigaction(SIGINT, &act, &old_int);
  ::sigaction(SIGTERM, &act, &old_term);
  std::fflush(nullptr);

  std::vector<pid_t> ranks(size_t(launch.nproc), -1);
  for (int r = 0; r < launch.nproc; ++r) {
    const pid_t pid = ::fork();
    SHARDLM_CHECK(pid >= 0, "shardlm launch: fork failed: {}", std::strerror(errno));
    if (pid == 0) exec_rank(launch, r, port);
    ::setpgid(pid, pid);  // as the child does: whichever runs first
    ranks[size_t(r)] = pid;
  }
  // A rank's whole process group: what it started goes with it.
  auto signal_all = [&ranks](int sig) {
    for (pid_t pid : ranks)
      if (pid > 0 && ::kill(-pid, sig) != 0) ::kill(pid, sig);
  };

  int alive = launch.nproc, first_failure = 0;
  auto kill_at = net::Clock::time_point::max();
  while (alive > 0) {
    if (const int sig = g_forward) {
      g_forward = 0;
      signal_all(sig);
    }
    if (net::Clock::now() >= kill_at) {
      signal_all(SIGKILL);
      kill_at = net::Clock::time_point::max();
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid <= 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
      continue;
    }
    const auto it = std::find(ranks.begin(), ranks.end(), pid);
    if (it == ranks.end()) continue;
    *it = -1;
    --alive;
    const int code = exit_code_of(status);
    if (code != 0 && first_failure == 0) {
      first_failure = code;
      std::fprintf(stderr, "shardlm launch: rank %d exited with code %d; stopping the others\n",
                   int(it - ranks.begin()), code);
      signal_all(SIGTERM);
      kill_at = net::deadline_after(launch.grace_s);
    }
  }
  ::sigaction(SIGINT, &old_int, nullptr);
  ::sigaction(SIGTERM, &old_term, nullptr);
  return first_failure;
}

}  // namespace shardlm
