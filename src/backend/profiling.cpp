// ProfilingBackend: times each forwarded op into its family's total.
#include "shardlm/backend/profiling.h"

#include <chrono>

namespace shardlm {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

void ProfilingBackend::run(OpFamily family, HostWaits /*waits*/, std::function<void()> op) {
  const auto t0 = Clock::now();
  op();
  inner().synchronize();  // a queued op's time is its execution, not its launch
  const int f = static_cast<int>(family);
  seconds_[f] += std::chrono::duration<double>(Clock::now() - t0).count();
  ++calls_[f];
}

uint64_t ProfilingBackend::do_copy_async(const Tensor& src, const Tensor& dst) {
  uint64_t fence = 0;
  run(OpFamily::kElementwise, HostWaits::kNo, [&] { fence = inner().copy_async(src, dst); });
  return fence;
}

}  // namespace shardlm
