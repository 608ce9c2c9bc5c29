// The driver's count of a GPU run's device memory against its ledger, from memory_rank{R}.json
// (write_memory_report): shared by the one-GPU and several-ranks-on-one-GPU tests.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

namespace shardlm::test {

// The driver's count is at least the ledger's device total less one 2 MiB granule, and no more
// than the driver's rounding of each allocation (2 MiB granules) on top. The granule below: the
// driver places small allocations in 2 MiB pages it already maps, and pages this process mapped
// before the run (an earlier run's, cuDNN's graphs') can hold part of them (seen on an H100:
// 2 MiB read for a ledger of 3.4 MB).
inline void expect_driver_count_near_ledger(const nlohmann::json& m, const std::string& what) {
  ASSERT_TRUE(m.contains("driver_device_bytes")) << what << "\n" << m.dump(1);
  const int64_t driver = m["driver_device_bytes"].get<int64_t>();
  const int64_t ledger = m["ledger_device_bytes_now"].get<int64_t>();
  const int64_t allocs = m["device_allocations"].get<int64_t>();
  constexpr int64_t kGranule = int64_t(2) << 20;
  EXPECT_GE(driver, ledger - kGranule) << what << "\n" << m.dump(1);
  EXPECT_LE(driver, ledger + (allocs + 1) * kGranule) << what << "\n" << m.dump(1);
}

}  // namespace shardlm::test
