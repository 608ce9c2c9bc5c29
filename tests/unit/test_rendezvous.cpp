// The torchrun-style launch variables and the TCP rendezvous, with real processes: each rank is a
// fork()ed child that runs tcp_broadcast_bytes (or tcp_gather_bytes) on a free local port and
// reports through its exit code and a pipe. The reference is rank 0's payload, which every rank
// must return unchanged; failures must name the variable, the port or the ranks that never arrived.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <iostream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "shardlm/comm/rendezvous.h"
#include "shardlm/config/config.h"
#include "shardlm/core/check.h"
#include "shardlm/train/trainer.h"

namespace shardlm {
namespace {

// A port nobody listens on right now (the kernel's choice for port 0).
int free_port() {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  socklen_t len = sizeof(a);
  ::getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(s);
  return ntohs(a.sin_port);
}

std::vector<std::byte> payload(size_t n) {
  std::vector<std::byte> p(n);
  for (size_t i = 0; i < n; ++i) p[i] = std::byte((i * 37 + 11) & 0xff);
  return p;
}

struct Outcome {
  int exit_code = -1;   // 0: got the payload; 1: wrong bytes; 2: Error (message)
  std::string message;  // the Error's text
};

// Forks one process per rank in `start` (in that order, `gap` apart), each running the
// rendezvous of a world of `world` ranks; returns each rank's outcome.
// With `gather`, every rank passes payload(16 + rank) to tcp_gather_bytes and must get every
// rank's, each with an address.
std::map<int, Outcome> run_ranks(int world, const std::vector<int>& start, double timeout_s,
                                 std::chrono::milliseconds gap = std::chrono::milliseconds(0),
                                 bool gather = false) {
  const int port = free_port();
  const std::vector<std::byte> want = payload(128);
  std::map<int, std::pair<pid_t, int>> children;  // rank -> (pid, read end)
  for (const int r : start) {
    int fds[2];
    EXPECT_EQ(::pipe(fds), 0);
    const pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      int code = 0;
      std::string msg;
      try {
        const LaunchEnv env{r, world, r, "127.0.0.1", port};
        if (gather) {
          const auto table = tcp_gather_bytes(env, payload(size_t(16 + r)), timeout_s);
          code = int(table.size()) == world ? 0 : 1;
          for (int q = 0; q < world && code == 0; ++q)
            if (table[size_t(q)].bytes != payload(size_t(16 + q)) ||
                table[size_t(q)].address.empty())
              code = 1;
        } else {
          const auto got =
              tcp_broadcast_bytes(env, r == 0 ? want : std::vector<std::byte>{}, timeout_s);
          code = got == want ? 0 : 1;
        }
      } catch (const Error& e) {
        code = 2;
        msg = e.what();
      }
      if (!msg.empty()) (void)!::write(fds[1], msg.data(), msg.size());
      ::_exit(code);
    }
    ::close(fds[1]);
    children[r] = {pid, fds[0]};
    std::this_thread::sleep_for(gap);
  }
  std::map<int, Outcome> out;
  for (auto& [r, child] : children) {
    int status = 0;
    ::waitpid(child.first, &status, 0);
    Outcome& o = out[r];
    o.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    char buf[4096];
    ssize_t n = 0;
    while ((n = ::read(child.second, buf, sizeof(buf))) > 0) o.message.append(buf, size_t(n));
    ::close(child.second);
  }
  return out;
}

TEST(Rendezvous, ThreeRanksReceiveRankZerosBytes) {
  const auto out = run_ranks(3, {0, 1, 2}, 30.0);
  for (const auto& [r, o] : out) EXPECT_EQ(o.exit_code, 0) << "rank " << r << ": " << o.message;
}

TEST(Rendezvous, RanksStartedBeforeRankZeroRetryUntilItListens) {
  const auto out = run_ranks(3, {2, 1, 0}, 30.0, std::chrono::milliseconds(300));
  for (const auto& [r, o] : out) EXPECT_EQ(o.exit_code, 0) << "rank " << r << ": " << o.message;
}

// The TCP communicator's address exchange: every rank's own bytes reach every rank.
TEST(Rendezvous, GatherHandsEveryRankEveryRanksBytes) {
  const auto out = run_ranks(4, {3, 0, 2, 1}, 30.0, std::chrono::milliseconds(50), true);
  for (const auto& [r, o] : out) EXPECT_EQ(o.exit_code, 0) << "rank " << r << ": " << o.message;
}

TEST(Rendezvous, ARankThatNeverArrivesIsNamedByRankZero) {
  const auto out = run_ranks(3, {0, 1}, 1.0);
  EXPECT_EQ(out.at(0).exit_code, 2);
  EXPECT_NE(out.at(0).message.find("rank 2 never connected"), std::string::npos)
      << out.at(0).message;
  // Rank 1 connected, then lost rank 0 without a reply: it fails too, saying so.
  EXPECT_EQ(out.at(1).exit_code, 2);
  EXPECT_NE(out.at(1).message.find("rank 1 connected to rank 0"), std::string::npos)
      << out.at(1).message;
}

TEST(Rendezvous, WithoutRankZeroAPeerTimesOutNamingTheAddress) {
  const auto out = run_ranks(2, {1}, 0.5);
  EXPECT_EQ(out.at(1).exit_code, 2);
  EXPECT_NE(out.at(1).message.find("rank 1 could not reach rank 0 at MASTER_ADDR:MASTER_PORT"),
            std::string::npos)
      << out.at(1).message;
}

TEST(Rendezvous, APortInUseIsAConfigErrorNamingIt) {
  const int busy = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  ASSERT_EQ(::bind(busy, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  ASSERT_EQ(::listen(busy, 1), 0);
  socklen_t len = sizeof(a);
  ::getsockname(busy, reinterpret_cast<sockaddr*>(&a), &len);
  const int port = ntohs(a.sin_port);
  try {
    tcp_broadcast_bytes(LaunchEnv{0, 2, 0, "127.0.0.1", port}, payload(4), 1.0);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig);
    EXPECT_NE(std::string(e.what()).find(fmt::format("MASTER_PORT={}", port)), std::string::npos)
        << e.what();
  }
  ::close(busy);
}

// ---- the variables ---------------------------------------------------------------------------

EnvGetter vars(std::map<std::string, std::string> m) {
  auto held = std::make_shared<std::map<std::string, std::string>>(std::move(m));
  return [held](const char* name) -> const char* {
    const auto it = held->find(name);
    return it == held->end() ? nullptr : it->second.c_str();
  };
}

std::map<std::string, std::string> full() {
  return {{"RANK", "2"},
          {"WORLD_SIZE", "4"},
          {"LOCAL_RANK", "1"},
          {"MASTER_ADDR", "node0"},
          {"MASTER_PORT", "29500"}};
}

std::string error_of(std::map<std::string, std::string> m) {
  try {
    launch_env_from(vars(std::move(m)));
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig);
    return e.what();
  }
  return "no error";
}

TEST(LaunchEnv, ReadsTheTorchrunVariables) {
  const auto env = launch_env_from(vars(full()));
  ASSERT_TRUE(env.has_value());
  EXPECT_EQ(env->rank, 2);
  EXPECT_EQ(env->world_size, 4);
  EXPECT_EQ(env->local_rank, 1);
  EXPECT_EQ(env->master_addr, "node0");
  EXPECT_EQ(env->master_port, 29500);
}

TEST(LaunchEnv, NoWorldSizeMeansNotLaunched) {
  auto m = full();
  m.erase("WORLD_SIZE");
  EXPECT_FALSE(launch_env_from(vars(m)).has_value());
}

TEST(LaunchEnv, OneRankNeedsNoAddress) {
  const auto env = launch_env_from(vars({{"WORLD_SIZE", "1"}}));
  ASSERT_TRUE(env.has_value());
  EXPECT_EQ(env->world_size, 1);
  EXPECT_EQ(env->rank, 0);
}

TEST(LaunchEnv, MissingVariablesAreNamed) {
  for (const char* name : {"RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}) {
    auto m = full();
    m.erase(name);
    EXPECT_NE(error_of(m).find(fmt::format("but {} is not", name)), std::string::npos)
        << name << ": " << error_of(m);
  }
}

TEST(LaunchEnv, LocalRankFallsBackToTheLaunchersVariable) {
  auto m = full();
  m.erase("LOCAL_RANK");
  m.insert_or_assign("SLURM_LOCALID", "3");
  EXPECT_EQ(launch_env_from(vars(m))->local_rank, 3);
}

TEST(LaunchEnv, MalformedValuesAreNamed) {
  const std::pair<const char*, const char*> bad[] = {
      {"MASTER_PORT", "abc"}, {"MASTER_PORT", "70000"}, {"MASTER_PORT", "0"},
      {"RANK", "4"},          {"RANK", "-1"},           {"WORLD_SIZE", "two"}};
  for (const auto& [name, value] : bad) {
    auto m = full();
    m[name] = value;
    EXPECT_NE(error_of(m).find(fmt::format("{}='{}'", name, value)), std::string::npos)
        << name << "=" << value << ": " << error_of(m);
  }
}

// train() under torchrun-style variables without MPI: the CPU backend has no transport for
// them (it communicates over MPI), so it refuses instead of training each rank alone.
TEST(LaunchEnv, TorchrunVariablesWithTheCpuBackendAreRefused) {
  const std::map<std::string, std::string> env = full();
  for (const auto& [k, v] : env) ::setenv(k.c_str(), v.c_str(), 1);
  const RunConfig cfg = parse_run_config(
      R"({"model": {"preset": "tiny"}, "data": {"train": "tests/data/genesis_1_12.txt"},
          "train": {"max_steps": 1}})",
      {}, SHARDLM_SOURCE_DIR);
  try {
    train(cfg, std::cout);
    ADD_FAILURE() << "expected a config error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig);
    EXPECT_NE(std::string(e.what()).find("WORLD_SIZE=4 is set"), std::string::npos) << e.what();
  }
  for (const auto& [k, v] : env) ::unsetenv(k.c_str());
}

}  // namespace
}  // namespace shardlm
