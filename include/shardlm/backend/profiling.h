// ProfilingBackend: a Backend decorator that forwards every op to another backend and adds
// its time to a per-op-family total. Used by `log.profile` and the benchmarks to split a
// step's time by op family. It synchronises the inner backend after each op, so that a queued
// op's time is its execution: never in a timed run.
#pragma once

#include <array>
#include <memory>
#include <string>

#include "shardlm/backend/forwarding.h"

namespace shardlm {

class ProfilingBackend final : public ForwardingBackend {
 public:
  explicit ProfilingBackend(std::unique_ptr<Backend> inner) : ForwardingBackend(std::move(inner)) {}

  // Seconds and call counts per family since construction or reset().
  const std::array<double, kNumOpFamilies>& seconds() const { return seconds_; }
  const std::array<int64_t, kNumOpFamilies>& calls() const { return calls_; }
  void reset() {
    seconds_.fill(0);
    calls_.fill(0);
  }

  std::string name() const override { return inner().name() + "+profile"; }
  void synchronize() override { inner().synchronize(); }
  void* device_stream() override { return inner().device_stream(); }
  void deallocate(void* p, size_t bytes, MemPool pool) override {
    inner().deallocate(p, bytes, pool);
  }
  void wait_fence(uint64_t fence) override { inner().wait_fence(fence); }
  void host_wait_fence(uint64_t fence) override { inner().host_wait_fence(fence); }
  uint64_t mark() override { return inner().mark(); }
  double seconds_between(uint64_t a, uint64_t b) override { return inner().seconds_between(a, b); }

 private:
  void run(OpFamily family, HostWaits waits, std::function<void()> op) override;
  uint64_t do_copy_async(const Tensor& src, const Tensor& dst) override;  // timed as elementwise

  std::array<double, kNumOpFamilies> seconds_{};
  std::array<int64_t, kNumOpFamilies> calls_{};
};

}  // namespace shardlm
