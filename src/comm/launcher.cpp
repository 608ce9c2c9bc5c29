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

// A rank's whole process group: what it started goes with it.
void signal_all(const std::vector<pid_t>& ranks, int sig) {
  for (pid_t pid : ranks)
    if (pid > 0 && ::kill(-pid, sig) != 0) ::kill(pid, sig);
}

struct Exit {
  int rank;
  int code;
  bool signalled;
};

// The ranks that have exited since the last call (their pids set to -1). Each rank is waited
// for by its pid: the calling process (a test, say) may have children of its own to reap.
std::vector<Exit> reap(std::vector<pid_t>& ranks) {
  std::vector<Exit> exits;
  for (size_t r = 0; r < ranks.size(); ++r) {
    int status = 0;
    if (ranks[r] <= 0 || ::waitpid(ranks[r], &status, WNOHANG) != ranks[r]) continue;
    ranks[r] = -1;
    exits.push_back({int(r), exit_code_of(status), bool(WIFSIGNALED(status))});
  }
  return exits;
}

// Waits for every rank, forwarding signals; returns the first failure's exit code (0: none).
// Of failures seen together, a rank killed by a signal is taken as the first: the others most
// likely failed because they lost it.
int wait_for_ranks(std::vector<pid_t>& ranks, double grace_s) {
  int alive = int(ranks.size()), first_failure = 0;
  auto kill_at = net::Clock::time_point::max();
  while (alive > 0) {
    if (const int sig = g_forward) {  // passed on; ranks still alive after the grace are killed
      g_forward = 0;
      signal_all(ranks, sig);
      if (kill_at == net::Clock::time_point::max()) kill_at = net::deadline_after(grace_s);
    }
    if (net::Clock::now() >= kill_at) {
      signal_all(ranks, SIGKILL);
      kill_at = net::Clock::time_point::max();
    }
    std::vector<Exit> exits = reap(ranks);
    alive -= int(exits.size());
    std::stable_partition(exits.begin(), exits.end(), [](const Exit& e) { return e.signalled; });
    for (const Exit& e : exits) {
      if (e.code == 0 || first_failure != 0) continue;
      first_failure = e.code;
      std::fprintf(stderr, "shardlm launch: rank %d exited with code %d; stopping the others\n",
                   e.rank, e.code);
      signal_all(ranks, SIGTERM);
      kill_at = net::deadline_after(grace_s);
    }
    if (exits.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return first_failure;
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
  // SIGINT and SIGTERM are passed on to the ranks while they run, the caller's handlers restored
  // however this returns.
  struct ForwardSignals {
    struct sigaction old_int {
    }, old_term{};
    ForwardSignals() {
      struct sigaction act {};
      act.sa_handler = remember_signal;
      sigemptyset(&act.sa_mask);
      ::sigaction(SIGINT, &act, &old_int);
      ::sigaction(SIGTERM, &act, &old_term);
    }
    ~ForwardSignals() {
      ::sigaction(SIGINT, &old_int, nullptr);
      ::sigaction(SIGTERM, &old_term, nullptr);
    }
  } forward_signals;
  std::fflush(nullptr);

  std::vector<pid_t> ranks(size_t(launch.nproc), -1);
  for (int r = 0; r < launch.nproc; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) {  // the ranks already started would wait for the others until their timeout
      const int error = errno;
      signal_all(ranks, SIGKILL);
      for (pid_t started : ranks)
        if (started > 0) ::waitpid(started, nullptr, 0);
      SHARDLM_FAIL(ErrorKind::kInternal, "shardlm launch: fork of rank {} failed: {}", r,
                   std::strerror(error));
    }
    if (pid == 0) exec_rank(launch, r, port);
    ::setpgid(pid, pid);  // as the child does: whichever runs first
    ranks[size_t(r)] = pid;
  }
  return wait_for_ranks(ranks, launch.grace_s);
}

}  // namespace shardlm
