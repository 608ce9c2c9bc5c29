// The failure detector for operations completed on the device (completion_watch.h).
#include "comm/completion_watch.h"

#include <algorithm>
#include <utility>

namespace shardlm {

CompletionWatch::CompletionWatch(double timeout_s, std::string timeout_hint,
                                 std::function<void(const std::string&)> report,
                                 std::chrono::milliseconds period)
    : timeout_s_(timeout_s),
      timeout_hint_(std::move(timeout_hint)),
      report_(std::move(report)),
      period_(period),
      thread_([this] { loop(); }) {}

CompletionWatch::~CompletionWatch() {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void CompletionWatch::watch(Watched op) {
  const std::lock_guard<std::mutex> lock(mutex_);
  entries_.push_back({std::move(op), std::chrono::steady_clock::now()});
}

void CompletionWatch::forget(const void* owner) {
  // The round runs under the mutex: once it is ours, no callback of owner's is running.
  const std::lock_guard<std::mutex> lock(mutex_);
  std::erase_if(entries_, [owner](const Entry& e) { return e.op.owner == owner; });
}

void CompletionWatch::fail(ErrorKind kind, const std::string& message) {
  const std::lock_guard<std::mutex> lock(mutex_);
  record(kind, message);
}

void CompletionWatch::raise_if_failed() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  if (failed_) throw Error(failure_kind_, failure_);
}

bool CompletionWatch::failed() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return failed_;
}

size_t CompletionWatch::pending() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return entries_.size();
}

void CompletionWatch::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    wake_.wait_for(lock, period_, [this] { return stopping_; });
    if (stopping_) return;
    poll_round(std::chrono::steady_clock::now());
  }
}

// With the mutex held. An operation that completed, or failed, leaves the watch; one that
// timed out stays until its abort has run (a busy communicator is tried again next round).
// An owner's operations complete in order (one stream): after its first that is not done, the
// younger ones wait for the next round, so a round costs the operations that completed since
// the last one plus one per owner, however many are in flight.
void CompletionWatch::poll_round(std::chrono::steady_clock::time_point now) {
  std::vector<const void*> waiting;  // owners with an operation not done this round
  std::erase_if(entries_, [&](Entry& e) {
    const void* owner = e.op.owner;
    if (owner != nullptr && std::find(waiting.begin(), waiting.end(), owner) != waiting.end())
      return false;
    const bool gone = settle(e, now);
    if (!gone && owner != nullptr) waiting.push_back(owner);
    return gone;
  });
}

// One entry's poll, timeout or abort; true when it leaves the watch.
bool CompletionWatch::settle(Entry& e, std::chrono::steady_clock::time_point now) {
  if (!e.expired) {
    try {
      if (e.op.poll() == Poll::kDone) return true;
    } catch (const Error& err) {
      record(err.kind(), err.what());
      return true;
    }
    if (std::chrono::duration<double>(now - e.started).count() <= timeout_s_) return false;
    e.expired = true;
    record(ErrorKind::kInternal,
           fmt::format("{} did not complete within {} s (SHARDLM_COMM_TIMEOUT_S): {}", e.op.what,
                       timeout_s_, timeout_hint_));
  }
  return e.op.abort();  // the communicator is aborted: its operations end
}

void CompletionWatch::record(ErrorKind kind, const std::string& message) {
  if (failed_) return;  // the first failure is the cause; later ones follow from it
  failed_ = true;
  failure_kind_ = kind;
  failure_ = message;
  if (report_) report_(message);
}

}  // namespace shardlm
