// Where memory lives. The "device" and "host" pools are kept apart even on the CPU backend,
// so that offload paths run (and are tested) without a GPU.
#pragma once

#include <cstdint>
#include <string_view>

namespace shardlm {

// kCpuQueued: the CPU's kernels queued as a device runs them (backend/queued.h), for tests.
enum class DeviceKind : uint8_t { kCpu, kCuda, kCpuQueued };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;
};

// A memory pool as the ledger counts it.
enum class MemPool : uint8_t { kDevice = 0, kHost = 1 };
inline constexpr int kNumMemPools = 2;

inline std::string_view mem_pool_name(MemPool p) {
  return p == MemPool::kDevice ? "device" : "host";
}

}  // namespace shardlm
