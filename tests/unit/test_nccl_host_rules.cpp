// The NCCL communicator's host-only rules, without a GPU: the process-wide enqueue lock its
// communicators share (comm/enqueue_lock.h: one thread issues NCCL operations at a time, a
// communicator's own lock before it, never nested, a holder that never returns reported by
// name), and the GPU each rank drives (nccl_device_for: more ranks on a node than GPUs is a
// config error naming parallel.device_comm = "host").
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "comm/enqueue_lock.h"
#include "shardlm/comm/nccl.h"
#include "shardlm/core/check.h"

namespace shardlm {
namespace {

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// The trainer's thread and ZeRO's worker, each on a communicator of its own, enqueueing as
// fast as they can: never two inside a hold at once.
TEST(EnqueueLock, OneThreadEnqueuesAtATime) {
  EnqueueLock lock;
  std::atomic<int> inside{0}, most{0};
  const auto worker = [&](std::timed_mutex& comm) {
    for (int i = 0; i < 2000; ++i) {
      auto own = lock.comm_lock(comm, "op");
      const EnqueueLock::Hold hold = lock.hold(60, "op");
      const int now = ++inside;
      int seen = most.load();
      while (now > seen && !most.compare_exchange_weak(seen, now)) {
      }
      if (i % 64 == 0) std::this_thread::yield();
      --inside;
    }
  };
  std::timed_mutex tp, dp;
  std::thread a(worker, std::ref(tp)), b(worker, std::ref(dp));
  a.join();
  b.join();
  EXPECT_EQ(most.load(), 1);
  EXPECT_FALSE(lock.held_here());
}

// The order: a communicator's lock, then the enqueue lock; the other order, or a second hold on
// the same thread, is refused at once instead of waiting for itself.
TEST(EnqueueLock, RefusesTheOtherOrderAndNesting) {
  EnqueueLock lock;
  std::timed_mutex comm;
  {
    auto own = lock.comm_lock(comm, "all_reduce");
    const EnqueueLock::Hold hold = lock.hold(60, "all_reduce");
    EXPECT_TRUE(lock.held_here());
    std::timed_mutex other;
    EXPECT_NE(message_of([&] {
                (void)lock.comm_lock(other, "split");
              }).find("the order is the communicator's first"),
              std::string::npos);
    EXPECT_NE(message_of([&] { (void)lock.hold(60, "send"); }).find("send: this thread already"),
              std::string::npos);
  }
  EXPECT_FALSE(lock.held_here());
  // Released on the way out of a failure too: the next hold comes at once.
  EXPECT_THROW(
      {
        const EnqueueLock::Hold hold = lock.hold(60, "recv");
        SHARDLM_FAIL(ErrorKind::kInternal, "NCCL error");
      },
      Error);
  const EnqueueLock::Hold again = lock.hold(0.001, "recv");
  EXPECT_TRUE(lock.held_here());
}

// A holder that never lets go (an enqueue stuck in NCCL) becomes an error naming the waiting
// operation and the timeout on the other thread, not a silent hang.
TEST(EnqueueLock, AHolderThatNeverReturnsTimesOutByName) {
  EnqueueLock lock;
  std::atomic<bool> holding{false}, done{false};
  std::thread stuck([&] {
    const EnqueueLock::Hold hold = lock.hold(60, "all_gather");
    holding = true;
    while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  while (!holding) std::this_thread::yield();
  EXPECT_FALSE(lock.held_here());
  const std::string m = message_of([&] { (void)lock.hold(0.05, "reduce_scatter"); });
  done = true;
  stuck.join();
  EXPECT_NE(m.find("reduce_scatter: another thread"), std::string::npos) << m;
  EXPECT_NE(m.find("0.05 s"), std::string::npos) << m;
}

TEST(NcclDevice, OneGpuPerRankOfANode) {
  EXPECT_EQ(nccl_device_for(0, 0, 4, 4), 0);
  EXPECT_EQ(nccl_device_for(7, 3, 4, 8), 3);
  EXPECT_EQ(nccl_device_for(5, 1, 0, 2), 1);  // local size unknown: the local rank bounds it
}

TEST(NcclDevice, MoreRanksThanGpusIsAConfigErrorNamingTheHostTransport) {
  const std::vector<std::pair<int, int>> cases = {{0, 3}, {2, 3}, {2, 0}};  // local, local size
  for (const auto& [local, local_size] : cases) {
    try {
      nccl_device_for(4 + local, local, local_size, 2);
      FAIL() << "local rank " << local << " of " << local_size << " on 2 GPUs";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_EQ(e.kind(), ErrorKind::kConfig);
      EXPECT_NE(m.find("3 ranks on this node but 2 visible GPUs"), std::string::npos) << m;
      EXPECT_NE(m.find("parallel.device_comm = \"host\""), std::string::npos) << m;
    }
  }
}

}  // namespace
}  // namespace shardlm
