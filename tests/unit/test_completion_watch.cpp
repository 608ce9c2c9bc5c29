// The watch over operations completed on the device (comm/completion_watch.h), without a GPU:
// operations stand in as flags. A completed one leaves; one past the timeout fails the family
// once, with a message naming it; a poll's own error is the failure; the first failure is the
// one raised and reported; a busy communicator is tried again, never waited for, and still
// times out; on_failure blocks no other thread; one communicator's operations are polled in
// order; forget stops every callback of its owner.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

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

// An operation with a poll alone (no orphan poll).
CompletionWatch::Watched plain_op(std::string what, const void* owner,
                                  std::function<CompletionWatch::Poll()> poll) {
  CompletionWatch::Watched w;
  w.what = std::move(what);
  w.owner = owner;
  w.poll = std::move(poll);
  return w;
}

// A stand-in operation: complete once `done` is set; counts its polls.
struct FakeOp {
  std::atomic<bool> done{false};
  std::atomic<int> polls{0};

  CompletionWatch::Watched watched(std::string what, const void* owner) {
    return plain_op(std::move(what), owner, [this] {
      ++polls;
      return done ? CompletionWatch::Poll::kDone : CompletionWatch::Poll::kPending;
    });
  }
};

// The failures on_failure was called with (the transport's ends the process).
struct Failures {
  std::mutex mu;
  std::vector<std::string> seen;
  std::function<void(const Error&)> callback() {
    return [this](const Error& e) {
      const std::lock_guard<std::mutex> lock(mu);
      seen.emplace_back(e.what());
    };
  }
  size_t count() {
    const std::lock_guard<std::mutex> lock(mu);
    return seen.size();
  }
  std::string first() {
    const std::lock_guard<std::mutex> lock(mu);
    return seen.empty() ? "" : seen.front();
  }
};

TEST(CompletionWatch, ACompletedOperationLeavesWithoutAFailure) {
  Failures failures;
  CompletionWatch watch(60.0, "hint", failures.callback(), kPeriod);
  FakeOp op;
  watch.watch(op.watched("all_reduce on 'world/tp'", &op));
  EXPECT_TRUE(eventually([&] { return op.polls >= 3; }));
  EXPECT_EQ(watch.pending(), 1u);
  op.done = true;
  EXPECT_TRUE(eventually([&] { return watch.pending() == 0; }));
  EXPECT_FALSE(watch.failed());
  EXPECT_EQ(raised(watch), "");
  EXPECT_EQ(failures.count(), 0u);
}

// Nobody waits on the host: the watch alone sees the timeout, calls on_failure once with a
// message naming the operation, and every later check raises it.
TEST(CompletionWatch, AnOperationPastTheTimeoutFailsTheFamilyOnce) {
  Failures failures;
  CompletionWatch watch(0.05, "another rank never called it", failures.callback(), kPeriod);
  FakeOp stuck, later;
  watch.watch(stuck.watched("rank 1 of 2: sendrecv of 64 elements on 'world/pp'", &stuck));
  ASSERT_TRUE(eventually([&] { return failures.count() == 1; }));
  ErrorKind kind{};
  const std::string message = raised(watch, &kind);
  EXPECT_EQ(kind, ErrorKind::kInternal);
  EXPECT_NE(message.find("rank 1 of 2: sendrecv of 64 elements on 'world/pp' did not complete "
                         "within 0.05 s (SHARDLM_COMM_TIMEOUT_S): another rank never called it"),
            std::string::npos)
      << message;
  EXPECT_EQ(failures.first(), message);
  watch.watch(later.watched("later", nullptr));
  std::this_thread::sleep_for(milliseconds(100));
  EXPECT_EQ(failures.count(), 1u);  // once: the process ends there
}

