// The watch over operations completed on the device (comm/completion_watch.h), without a GPU:
// operations stand in as flags. A completed one leaves; one past the timeout has its
// communicator aborted once and fails the family with a message naming it; a poll's own error
// is the failure; the first failure is the one raised; a busy communicator is tried again, never
// waited for; forget stops every callback of its owner.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "comm/completion_watch.h"
#include "shardlm/core/check.h"

namespace shardlm {
namespace {

using std::chrono::milliseconds;

constexpr auto kPeriod = milliseconds(1);

// Waits (bounded) until `cond` holds; false if it never did.
bool eventually(const std::function<bool()>& cond, double seconds = 10.0) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end) {
    if (cond()) return true;
    std::this_thread::sleep_for(milliseconds(1));
  }
  return cond();
}

std::string raised(const CompletionWatch& watch, ErrorKind* kind = nullptr) {
  try {
    watch.raise_if_failed();
  } catch (const Error& e) {
    if (kind != nullptr) *kind = e.kind();
    return e.what();
  }
  return "";
}

// A stand-in operation: complete once `done` is set; counts its polls and aborts.
struct FakeOp {
  std::atomic<bool> done{false};
  std::atomic<int> polls{0}, aborts{0};

  CompletionWatch::Watched watched(std::string what, const void* owner) {
    return {std::move(what), owner,
            [this] {
              ++polls;
              return done ? CompletionWatch::Poll::kDone : CompletionWatch::Poll::kPending;
            },
            [this] {
              ++aborts;
              return true;
            }};
  }
};

TEST(CompletionWatch, ACompletedOperationLeavesWithoutAFailure) {
  CompletionWatch watch(60.0, "hint", {}, kPeriod);
  FakeOp op;
  watch.watch(op.watched("all_reduce on 'world/tp'", &op));
  EXPECT_TRUE(eventually([&] { return op.polls >= 3; }));
  EXPECT_EQ(watch.pending(), 1u);
  op.done = true;
  EXPECT_TRUE(eventually([&] { return watch.pending() == 0; }));
  EXPECT_FALSE(watch.failed());
  EXPECT_EQ(raised(watch), "");
  EXPECT_EQ(op.aborts, 0);
}

// Nobody waits on the host: the watch alone sees the timeout, aborts the communicator once,
// reports at once and fails every later check with the operation's name.
TEST(CompletionWatch, AnOperationPastTheTimeoutAbortsItsCommunicatorAndFailsTheFamily) {
  std::atomic<int> reports{0};
  std::string reported;
  std::mutex report_mu;
  CompletionWatch watch(
      0.05, "another rank never called it",
      [&](const std::string& m) {
        const std::lock_guard<std::mutex> lock(report_mu);
        reported = m;
        ++reports;
      },
      kPeriod);
  FakeOp stuck;
  watch.watch(stuck.watched("rank 1 of 2: sendrecv of 64 elements on 'world/pp'", &stuck));
  ASSERT_TRUE(eventually([&] { return watch.failed() && watch.pending() == 0; }));
  ErrorKind kind{};
  const std::string message = raised(watch, &kind);
  EXPECT_EQ(kind, ErrorKind::kInternal);
  EXPECT_NE(message.find("rank 1 of 2: sendrecv of 64 elements on 'world/pp' did not complete "
                         "within 0.05 s (SHARDLM_COMM_TIMEOUT_S): another rank never called it"),
            std::string::npos)
      << message;
  EXPECT_EQ(stuck.aborts, 1);
  std::this_thread::sleep_for(milliseconds(20));
  EXPECT_EQ(stuck.aborts, 1);  // dropped once aborted
  EXPECT_EQ(reports, 1);
  const std::lock_guard<std::mutex> lock(report_mu);
  EXPECT_EQ(reported, message);
}

// A poll that sees the transport's own error (NCCL's async error) has aborted and throws: that
// error, with its kind, is the family's failure; the watch aborts nothing more.
TEST(CompletionWatch, APollsErrorIsTheFailure) {
  CompletionWatch watch(60.0, "hint", {}, kPeriod);
  std::atomic<int> aborts{0};
  watch.watch({"all_gather", nullptr,
               []() -> CompletionWatch::Poll {
                 throw Error(ErrorKind::kInternal, "all_gather: NCCL error: remote process exited");
               },
               [&] {
                 ++aborts;
                 return true;
               }});
  ASSERT_TRUE(eventually([&] { return watch.failed() && watch.pending() == 0; }));
  EXPECT_EQ(raised(watch), "all_gather: NCCL error: remote process exited");
  EXPECT_EQ(aborts, 0);
}

// A host wait that timed out on another thread records its failure: the family raises it, and
// a later failure (what the abort made of the other operations) does not replace it.
TEST(CompletionWatch, TheFirstFailureIsTheOneRaised) {
  CompletionWatch watch(60.0, "hint", {}, kPeriod);
  watch.fail(ErrorKind::kInternal, "reduce_scatter on 'world/dp' did not complete");
  watch.watch({"all_reduce on 'world/tp'", nullptr,
               []() -> CompletionWatch::Poll {
                 throw Error(ErrorKind::kInternal, "all_reduce: the communicator was aborted");
               },
               [] { return true; }});
  ASSERT_TRUE(eventually([&] { return watch.pending() == 0; }));
  EXPECT_EQ(raised(watch), "reduce_scatter on 'world/dp' did not complete");
}

