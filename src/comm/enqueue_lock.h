// EnqueueLock: the one lock a process's communicators of a device transport (NCCL) share, so
// that only one thread at a time issues operations to any of them, and the order in which it is
// taken with a communicator's own lock. NCCL: "it is not safe to issue NCCL operations in
// parallel to independent communicators located on the same device with multiple threads"
// (Thread Safety), while the trainer's thread runs the tp/cp/pp groups and ZeRO's worker the
// data-parallel ones. Made by the transport's world and handed to every communicator split
// from it (no global); host-only, so its rules are tested without a GPU.
//
// The order, the same on every thread: a communicator's own lock (comm_lock), then this one
// (hold), never the other way round and never twice; a hold covers an enqueue (group start to
// its end, settled) or a split, not the wait for the operation to complete.
#pragma once

#include <atomic>
#include <chrono>
#include <mutex>
#include <string_view>
#include <thread>

namespace shardlm {

class EnqueueLock {
 public:
  // Held by one thread while it issues operations; releases on destruction.
  class Hold {
   public:
    Hold(Hold&& other) noexcept : lock_(other.lock_) { other.lock_ = nullptr; }
    Hold(const Hold&) = delete;
    Hold& operator=(const Hold&) = delete;
    Hold& operator=(Hold&&) = delete;
    ~Hold();

   private:
    friend class EnqueueLock;
    explicit Hold(EnqueueLock* lock) : lock_(lock) {}
    EnqueueLock* lock_;
  };

  EnqueueLock() = default;
  EnqueueLock(const EnqueueLock&) = delete;
  EnqueueLock& operator=(const EnqueueLock&) = delete;

  // Waits for the lock; `what` names the operation. Throws Error when this thread holds it
  // already (a nested hold would wait for itself), or when another thread has held it for
  // longer than timeout_s (a holder that never returns: NCCL hung in an enqueue).
  [[nodiscard]] Hold hold(double timeout_s, std::string_view what);

  // A communicator's own lock, taken before a hold: throws Error when this thread holds the
  // enqueue lock (the other order could deadlock against a thread that takes both in order).
  [[nodiscard]] std::unique_lock<std::timed_mutex> comm_lock(std::timed_mutex& comm_mutex,
                                                             std::string_view what) const;

  // Whether the calling thread holds it.
  bool held_here() const;

 private:
  std::timed_mutex mutex_;
  std::atomic<std::thread::id> owner_{};  // the holder, or none
};

}  // namespace shardlm