// A poll that sees the transport's own error (NCCL's async error) throws: that error, with its
// kind, is the family's failure.
TEST(CompletionWatch, APollsErrorIsTheFailure) {
  Failures failures;
  CompletionWatch watch(60.0, "hint", failures.callback(), kPeriod);
  watch.watch(plain_op("all_gather", nullptr, []() -> CompletionWatch::Poll {
    throw Error(ErrorKind::kInternal, "all_gather: NCCL error: remote process exited");
  }));
  ASSERT_TRUE(eventually([&] { return failures.count() == 1; }));
  EXPECT_EQ(raised(watch), "all_gather: NCCL error: remote process exited");
  EXPECT_EQ(failures.first(), "all_gather: NCCL error: remote process exited");
  EXPECT_EQ(watch.pending(), 0u);
}

// A host wait that timed out on another thread records its failure: the family raises it, and
// when the watch then sees a failure of its own (what the abort made of the other operations),
// it reports the first, the cause.
TEST(CompletionWatch, TheFirstFailureIsTheOneRaisedAndReported) {
  Failures failures;
  CompletionWatch watch(60.0, "hint", failures.callback(), kPeriod);
  watch.fail(ErrorKind::kInternal, "reduce_scatter on 'world/dp' did not complete");
  EXPECT_EQ(raised(watch), "reduce_scatter on 'world/dp' did not complete");
  watch.watch(plain_op("all_reduce on 'world/tp'", nullptr, []() -> CompletionWatch::Poll {
    throw Error(ErrorKind::kInternal, "all_reduce: NCCL error: aborted");
  }));
  ASSERT_TRUE(eventually([&] { return failures.count() == 1; }));
  EXPECT_EQ(failures.first(), "reduce_scatter on 'world/dp' did not complete");
  EXPECT_EQ(raised(watch), "reduce_scatter on 'world/dp' did not complete");
}

// A communicator whose lock another thread holds (an enqueue, a host wait) is polled later,
// never waited for: a thread holding that lock can register and check, the operation completes
// once the lock is free, and an operation that stays busy still times out.
TEST(CompletionWatch, ABusyCommunicatorIsTriedAgainNotWaitedFor) {
  std::timed_mutex comm_lock;
  std::atomic<bool> done{false};
  std::atomic<int> busy_polls{0};
  const auto try_poll = [&] {
    std::unique_lock<std::timed_mutex> lock(comm_lock, std::try_to_lock);
    if (!lock.owns_lock()) {
      ++busy_polls;
      return CompletionWatch::Poll::kBusy;
    }
    return done ? CompletionWatch::Poll::kDone : CompletionWatch::Poll::kPending;
  };
  {
    Failures failures;
    CompletionWatch watch(60.0, "hint", failures.callback(), kPeriod);
    {
      const std::lock_guard<std::timed_mutex> held(comm_lock);
      watch.watch(plain_op("send", &comm_lock, try_poll));  // registering under the lock
      ASSERT_TRUE(eventually([&] { return busy_polls >= 3; }));
      EXPECT_EQ(raised(watch), "");
      done = true;
      std::this_thread::sleep_for(milliseconds(10));
      EXPECT_EQ(watch.pending(), 1u);  // done, but not seen while the lock is held
    }
    EXPECT_TRUE(eventually([&] { return watch.pending() == 0; }));
    EXPECT_EQ(failures.count(), 0u);
  }
  done = false;
  Failures failures;
  CompletionWatch watch(0.05, "hint", failures.callback(), kPeriod);
  const std::lock_guard<std::timed_mutex> held(comm_lock);
  watch.watch(plain_op("recv", &comm_lock, try_poll));
  ASSERT_TRUE(eventually([&] { return failures.count() == 1; }));
  EXPECT_NE(failures.first().find("recv did not complete"), std::string::npos);
}

