// The part of the NVML per-process memory figure that needs no GPU, so CPU tests check it:
// reading a device's list of compute processes through NVML's grow-and-retry protocol, and
// finding this process's bytes in it. nvml_process_memory.cpp calls these with the real NVML.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/cuda/nvml_abi.h"

namespace shardlm::cuda::nvml {

// Room added to the count NVML asked for: processes may start between two calls.
inline constexpr unsigned kSpareProcessSlots = 8;
inline constexpr int kListAttempts = 4;

// The compute processes of a device through `query` (nvmlDeviceGetComputeRunningProcesses_v3
// bound to the device: Return(unsigned* count, ProcessInfo* infos)). NVML answers
// kErrorInsufficientSize with the count it needs when the array is smaller; this asks with an
// empty array first, then with that count plus spare slots, at most kListAttempts times.
// Returns NVML's last answer; `out` holds the list on kSuccess and is empty otherwise.
template <class Query>
Return list_compute_processes(const Query& query, std::vector<ProcessInfo>& out) {
  out.clear();
  unsigned count = 0;
  Return r = query(&count, nullptr);
  for (int attempt = 0; r == kErrorInsufficientSize && attempt < kListAttempts; ++attempt) {
    out.assign(size_t(count) + kSpareProcessSlots, ProcessInfo{});
    count = unsigned(out.size());
    r = query(&count, out.data());
  }
  if (r == kSuccess && count <= out.size())
    out.resize(count);
  else
    out.clear();
  return r;
}

// This process's device memory in a device's list: the sum of its entries (one per MIG
// instance it runs on; one on a whole GPU). -1 when `pid` is not listed (a container with its
// own PID namespace: NVML lists the host's PIDs) or NVML cannot tell its figure.
inline int64_t process_device_bytes(std::span<const ProcessInfo> list, unsigned pid) {
  int64_t bytes = -1;
  for (const ProcessInfo& p : list) {
    if (p.pid != pid) continue;
    if (p.used_gpu_memory == kValueNotAvailable) return -1;
    bytes = (bytes < 0 ? 0 : bytes) + int64_t(p.used_gpu_memory);
  }
  return bytes;
}

}  // namespace shardlm::cuda::nvml
