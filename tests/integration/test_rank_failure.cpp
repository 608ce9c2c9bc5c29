// A rank killed mid-training (SIGKILL, so no handler and no abort_world runs) must take the
// whole data-parallel job down: mpiexec exits non-zero within 60 s of the kill, its output names
// the dead rank, and no rank of the run is left behind. Each rank starts through a small shell
// wrapper; on the victim it forks a watcher that waits until training has produced metrics
// (rank 0 writes a line after every step, and every step all-reduces across the ranks), writes
// the time, and kills the rank (the wrapper execs the binary, so the pid is the rank's). The
// same through `shardlm launch`, where the test kills the rank itself.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "test_util.h"

namespace {

namespace fs = std::filesystem;
using shardlm::test::slurp;

const std::string kBinary = SHARDLM_BINARY;
const std::string kMpiexec = shardlm::test::mpiexec();
const std::string kCorpus = std::string(SHARDLM_SOURCE_DIR) + "/tests/data/genesis_1_12.txt";

// $1: the rank to kill, $2: the run directory; the rest is the command to exec.
constexpr const char* kWrapper = R"(#!/bin/sh
victim=$1 run=$2
shift 2
if [ "$OMPI_COMM_WORLD_RANK" = "$victim" ]; then
  (
    n=0
    while [ ! -s "$run/metrics.jsonl" ]; do
      n=$((n + 1))
      [ $n -gt 1200 ] && exit 0  # 60 s without a step: leave the run alone, the test fails
      sleep 0.05
    done
    date +%s%N > "$run/killed_at"
    kill -9 $$
  ) > /dev/null 2>&1 < /dev/null &
fi
exec "$@"
)";

long long now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Pids of processes whose command line contains `needle`, this process excluded.
std::vector<pid_t> processes_matching(const std::string& needle) {
  std::vector<pid_t> pids;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc", ec)) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = std::stoi(name);
    if (pid == getpid()) continue;
    std::string cmdline = slurp(e.path() / "cmdline");
    for (char& c : cmdline)
      if (c == '\0') c = ' ';
    if (cmdline.find(needle) != std::string::npos) pids.push_back(pid);
  }
  return pids;
}

struct Outcome {
  int status = 0;
  double elapsed_s = 0;        // the whole mpiexec, launch included
  double kill_to_exit_s = -1;  // < 0: the victim was never killed
  std::string output;
};

