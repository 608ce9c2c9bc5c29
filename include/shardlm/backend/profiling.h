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

 private:
  void run(OpFamily family, HostWaits waits, std::function<void()> op) override;
  uint64_t do_copy_async(const Tensor& src, const Tensor& dst) override;  // timed as elementwise

  std::array<double, kNumOpFamilies> seconds_{};
  std::array<int64_t, kNumOpFamilies> calls_{};
};

}  // namespace shardlm
