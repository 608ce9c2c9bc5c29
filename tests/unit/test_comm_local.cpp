// LocalCommunicator (no MPI): every collective is the size-1 fast path (a copy or nothing),
// argument validation matches what every backend sees, send/recv to self go through the
// mailbox, split gives another local communicator; also the timeout option and launcher check.
#include <gtest/gtest.h>

#include <cstdlib>
#include <vector>

#include "shardlm/comm/local.h"
#include "shardlm/comm/world.h"

namespace shardlm {
namespace {

Tensor f32(std::vector<float>& v) {
  return Tensor(v.data(), DType::kF32, {static_cast<int64_t>(v.size())});
}
Tensor bf16(std::vector<uint16_t>& v) {
  return Tensor(v.data(), DType::kBF16, {static_cast<int64_t>(v.size())});
}

TEST(LocalComm, IsOneRank) {
  LocalCommunicator c;
  EXPECT_EQ(c.rank(), 0);
  EXPECT_EQ(c.size(), 1);
  EXPECT_EQ(c.local_rank(), 0);
  EXPECT_EQ(c.local_size(), 1);
  EXPECT_EQ(c.backend(), "local");
  EXPECT_EQ(c.name(), "local");
}

TEST(LocalComm, CollectivesAreCopiesOrNothing) {
  LocalCommunicator c;
  std::vector<float> x = {1.5f, -2.f, 3.f};
  c.all_reduce(f32(x));
  c.all_reduce(f32(x), ReduceOp::kMax);
  EXPECT_EQ(x, (std::vector<float>{1.5f, -2.f, 3.f}));

  std::vector<float> y(3, 0.f);
  c.reduce_scatter(f32(x), f32(y));
  EXPECT_EQ(y, x);
  std::fill(y.begin(), y.end(), 0.f);
  c.all_gather(f32(x), f32(y));
  EXPECT_EQ(y, x);
  c.all_gather(f32(y), f32(y));  // in place: this rank's chunk is the whole buffer
  EXPECT_EQ(y, x);
  std::fill(y.begin(), y.end(), 0.f);
  c.all_to_all(f32(x), f32(y));
  EXPECT_EQ(y, x);
  c.broadcast(f32(x), 0);
  c.barrier();
  EXPECT_EQ(x, (std::vector<float>{1.5f, -2.f, 3.f}));

  std::vector<uint16_t> h = {1, 2}, g(2, 0);
  c.all_gather(bf16(h), bf16(g));
  EXPECT_EQ(g, h);

  // bf16 reductions too: over one rank nothing is combined, so nothing is rounded.
  std::vector<uint16_t> b = {f32_to_bf16(1.5f), f32_to_bf16(-3.f), 0x7fc0}, r(3, 0);
  const std::vector<uint16_t> before = b;
  c.all_reduce(bf16(b));
  c.all_reduce(bf16(b), ReduceOp::kMin);
  EXPECT_EQ(b, before);
  c.reduce_scatter_async(bf16(b), bf16(r), ReduceOp::kMax)->wait();
  EXPECT_EQ(r, before);
}

TEST(LocalComm, AsyncHandlesAreComplete) {
  LocalCommunicator c;
  std::vector<float> x = {1.f, 2.f}, y(2, 0.f);
  auto a = c.all_reduce_async(f32(x));
  auto r = c.reduce_scatter_async(f32(x), f32(y));
  EXPECT_TRUE(a->test());
  EXPECT_TRUE(r->test());
  a->wait();
  r->wait();
  EXPECT_EQ(y, x);
}

TEST(LocalComm, ValidatesLikeEveryBackend) {
  LocalCommunicator c;
  std::vector<float> x(4), y(3);
  std::vector<uint16_t> h(4);
  EXPECT_THROW(c.reduce_scatter(f32(x), f32(y)), Error);  // 4 != 1 * 3
  EXPECT_THROW(c.all_gather(f32(y), f32(x)), Error);
  EXPECT_THROW(c.all_to_all(f32(x), f32(x)), Error);  // overlap
  EXPECT_THROW(c.all_to_all(f32(x), f32(y)), Error);
  EXPECT_THROW(c.broadcast(f32(x), 1), Error);
  EXPECT_THROW(c.send(f32(x), 1), Error);
  EXPECT_THROW(c.send(f32(x), 0, -1), Error);
  EXPECT_THROW(c.split(-1, 0), Error);
  std::vector<float> f(4);
  EXPECT_THROW(c.all_gather(bf16(h), f32(f)), Error);      // dtypes differ
  EXPECT_THROW(c.reduce_scatter(bf16(h), f32(f)), Error);  // dtypes differ
}

TEST(LocalComm, SendToSelfThenRecvByTag) {
  LocalCommunicator c;
  std::vector<float> a = {1.f, 2.f}, b = {3.f}, ra(2), rb(1);
  c.send(f32(a), 0, 5);
  auto h = c.send_async(f32(b), 0, 6);
  h->wait();
  c.recv(f32(rb), 0, 6);  // tags match out of send order
  c.recv(f32(ra), 0, 5);
  EXPECT_EQ(ra, a);
  EXPECT_EQ(rb, b);
  EXPECT_THROW(c.recv(f32(ra), 0, 5), Error);  // nothing left: would wait forever
  c.send(f32(a), 0, 7);
  EXPECT_THROW(c.recv(f32(rb), 0, 7), Error);  // 2 elements sent, 1 expected
}

TEST(LocalComm, SendRecvToSelfCopies) {
  LocalCommunicator c;
  std::vector<float> out = {1.f, 2.f, 3.f}, in(3, 0.f);
  c.sendrecv(f32(out), 0, f32(in), 0, 4);
  EXPECT_EQ(in, out);
  EXPECT_THROW(c.sendrecv(f32(out), 1, f32(in), 0), Error);   // no rank 1
  EXPECT_THROW(c.sendrecv(f32(out), 0, f32(out), 0), Error);  // overlap
}

TEST(LocalComm, SplitGivesANamedLocalCommunicator) {
  LocalCommunicator c("world", CommOptions{.timeout_s = 12});
  auto tp = c.split(0, 0, "tp");
  EXPECT_EQ(tp->name(), "world/tp");
  EXPECT_EQ(tp->size(), 1);
  EXPECT_EQ(tp->options().timeout_s, 12);
  EXPECT_EQ(c.split(3, 0)->name(), "world/color3");
}

TEST(LocalComm, TimeoutComesFromTheEnvironment) {
  unsetenv("SHARDLM_COMM_TIMEOUT_S");
  EXPECT_EQ(CommOptions::from_env().timeout_s, CommOptions::kDefaultTimeoutS);
  setenv("SHARDLM_COMM_TIMEOUT_S", "2.5", 1);
  EXPECT_EQ(CommOptions::from_env().timeout_s, 2.5);
  for (const char* bad : {"abc", "-1", "0", "5s"}) {
    setenv("SHARDLM_COMM_TIMEOUT_S", bad, 1);
    try {
      CommOptions::from_env();
      ADD_FAILURE() << "accepted " << bad;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kConfig);
      EXPECT_NE(std::string(e.what()).find("SHARDLM_COMM_TIMEOUT_S"), std::string::npos);
    }
  }
  unsetenv("SHARDLM_COMM_TIMEOUT_S");
}

TEST(LocalComm, LaunchedUnderMpiReadsTheLauncherVariables) {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) unsetenv(var);
  EXPECT_FALSE(launched_under_mpi());
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    setenv(var, "2", 1);
    EXPECT_TRUE(launched_under_mpi()) << var;
    unsetenv(var);
  }
}

TEST(LocalCommDeathTest, AbortWorldExitsWithTheCodeAndNamesTheRank) {
  LocalCommunicator c("world");
  EXPECT_EXIT(abort_world(c, "boom", 3), ::testing::ExitedWithCode(3), "rank 0 of 1: boom");
}

}  // namespace
}  // namespace shardlm
