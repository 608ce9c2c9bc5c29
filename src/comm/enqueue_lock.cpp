// The device transports' process-wide enqueue lock and its order (enqueue_lock.h).
#include "comm/enqueue_lock.h"

#include "shardlm/core/check.h"

namespace shardlm {

EnqueueLock::Hold::~Hold() {
  if (lock_ == nullptr) return;
  lock_->owner_.store(std::thread::id{});
  lock_->mutex_.unlock();
}

EnqueueLock::Hold EnqueueLock::hold(double timeout_s, std::string_view what) {
  SHARDLM_CHECK(!held_here(),
                "{}: this thread already holds the process's enqueue lock (a nested hold would "
                "wait for itself)",
                what);
  const auto limit = std::chrono::duration<double>(timeout_s);
  if (!mutex_.try_lock_for(std::chrono::duration_cast<std::chrono::steady_clock::duration>(limit)))
    SHARDLM_FAIL(ErrorKind::kInternal,
                 "{}: another thread of this rank held the lock on its NCCL enqueues for more "
                 "than {} s (SHARDLM_COMM_TIMEOUT_S): an enqueue never returned",
                 what, timeout_s);
  owner_.store(std::this_thread::get_id());
  return Hold(this);
}

std::unique_lock<std::timed_mutex> EnqueueLock::comm_lock(std::timed_mutex& comm_mutex,
                                                          std::string_view what) const {
  SHARDLM_CHECK(!held_here(),
                "{}: a communicator's lock taken while holding the enqueue lock (the order is "
                "the communicator's first)",
                what);
  return std::unique_lock<std::timed_mutex>(comm_mutex);
}

bool EnqueueLock::held_here() const { return owner_.load() == std::this_thread::get_id(); }

}  // namespace shardlm
