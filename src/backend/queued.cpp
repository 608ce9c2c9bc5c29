// QueuedBackend: compute and copies queued on call, each run when a wait needs it.
#include "shardlm/backend/queued.h"

#include <chrono>
#include <limits>
#include <utility>

namespace shardlm {

QueuedBackend::~QueuedBackend() {
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  try {
    drain_all_locked();
  } catch (const std::exception&) {
    // The run is ending: its error (if any) was thrown to a caller already or is moot.
  }
}

uint64_t QueuedBackend::push(std::function<void()> op) {
  std::lock_guard<std::mutex> lock(queue_mutex_);
  compute_.push_back(std::move(op));
  return ++queued_count_;
}

void QueuedBackend::fail_queues() {
  std::lock_guard<std::mutex> lock(queue_mutex_);
  compute_.clear();
  copies_.clear();
  run_count_ = queued_count_;
}

void QueuedBackend::run_compute_until(uint64_t count) {
  if (deferred_error_) std::rethrow_exception(std::exchange(deferred_error_, nullptr));
  for (;;) {
    std::function<void()> op;
    {
      std::lock_guard<std::mutex> lock(queue_mutex_);
      if (run_count_ >= count || compute_.empty()) return;
      op = std::move(compute_.front());
      compute_.pop_front();
      ++run_count_;
    }
    try {
      op();  // a wait_fence point runs copies from here
    } catch (...) {
      fail_queues();
      throw;
    }
  }
}

void QueuedBackend::run_copies_until(uint64_t fence) {
  for (;;) {
    uint64_t first = 0, after = 0;
    {
      std::lock_guard<std::mutex> lock(queue_mutex_);
      if (copies_.empty() || copies_.front().fence > fence) return;
      first = copies_.front().fence;
      after = copies_.front().after;
    }
    run_compute_until(after);  // may run this copy itself, at a wait_fence point before it
    std::function<void()> copy;
    {
      std::lock_guard<std::mutex> lock(queue_mutex_);
      if (copies_.empty() || copies_.front().fence != first) continue;
      copy = std::move(copies_.front().run);
      copies_.pop_front();
    }
    try {
      copy();
    } catch (...) {
      fail_queues();
      throw;
    }
  }
}

void QueuedBackend::drain_all_locked() {
  uint64_t count = 0;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    count = queued_count_;
  }
  run_compute_until(count);
  run_copies_until(std::numeric_limits<uint64_t>::max());
}

void QueuedBackend::run(OpFamily /*family*/, HostWaits waits, std::function<void()> op) {
  if (waits == HostWaits::kNo) {
    push(std::move(op));
    return;
  }
  // This op and the compute queued before it (not ops other threads queue meanwhile, which a
  // stream runs after it); copies only as that compute's wait_fence points need them.
  ++host_waits_;
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  run_compute_until(push(std::move(op)));
}

uint64_t QueuedBackend::do_copy_async(const Tensor& src, const Tensor& dst) {
  std::lock_guard<std::mutex> lock(queue_mutex_);
  // Backend::copy on the inner backend copies when it runs; until the fence is waited for the
  // host must neither read a host dst nor write either buffer, and compute must not read dst.
  copies_.push_back({[this, src, dst] { inner().copy(src, dst); }, ++fence_count_, queued_count_});
  return fence_count_;
}

void QueuedBackend::check_issued(uint64_t fence, const char* op) {
  std::lock_guard<std::mutex> lock(queue_mutex_);
  SHARDLM_CHECK(fence <= fence_count_, "{}: fence {} was never issued (last {})", op, fence,
                fence_count_);
}

void QueuedBackend::wait_fence(uint64_t fence) {
  if (fence == 0) return;
  check_issued(fence, "wait_fence");
  push([this, fence] { run_copies_until(fence); });
}

void QueuedBackend::host_wait_fence(uint64_t fence) {
  if (fence == 0) return;
  check_issued(fence, "host_wait_fence");
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);  // a wait only if a copy up to it is queued
    if (!copies_.empty() && copies_.front().fence <= fence) ++host_waits_;
  }
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  run_copies_until(fence);
}

void QueuedBackend::synchronize() {
  ++host_waits_;
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  drain_all_locked();
}

void QueuedBackend::deallocate(void* p, size_t bytes, MemPool pool) {
  // A queued op may still use the memory: everything runs first (a device's free waits for
  // the whole device too). Deallocation runs in destructors, which must not throw: an op's
  // failure is kept for the next wait.
  ++host_waits_;
  {
    std::lock_guard<std::mutex> run_lock(run_mutex_);
    try {
      drain_all_locked();
    } catch (...) {
      deferred_error_ = std::current_exception();
    }
  }
  inner().deallocate(p, bytes, pool);
}

uint64_t QueuedBackend::mark() {
  uint64_t m = 0;
  {
    std::lock_guard<std::mutex> lock(queue_mutex_);
    m = ++mark_count_;
  }
  push([this, m] {
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
  return int64_t(compute_.size() + copies_.size());
}

}  // namespace shardlm
