// The failure detector for operations completed on the device (completion_watch.h).
#include "comm/completion_watch.h"

#include <algorithm>
#include <utility>

namespace shardlm {

CompletionWatch::CompletionWatch(double timeout_s, std::string timeout_hint,
                                 std::function<void(const Error&)> on_failure,
                                 std::chrono::milliseconds period)
    : timeout_s_(timeout_s),
      timeout_hint_(std::move(timeout_hint)),
      on_failure_(std::move(on_failure)),
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
  // The polls run under the mutex: once it is ours, no callback of owner's is running.
  const std::lock_guard<std::mutex> lock(mutex_);
  std::erase_if(entries_, [owner](Entry& e) {
    if (e.op.owner != owner) return false;
    if (!e.op.orphan_poll) return true;
    e.op.poll = std::move(e.op.orphan_poll);
    e.op.orphan_poll = nullptr;
    e.op.owner = nullptr;
    return false;
  });
}

void CompletionWatch::fail(ErrorKind kind, const std::string& message) { record(kind, message); }

void CompletionWatch::raise_if_failed() const {
  // failure_ is written before failed_ is set and never after.
  if (failed_.load()) throw Error(failure_kind_, failure_);
}

size_t CompletionWatch::pending() const {
  const std::lock_guard<std::mutex> lock(mutex_);
  return entries_.size();
}

void CompletionWatch::record(ErrorKind kind, const std::string& message) {
  const std::lock_guard<std::mutex> lock(failure_mutex_);
  if (failed_.load()) return;  // the first failure is the cause; later ones follow from it
  failure_kind_ = kind;
  failure_ = message;
  failed_.store(true);
}

void CompletionWatch::loop() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stopping_) {
    wake_.wait_for(lock, period_, [this] { return stopping_; });
    if (stopping_) return;
    poll_round(std::chrono::steady_clock::now());
    if (!watch_failed_ || !on_failure_) continue;
    lock.unlock();  // on_failure may end the process, or take as long as it likes
    const std::function<void(const Error&)> report = on_failure_;
    report(Error(failure_kind_, failure_));
    return;  // once: what follows a failure is not watched
  }
}

// With the mutex held. An operation that completed, failed or timed out leaves the watch.
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

// One entry's poll and timeout; true when it leaves the watch.
bool CompletionWatch::settle(Entry& e, std::chrono::steady_clock::time_point now) {
  try {
    if (e.op.poll() == Poll::kDone) return true;
  } catch (const Error& err) {
    record(err.kind(), err.what());
    watch_failed_ = true;
    return true;
  }
  if (std::chrono::duration<double>(now - e.started).count() <= timeout_s_) return false;
  record(ErrorKind::kInternal,
         fmt::format("{} did not complete within {} s (SHARDLM_COMM_TIMEOUT_S): {}", e.op.what,
                     timeout_s_, timeout_hint_));
  watch_failed_ = true;
  return true;
}

}  // namespace shardlm
