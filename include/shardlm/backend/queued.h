// QueuedBackend: a Backend decorator that runs another backend's ops as a device queue does:
// each op is queued when it is called and runs only when the host must have the device caught
// up: an op whose result the host reads or that touches host memory (HostWaits::kYes),
// synchronize(), host_wait_fence() and every deallocation. Over the CPU backend it is
// train.device = "cpu-queued": the CPU's kernels in the CUDA backend's order of execution. An
// engine that keeps the Backend contract computes the same bits on it as on "cpu"; one that
// reads device memory on the host without a copy, or writes host memory a queued op still
// reads (a copy_async source before host_wait_fence), reads or writes at the wrong time and
// its results change. The CPU suite runs the several-ranks-on-one-GPU scenarios on it.
#pragma once

#include <array>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "shardlm/backend/forwarding.h"

namespace shardlm {

class QueuedBackend final : public ForwardingBackend {
 public:
  explicit QueuedBackend(std::unique_ptr<Backend> inner) : ForwardingBackend(std::move(inner)) {}
  ~QueuedBackend() override;

  std::string name() const override { return inner().name() + "-queued"; }
  void synchronize() override;
  // No stream a communicator could order itself after: device tensors cross ranks through
  // Backend::copy (parallel.device_comm = "host"), which waits.
  void* device_stream() override { return nullptr; }
  void deallocate(void* p, size_t bytes, MemPool pool) override;
  // One queue for copies and compute: a copy_async runs in order with the ops around it, so
  // a compute op never needs to wait for it on the queue.
  void wait_fence(uint64_t /*fence*/) override {}
  void host_wait_fence(uint64_t fence) override;

  // A mark is an op in the queue that reads the host clock when it runs.
  uint64_t mark() override;
  double seconds_between(uint64_t a, uint64_t b) override;

  // Ops called and not yet run (tests).
  int64_t queued();

 private:
  void run(OpFamily family, HostWaits waits, std::function<void()> op) override;
  uint64_t do_copy_async(const Tensor& src, const Tensor& dst) override;
  // Runs the queue in order; the caller holds run_mutex_. The first failing op's error is
  // thrown (the ops queued after it are dropped, as a device's are after a fault).
  void drain_locked();

  std::mutex queue_mutex_;  // guards queue_, fence_count_ and mark_count_
  std::deque<std::function<void()>> queue_;
  uint64_t fence_count_ = 0;
  uint64_t mark_count_ = 0;
  std::array<double, kMarksKept>
      mark_seconds_{};    // mark m's clock at mark_seconds_[m % kMarksKept]
  std::mutex run_mutex_;  // held while ops run: one op at a time, in queue order, any thread
  std::exception_ptr deferred_error_;  // a failure seen where nothing could throw it
};

}  // namespace shardlm