// A communicator whose lock another thread holds (an enqueue, a host wait) is polled and
// aborted later, never waited for: a thread holding that lock can register and check.
TEST(CompletionWatch, ABusyCommunicatorIsTriedAgainNotWaitedFor) {
  CompletionWatch watch(1.0, "hint", {}, kPeriod);
  std::timed_mutex comm_lock;
  std::atomic<bool> done{false};
  std::atomic<int> busy_polls{0}, aborts{0};
  const auto try_poll = [&] {
    std::unique_lock<std::timed_mutex> lock(comm_lock, std::try_to_lock);
    if (!lock.owns_lock()) {
      ++busy_polls;
      return CompletionWatch::Poll::kBusy;
    }
    return done ? CompletionWatch::Poll::kDone : CompletionWatch::Poll::kPending;
  };
  const auto try_abort = [&] {
    std::unique_lock<std::timed_mutex> lock(comm_lock, std::try_to_lock);
    if (!lock.owns_lock()) return false;
    ++aborts;
    return true;
  };
  {
    const std::lock_guard<std::timed_mutex> held(comm_lock);
    watch.watch({"send", &comm_lock, try_poll, try_abort});  // registering under the lock
    ASSERT_TRUE(eventually([&] { return busy_polls >= 3; }));
    EXPECT_EQ(raised(watch), "");
    ASSERT_TRUE(eventually([&] { return watch.failed(); }));  // past the timeout, still held
    EXPECT_EQ(aborts, 0);                                     // could not act yet
    EXPECT_EQ(watch.pending(), 1u);                           // so it stays
  }
  ASSERT_TRUE(eventually([&] { return watch.pending() == 0; }));
  EXPECT_EQ(aborts, 1);
}

// One communicator's operations run on one stream and complete in order: a round polls them up
// to the first not done, so the younger ones wait (however many are in flight, a round costs
// one poll per communicator); the operations of another communicator, or of none, are polled.
TEST(CompletionWatch, OneOwnersOperationsArePolledInOrder) {
  CompletionWatch watch(60.0, "hint", {}, kPeriod);
  FakeOp a1, a2, b, alone;
  const int owner_a = 0, owner_b = 0;
  watch.watch(a1.watched("a1", &owner_a));
  watch.watch(a2.watched("a2", &owner_a));
  watch.watch(b.watched("b", &owner_b));
  watch.watch(alone.watched("alone", nullptr));
  ASSERT_TRUE(eventually([&] { return a1.polls >= 3 && b.polls >= 3 && alone.polls >= 3; }));
  EXPECT_EQ(a2.polls, 0);
  a1.done = true;
  ASSERT_TRUE(eventually([&] { return a2.polls >= 2; }));
  EXPECT_EQ(watch.pending(), 3u);
  a2.done = b.done = alone.done = true;
  EXPECT_TRUE(eventually([&] { return watch.pending() == 0; }));
  EXPECT_FALSE(watch.failed());
}

// A communicator going away: once forget returns, none of its callbacks runs again, and the
// other communicators' operations are still watched.
TEST(CompletionWatch, ForgetStopsEveryCallbackOfItsOwner) {
  CompletionWatch watch(60.0, "hint", {}, kPeriod);
  FakeOp a1, a2, b;
  const int owner_a = 0, owner_b = 0;
  watch.watch(a1.watched("a1", &owner_a));
  watch.watch(a2.watched("a2", &owner_a));
  watch.watch(b.watched("b", &owner_b));
  a1.done = true;  // so that a2 is polled too
  ASSERT_TRUE(eventually([&] { return a2.polls >= 2 && b.polls >= 2; }));
  watch.forget(&owner_a);
  const int p2 = a2.polls, pb = b.polls;
  ASSERT_TRUE(eventually([&] { return b.polls >= pb + 3; }));
  EXPECT_EQ(a2.polls, p2);
  EXPECT_EQ(watch.pending(), 1u);
  b.done = true;
  EXPECT_TRUE(eventually([&] { return watch.pending() == 0; }));
  EXPECT_FALSE(watch.failed());
}

// Registrations from several threads at once (the trainer's and ZeRO's worker's) while the
// watch polls: every one is seen to completion.
TEST(CompletionWatch, ManyThreadsRegisterWhileItPolls) {
  CompletionWatch watch(60.0, "hint", {}, kPeriod);
  constexpr int kThreads = 4, kOps = 200;
  std::atomic<int> completed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < kOps; ++i) {
        auto polls = std::make_shared<int>(0);
        watch.watch({"op", nullptr,
                     [polls, &completed] {
                       if (++*polls < 2) return CompletionWatch::Poll::kPending;
                       ++completed;
                       return CompletionWatch::Poll::kDone;
                     },
                     [] { return true; }});
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_TRUE(eventually([&] { return watch.pending() == 0; }));
  EXPECT_EQ(completed, kThreads * kOps);
  EXPECT_FALSE(watch.failed());
}

}  // namespace
}  // namespace shardlm
