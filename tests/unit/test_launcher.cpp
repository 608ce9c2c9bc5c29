// launch_local (what `shardlm launch` runs) with small shell commands as ranks: every rank gets
// the torchrun-style variables, the first failure's exit code is the launch's and ends the
// ranks still running, and a SIGTERM to the launcher reaches every rank.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <string>
#include <thread>

#include "shardlm/comm/launcher.h"
#include "shardlm/core/check.h"

namespace shardlm {
namespace {

using Clock = std::chrono::steady_clock;

LocalLaunch shell(int nproc, const std::string& script) {
  LocalLaunch launch;
  launch.nproc = nproc;
  launch.command = {"sh", "-c", script};
  launch.grace_s = 5;
  return launch;
}

TEST(Launcher, EveryRankGetsTheTorchrunVariables) {
  const std::string check =
      "[ \"$WORLD_SIZE\" = 3 ] && [ \"$LOCAL_WORLD_SIZE\" = 3 ] && [ \"$LOCAL_RANK\" = \"$RANK\" ] "
      "&& [ \"$RANK\" -ge 0 ] && [ \"$RANK\" -lt 3 ] && [ \"$MASTER_ADDR\" = 127.0.0.1 ] "
      "&& [ \"$MASTER_PORT\" -gt 0 ] && [ -n \"$OMP_NUM_THREADS\" ] || exit 9";
  EXPECT_EQ(launch_local(shell(3, check)), 0);
}

TEST(Launcher, TheFirstFailureEndsTheOthersAndIsTheExitCode) {
  const auto start = Clock::now();
  // Rank 2 fails at once; the others would sleep for a minute.
  EXPECT_EQ(launch_local(shell(3, "[ \"$RANK\" = 2 ] && exit 5; sleep 60")), 5);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 20.0);
}

TEST(Launcher, ARankKilledByASignalReportsItAs128PlusTheSignal) {
  EXPECT_EQ(launch_local(shell(2, "[ \"$RANK\" = 1 ] && kill -KILL $$; sleep 60")), 128 + 9);
}

// The launcher in a child process of its own; SIGTERM to it reaches the ranks, which exit 7.
TEST(Launcher, SigtermIsForwardedToEveryRank) {
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0)
    ::_exit(launch_local(shell(2, "sleep 60 & trap 'kill $!; exit 7' TERM; wait; exit 3")));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the ranks are up
  ::kill(pid, SIGTERM);
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 7);
}

TEST(Launcher, BadArgumentsAreConfigErrors) {
  LocalLaunch none;
  none.nproc = 0;
  none.command = {"true"};
  try {
    launch_local(none);
    ADD_FAILURE() << "nproc 0 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig);
    EXPECT_NE(std::string(e.what()).find("--nproc 0"), std::string::npos) << e.what();
  }
  none.nproc = 1;
  none.command.clear();
  EXPECT_THROW(launch_local(none), Error);
}

}  // namespace
}  // namespace shardlm
