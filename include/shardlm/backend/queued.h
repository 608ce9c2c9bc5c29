// QueuedBackend: a Backend decorator that runs another backend's ops as a GPU's two streams do,
// as late as the Backend contract allows. Compute ops wait in one queue, in call order, and run
// only when the host must have them finished: an op whose result the host reads or that
// touches host memory (HostWaits::kYes: that op and the compute queued before it; no copies),
// synchronize() and every deallocation (everything). copy_async ops wait in a second queue,
// the copy stream: a copy runs after the compute queued before it, and only when a fence needs
// it: wait_fence(f) queues a point in the compute queue that runs copies up to f,
// host_wait_fence(f) runs them now. The host's waits are counted (host_waits()). Over the CPU
// backend it is train.device = "cpu-queued": the CPU's kernels in the order a GPU may run them. An
// engine that keeps the Backend contract computes the same bits on it as on "cpu"; one that reads
// device memory on the host without a copy, writes host memory a queued op still reads (a
// copy_async source before its fence), or reads a copy's destination without waiting for its fence
// reads or writes at the wrong time, and its results change. The CPU suite runs the
// several-ranks-on-one-GPU scenarios on it.
#pragma once

#include <array>
#include <atomic>
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
  void wait_fence(uint64_t fence) override;
  void host_wait_fence(uint64_t fence) override;
  // A mark is a compute op that reads the host clock when it runs.
  uint64_t mark() override;
  double seconds_between(uint64_t a, uint64_t b) override;

  // Ops called and not yet run, compute and copies (tests).
  int64_t queued();
  // The host's waits, counted as the CUDA backend counts them: each op whose result the host
  // reads or that touches host memory, each synchronize() and free, and each host_wait_fence
  // whose copies had not all run. The trainer logs a step's count (metrics `host_waits`).
  int64_t host_waits() const override { return host_waits_.load(); }

 private:
  struct Copy {
    std::function<void()> run;
    uint64_t fence;  // its fence
    uint64_t after;  // compute ops queued before it: they run first
  };

  void run(OpFamily family, HostWaits waits, std::function<void()> op) override;
  uint64_t do_copy_async(const Tensor& src, const Tensor& dst) override;
  // Fails naming `op` unless `fence` was issued.
  void check_issued(uint64_t fence, const char* op);
  // Queues a compute op; returns how many have been queued so far.
  uint64_t push(std::function<void()> op);
  // The caller holds run_mutex_. Runs compute ops until `count` have run, and copies up to
  // `fence` (with the compute they follow). The first failing op's error is thrown, and every
  // op still queued is dropped, as a device's are after a fault.
  void run_compute_until(uint64_t count);
  void run_copies_until(uint64_t fence);
  void drain_all_locked();
  void fail_queues();

  std::mutex queue_mutex_;  // guards the queues and the counters
  std::deque<std::function<void()>> compute_;
  std::deque<Copy> copies_;
  uint64_t queued_count_ = 0;  // compute ops ever queued
  uint64_t run_count_ = 0;     // compute ops run (or dropped)
  uint64_t fence_count_ = 0;
  uint64_t mark_count_ = 0;
  std::array<double, kMarksKept> mark_seconds_{};  // mark m's clock at [m % kMarksKept]
  std::mutex run_mutex_;  // held while ops run: one at a time, from whichever thread waits
  std::exception_ptr deferred_error_;   // a failure seen where nothing could throw it
  std::atomic<int64_t> host_waits_{0};  // host_waits(); copies also come from other threads
};

}  // namespace shardlm