// Trains a 2-layer tiny model on `ranks` ranks for far more steps than the test waits for and
// kills rank `victim` once rank 0 has logged a step. The job is bounded by `timeout`, so a
// hang fails the test instead of stalling it.
Outcome run_and_kill(int ranks, int victim) {
  const std::string name = "np" + std::to_string(ranks) + "_kill" + std::to_string(victim);
  // The pid makes the directory unique, so that leftover processes can be found by it.
  const fs::path dir =
      shardlm::test::scratch_root() / ("shardlm_rankfail_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const fs::path run = dir / "run";
  const fs::path wrapper = dir / "kill_rank.sh";
  std::ofstream(wrapper) << kWrapper;

  const std::string args =
      " train --config " + std::string(SHARDLM_SOURCE_DIR) + "/configs/demo.json" +
      " --set data.train=" + kCorpus +
      " --set data.seq_len=64 --set model.n_layers=2 --set train.max_steps=100000" +
      " --set train.micro_batch=2 --set train.eval_every=0 --set sample.count=0" +
      " --set checkpoint.every_steps=0 --set log.every_steps=1 --set log.dir=" + run.string();
  // As in test_data_parallel: one thread per rank, root allowed, oversubscribed, yielding.
  const std::string env =
      "OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 ";
  const std::string mpiexec = kMpiexec + " -n " + std::to_string(ranks) +
                              " --oversubscribe --mca mpi_yield_when_idle 1 --bind-to none ";
  const std::string rank_cmd = "sh " + wrapper.string() + " " + std::to_string(victim) + " " +
                               run.string() + " " + kBinary + args;
  const std::string cmd = env + "timeout -s KILL 120 " + mpiexec + rank_cmd + " > " +
                          (dir / "out.txt").string() + " 2>&1";
  Outcome o;
  const long long started_ns = now_ns();
  o.status = std::system(cmd.c_str());
  const long long exited_ns = now_ns();
  o.elapsed_s = (exited_ns - started_ns) * 1e-9;
  o.output = slurp(dir / "out.txt");
  const std::string killed_at = slurp(run / "killed_at");
  if (!killed_at.empty()) o.kill_to_exit_s = (exited_ns - std::stoll(killed_at)) * 1e-9;

  // Every process of the run is gone once mpiexec has returned (a moment for the kernel to
  // reap the last of them); whatever is left is reported, then killed.
  std::vector<pid_t> left;
  for (int i = 0; i < 50; ++i) {
    left = processes_matching(dir.string());
    if (left.empty()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  std::string left_pids;
  for (pid_t pid : left) left_pids += ' ' + std::to_string(pid);
  EXPECT_TRUE(left.empty()) << "processes of the run outlived mpiexec:" << left_pids << "\n"
                            << o.output;
  for (pid_t pid : left) kill(pid, SIGKILL);
  if (!::testing::Test::HasFailure()) fs::remove_all(dir);
  return o;
}

void expect_job_fails_naming(const Outcome& o, int victim) {
  // mpiexec exits 137 (128 + SIGKILL) itself here, so the timeout is told apart by the time.
  ASSERT_TRUE(WIFEXITED(o.status)) << o.output;
  EXPECT_NE(WEXITSTATUS(o.status), 0) << "the job exited 0 although a rank died:\n" << o.output;
  EXPECT_LT(o.elapsed_s, 110) << "the job hung until timeout killed it:\n" << o.output;
  ASSERT_GE(o.kill_to_exit_s, 0) << "the victim was never killed (no step logged?):\n" << o.output;
  EXPECT_LT(o.kill_to_exit_s, 60) << o.output;
  // Open MPI: "mpiexec noticed that process rank 1 with PID ... exited on signal 9 (Killed)."
  const std::regex names_rank("process rank " + std::to_string(victim) + " .*signal 9");
  EXPECT_TRUE(std::regex_search(o.output, names_rank))
      << "the output does not name rank " << victim << ":\n"
      << o.output;
  std::cout << "[          ] exit status " << WEXITSTATUS(o.status) << ", " << o.kill_to_exit_s
            << " s after the kill (" << o.elapsed_s << " s in all)\n";
}

// The rank of `ranks_of` whose environment says RANK=<rank>, or -1.
pid_t rank_pid(const std::vector<pid_t>& ranks_of, int rank) {
  for (pid_t pid : ranks_of) {
    std::string env = slurp(fs::path("/proc") / std::to_string(pid) / "environ");
    for (char& c : env)
      if (c == '\0') c = '\n';
    if (("\n" + env).find("\nRANK=" + std::to_string(rank) + "\n") != std::string::npos) return pid;
  }
  return -1;
}

// The same through `shardlm launch` (the TCP world, no MPI): the test itself kills the rank
// once rank 0 has logged a step; the launcher must exit non-zero naming it, the survivors having
// failed on the lost connection, and leave no process behind.
TEST(RankFailure, SigkilledRankEndsAShardlmLaunchRun) {
  const fs::path dir =
      shardlm::test::scratch_root() / ("shardlm_rankfail_launch_" + std::to_string(getpid()));
  fs::remove_all(dir);
  const fs::path run = dir / "run";
  fs::create_directories(dir);
  const std::string cmd =
      "OMP_NUM_THREADS=1 timeout -s KILL 120 " + kBinary + " launch --nproc 3 -- train --config " +
      std::string(SHARDLM_SOURCE_DIR) + "/configs/demo.json --set data.train=" + kCorpus +
      " --set data.seq_len=64 --set model.n_layers=2 --set train.max_steps=100000" +
      " --set train.micro_batch=2 --set train.eval_every=0 --set sample.count=0" +
      " --set checkpoint.every_steps=0 --set log.every_steps=1 --set log.dir=" + run.string() +
      " > " + (dir / "out.txt").string() + " 2>&1";
  int status = -1;
  std::thread job([&] { status = std::system(cmd.c_str()); });
  pid_t victim = -1;
  for (int i = 0; i < 1200 && victim < 0; ++i) {  // 60 s for a step
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (fs::exists(run / "metrics.jsonl") && fs::file_size(run / "metrics.jsonl") > 0)
      victim = rank_pid(processes_matching(" train --config"), 1);
  }
  const long long killed_ns = now_ns();
  if (victim > 0) kill(victim, SIGKILL);
  job.join();
  const double kill_to_exit_s = (now_ns() - killed_ns) * 1e-9;
  const std::string output = slurp(dir / "out.txt");
  ASSERT_GT(victim, 0) << "no step logged, or rank 1 not found:\n" << output;
  ASSERT_TRUE(WIFEXITED(status)) << output;
  EXPECT_EQ(WEXITSTATUS(status), 128 + SIGKILL) << output;
  EXPECT_LT(kill_to_exit_s, 60) << output;
  EXPECT_NE(output.find("shardlm launch: rank 1 exited with code 137"), std::string::npos)
      << output;
  // The survivors failed on their own, naming the lost rank, rather than by the launcher's hand.
  EXPECT_TRUE(std::regex_search(output, std::regex("world rank 1 c[a-z]+ "))) << output;
  EXPECT_TRUE(processes_matching(run.string()).empty()) << output;
}

TEST(RankFailure, SigkilledRankOneEndsATwoRankRun) {
  expect_job_fails_naming(run_and_kill(2, 1), 1);
}

TEST(RankFailure, SigkilledRankZeroEndsATwoRankRun) {
  expect_job_fails_naming(run_and_kill(2, 0), 0);
}

TEST(RankFailure, SigkilledMiddleRankEndsAThreeRankRun) {
  expect_job_fails_naming(run_and_kill(3, 2), 2);
}

}  // namespace
