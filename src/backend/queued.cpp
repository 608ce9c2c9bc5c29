// QueuedBackend: ops queued on call, run in order when the host waits.
#include "shardlm/backend/queued.h"

#include <chrono>
#include <utility>

namespace shardlm {

QueuedBackend::~QueuedBackend() {
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  try {
    drain_locked();
  } catch (const std::exception&) {
    // The run is ending: its error (if any) was thrown to a caller already or is moot.
  }
}

void QueuedBackend::drain_locked() {
  if (deferred_error_) std::rethrow_exception(std::exchange(deferred_error_, nullptr));
  for (;;) {
    std::function<void()> op;
    {
      std::lock_guard<std::mutex> lock(queue_mutex_);
      if (queue_.empty()) return;
      op = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      op();
    } catch (...) {
      std::lock_guard<std::mutex> lock(queue_mutex_);
      queue_.clear();
      throw;
    }
  }
}

void QueuedBackend::run(OpFamily /*family*/, HostWaits waits, std::function<void()> op) {
  if (waits == HostWaits::kNo) {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    queue_.push_back(std::move(op));
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  drain_locked();
  op();
}

uint64_t QueuedBackend::do_copy_async(const Tensor& src, const Tensor& dst) {
  std::lock_guard<std::mutex> lock(queue_mutex_);
  // Backend::copy on the inner backend finishes the copy when it runs; until then the host
  // must neither read a host dst nor write a host src (host_wait_fence).
  queue_.push_back([this, src, dst] { inner().copy(src, dst); });
  return ++fence_count_;
}

void QueuedBackend::synchronize() {
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  drain_locked();
}

void QueuedBackend::host_wait_fence(uint64_t fence) {
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    SHARDLM_CHECK(fence <= fence_count_, "host_wait_fence: fence {} was never issued (last {})",
                  fence, fence_count_);
  }
  synchronize();
}

void QueuedBackend::deallocate(void* p, size_t bytes, MemPool pool) {
  // A queued op may still use the memory: it runs first (a device's free waits for it too).
  // Deallocation runs in destructors, which must not throw: an op's failure is kept for the
  // next wait.
  {
    std::lock_guard<std::mutex> run_lock(run_mutex_);
    try {
      drain_locked();
    } catch (...) {
      deferred_error_ = std::current_exception();
    }
  }
  inner().deallocate(p, bytes, pool);
}

uint64_t QueuedBackend::mark() {
  std::lock_guard<std::mutex> lock(queue_mutex_);
  const uint64_t m = ++mark_count_;
  queue_.push_back([this, m] {
    mark_seconds_[m % kMarksKept] =
        std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  });
  return m;
}

double QueuedBackend::seconds_between(uint64_t a, uint64_t b) {
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    SHARDLM_CHECK(a >= 1 && a <= b && b <= mark_count_ && mark_count_ - a < kMarksKept,
                  "seconds_between: marks {} and {} are not both among the last {} (last {})", a, b,
                  kMarksKept, mark_count_);
  }
  synchronize();
  return mark_seconds_[b % kMarksKept] - mark_seconds_[a % kMarksKept];
}

int64_t QueuedBackend::queued() {
  std::lock_guard<std::mutex> lock(queue_mutex_);
  return int64_t(queue_.size());
}

}  // namespace shardlm
