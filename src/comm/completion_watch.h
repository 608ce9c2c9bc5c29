// CompletionWatch: the failure detector for operations that no caller waits for on the host.
// A device transport's collective on device tensors (NCCL) completes on the device: the
// compute stream waits for it (cudaStreamWaitEvent) and the host moves on, so no caller is
// there to notice a peer that never arrives or an error NCCL reports later. The watch's
// thread polls every operation registered with it until it has completed; when a poll reports
// an error, or the operation is older than the timeout, it aborts the operation's
// communicator, records the first failure, and every later check (raise_if_failed, which each
// operation of the family calls before it starts) throws it. PyTorch's ProcessGroupNCCL
// watchdog does the same. One watch serves a transport's whole family of communicators (the
// world and every group split from it), made by the world and shared: no global.
//
// Locks: every callback runs on the watch's thread under its mutex and must not block (a
// communicator's lock is tried, never waited for: a busy communicator is polled next round),
// so a thread that holds a communicator's lock may register an operation without any order
// to keep. Host-only (the callbacks hold the transport), so its rules are tested without a GPU.
#pragma once

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
    // The communicator (forget). One owner's operations complete in the order they were
    // registered (one stream), so a round polls them only up to the first not done; null: an
    // operation on its own.
    const void* owner{};
    // Non-blocking. Throws Error when the operation failed, having aborted its communicator.
    std::function<Poll()> poll;
    // Non-blocking: aborts the operation's communicator after the timeout; false when it could
    // not act now (tried again next round).
    std::function<bool()> abort;
  };

  // timeout_s: an operation not complete after this many seconds fails; `timeout_hint` follows
  // "<what> did not complete within T s (SHARDLM_COMM_TIMEOUT_S): " in its message. `report`
  // (optional) is called once, on the watch's thread, with the first failure's message as soon
  // as it is seen: the only trace should the process hang before a thread raises it.
  CompletionWatch(double timeout_s, std::string timeout_hint,
                  std::function<void(const std::string&)> report = {},
                  std::chrono::milliseconds period = std::chrono::milliseconds(20));
  ~CompletionWatch();  // stops the thread; what is still registered is no longer watched
  CompletionWatch(const CompletionWatch&) = delete;
  CompletionWatch& operator=(const CompletionWatch&) = delete;

  // Registers an operation (from any thread); it is polled until it completes or fails.
  void watch(Watched op);
  // Drops every operation of `owner`; once it returns no callback of them runs (a communicator
  // calls it before it frees what they read).
  void forget(const void* owner);
  // Records a failure a caller saw itself (a host wait that timed out), so that the family's
  // other threads raise it too; the first failure recorded is the one every later check throws.
  void fail(ErrorKind kind, const std::string& message);
  // Throws the first failure seen (every later operation of the family, on every thread).
  void raise_if_failed() const;
  bool failed() const;
  size_t pending() const;

 private:
  void loop();
  struct Entry;
  void poll_round(std::chrono::steady_clock::time_point now);
  bool settle(Entry& e, std::chrono::steady_clock::time_point now);
  void record(ErrorKind kind, const std::string& message);

  const double timeout_s_;
  const std::string timeout_hint_;
  const std::function<void(const std::string&)> report_;
  const std::chrono::milliseconds period_;

  struct Entry {
    Watched op;
    std::chrono::steady_clock::time_point started;
    bool expired = false;  // timed out: its abort has run, the failure is recorded
  };
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<Entry> entries_;
  bool stopping_ = false;
  bool failed_ = false;
  ErrorKind failure_kind_ = ErrorKind::kInternal;
  std::string failure_;
  std::thread thread_;  // last: started once the members above exist
};

}  // namespace shardlm
