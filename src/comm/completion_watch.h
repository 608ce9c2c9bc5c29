// CompletionWatch: the failure detector for operations that no caller waits for on the host.
// A device transport's collective on device tensors (NCCL) completes on the device: the
// compute stream waits for it (cudaStreamWaitEvent) and the host moves on, so no caller is
// there to notice a peer that never arrives or an error NCCL reports later. The watch's
// thread polls every operation registered with it until it has completed; when a poll reports
// an error, or the operation is older than the timeout, it records the failure and calls the
// transport's on_failure, which ends the process (NCCL: the compute stream may wait for the
// failed operation forever, so nothing can be unwound safely; PyTorch's ProcessGroupNCCL
// watchdog tears its process down too, by default without aborting the communicator). A failure
// a caller saw itself (a host wait's timeout) is recorded with fail(), and every later check of
// the family (raise_if_failed, which each operation calls before it starts) throws the first
// one recorded. One watch serves a transport's whole family of communicators (the world and
// every group split from it), made by the world and shared: no global.
//
// Locks: a poll runs on the watch's thread under the watch's lock and must not block (a
// communicator's lock is tried, never waited for: a busy communicator is polled next round, and
// its operations still time out), so a thread that holds a communicator's lock may register an
// operation without any order to keep. The failure is read without a lock. on_failure runs
// outside every lock. Host-only (the callbacks hold the transport), so its rules are tested
// without a GPU.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "shardlm/core/check.h"

namespace shardlm {

class CompletionWatch {
 public:
  enum class Poll {
    kPending,  // not complete yet
    kDone,     // complete: dropped from the watch
    kBusy,     // could not look now (its communicator's lock is held): polled next round
  };

  struct Watched {
    std::string what;  // names the operation, its communicator and rank, for the error
    // The communicator (forget). One owner's operations run on one stream, in order, so a round
    // polls them only up to the first not done (one registered out of that order is then
    // seen done a little later); null: an operation on its own.
    const void* owner{};
    // Non-blocking. Throws Error when the operation failed (the transport's own error).
    std::function<Poll()> poll;
    // Optional: the poll once its owner is gone (forget), reading nothing of it (NCCL: the
    // event alone). The compute stream may still wait for the operation while the owner is
    // destroyed (an error unwinding), so it is watched, and times out, to the end.
    std::function<Poll()> orphan_poll;
  };

  // timeout_s: an operation not complete after this many seconds (from its registration)
  // fails; `timeout_hint` follows "<what> did not complete within T s (SHARDLM_COMM_TIMEOUT_S): "
  // in its message. on_failure is called once, on the watch's thread, when the watch itself sees
  // a failure, with the first one recorded (the cause, which may be a caller's).
  CompletionWatch(double timeout_s, std::string timeout_hint,
                  std::function<void(const Error&)> on_failure,
                  std::chrono::milliseconds period = std::chrono::milliseconds(20));
  ~CompletionWatch();  // stops the thread; what is still registered is no longer watched
  CompletionWatch(const CompletionWatch&) = delete;
  CompletionWatch& operator=(const CompletionWatch&) = delete;

  // Registers an operation (from any thread); it is polled until it completes or fails.
  void watch(Watched op);
  // Once it returns no `poll` of `owner`'s operations runs again (a communicator calls it before
  // it frees what they read): those with an orphan_poll are watched with it from then on, the
  // others are dropped.
  void forget(const void* owner);
  // Records a failure a caller saw itself, so that the family's other threads raise it too; the
  // first failure recorded is the one every later check throws.
  void fail(ErrorKind kind, const std::string& message);
  // Throws the first failure recorded (every later operation of the family, on every thread).
  void raise_if_failed() const;
  bool failed() const { return failed_.load(); }
  size_t pending() const;

 private:
  struct Entry;
  void loop();
  void poll_round(std::chrono::steady_clock::time_point now);
  bool settle(Entry& e, std::chrono::steady_clock::time_point now);
  void record(ErrorKind kind, const std::string& message);  // the first one wins

  const double timeout_s_;
  const std::string timeout_hint_;
  const std::function<void(const Error&)> on_failure_;
  const std::chrono::milliseconds period_;

  struct Entry {
    Watched op;
    std::chrono::steady_clock::time_point started;
  };
  mutable std::mutex mutex_;  // entries_, stopping_
  std::condition_variable wake_;
  std::vector<Entry> entries_;
  bool stopping_ = false;
  // The failure: written once under failure_mutex_, then published by failed_ (read lock-free).
  std::mutex failure_mutex_;
  std::atomic<bool> failed_{false};
  ErrorKind failure_kind_ = ErrorKind::kInternal;
  std::string failure_;
  bool watch_failed_ = false;  // the watch has seen a failure itself (its thread only)
  std::thread thread_;         // last: started once the members above exist
};

}  // namespace shardlm