// on_failure runs outside the watch's lock: while it blocks (an exit that takes its time),
// every other thread still registers, checks and raises.
TEST(CompletionWatch, OnFailureBlocksNoOtherThread) {
  std::atomic<bool> entered{false}, release{false};
  CompletionWatch watch(
      0.01, "hint",
      [&](const Error&) {
        entered = true;
        eventually([&] { return release.load(); });
      },
      kPeriod);
  FakeOp stuck, other;
  watch.watch(stuck.watched("stuck", nullptr));
  ASSERT_TRUE(eventually([&] { return entered.load(); }));
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_NE(raised(watch), "");
  watch.watch(other.watched("other", nullptr));
  watch.fail(ErrorKind::kInternal, "later");
  EXPECT_EQ(watch.pending(), 1u);
  const double took = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  release = true;
  EXPECT_LT(took, 5.0);  // on_failure waits up to 10 s: a call that waited for it would show
}

// One communicator's operations run on one stream and complete in order: a round polls them up
// to the first not done, so the younger ones wait (however many are in flight, a round costs
// one poll per communicator); the operations of another communicator, or of none, are polled.
TEST(CompletionWatch, OneOwnersOperationsArePolledInOrder) {
  Failures failures;
  CompletionWatch watch(60.0, "hint", failures.callback(), kPeriod);
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
  EXPECT_EQ(failures.count(), 0u);
}

// A communicator going away: once forget returns, none of its polls runs again; an operation
// with an orphan poll is watched with it to the end (it completes, or times out); the other
// communicators' operations are still watched.
TEST(CompletionWatch, ForgetStopsEveryCallbackOfItsOwner) {
  Failures failures;
  CompletionWatch watch(60.0, "hint", failures.callback(), kPeriod);
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
  EXPECT_EQ(failures.count(), 0u);

  // With orphan polls: one completes after its owner is gone, one never does and times out.
  Failures late;
  CompletionWatch short_watch(0.3, "hint", late.callback(), kPeriod);
  std::atomic<bool> first_done{false};
  std::atomic<int> owner_polls{0}, orphan_polls{0};
  const auto owned = [&] {
    ++owner_polls;
    return CompletionWatch::Poll::kPending;
  };
  short_watch.watch({"first", &owner_a, owned, [&] {
                       ++orphan_polls;
                       return first_done ? CompletionWatch::Poll::kDone
                                         : CompletionWatch::Poll::kPending;
                     }});
  short_watch.watch({"never", &owner_a, owned, [] { return CompletionWatch::Poll::kPending; }});
  ASSERT_TRUE(eventually([&] { return owner_polls >= 2; }));
  short_watch.forget(&owner_a);
  const int owned_polls = owner_polls;
  first_done = true;
  ASSERT_TRUE(eventually([&] { return late.count() == 1; }));
  EXPECT_NE(late.first().find("never did not complete within 0.3 s"), std::string::npos)
      << late.first();
  EXPECT_GE(orphan_polls, 1);
  EXPECT_EQ(owner_polls, owned_polls);
}

// Registrations from several threads at once (the trainer's and ZeRO's worker's) while the
// watch polls: every one is seen to completion.
TEST(CompletionWatch, ManyThreadsRegisterWhileItPolls) {
  Failures failures;
  CompletionWatch watch(60.0, "hint", failures.callback(), kPeriod);
  constexpr int kThreads = 4, kOps = 200;
  std::atomic<int> completed{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&] {
      for (int i = 0; i < kOps; ++i) {
        auto polls = std::make_shared<int>(0);
        watch.watch(plain_op("op", nullptr, [polls, &completed] {
          if (++*polls < 2) return CompletionWatch::Poll::kPending;
          ++completed;
          return CompletionWatch::Poll::kDone;
        }));
      }
    });
  for (auto& t : threads) t.join();
  EXPECT_TRUE(eventually([&] { return watch.pending() == 0; }));
  EXPECT_EQ(completed, kThreads * kOps);
  EXPECT_EQ(failures.count(), 0u);
}

}  // namespace
}  // namespace shardlm
