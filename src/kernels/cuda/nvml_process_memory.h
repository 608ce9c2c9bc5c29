// NvmlProcessMemory: this process's device memory on one GPU as NVML counts it, for a GPU that
// other ranks of the run share (where cudaMemGetInfo's used bytes are theirs too). NVML is
// optional: libnvidia-ml.so.1 is opened with dlopen (never linked), and when it is missing,
// fails, or does not list this process (a container with its own PID namespace, where NVML
// lists host PIDs) the figure is unavailable, with the reason. No CUDA header.
#pragma once

#include <cstdint>
#include <string>

#include "kernels/cuda/nvml_abi.h"

namespace shardlm::cuda {

class NvmlProcessMemory {
 public:
  // Opens `library`, initialises NVML and finds the device at `pci_bus_id` (as
  // cudaDeviceGetPCIBusId writes it) for process `pid`; failures leave it unavailable.
  NvmlProcessMemory(const std::string& library, const std::string& pci_bus_id, unsigned pid);
  ~NvmlProcessMemory();  // nvmlShutdown, then dlclose
  NvmlProcessMemory(const NvmlProcessMemory&) = delete;
  NvmlProcessMemory& operator=(const NvmlProcessMemory&) = delete;

  // The process's usedGpuMemory on the device now; -1 when unavailable (unavailable() says
  // why, from then on).
  int64_t used_bytes();
  const std::string& unavailable() const { return unavailable_; }

 private:
  void fail(std::string reason, nvml::Return code);

  void* library_ = nullptr;
  bool initialised_ = false;
  nvml::Device device_ = nullptr;
  unsigned pid_ = 0;
  std::string where_;  // "libnvidia-ml.so.1, GPU <bus id>", for reasons
  nvml::ShutdownFn shutdown_ = nullptr;
  nvml::ErrorStringFn error_string_ = nullptr;
  nvml::ComputeProcessesFn compute_processes_ = nullptr;
  std::string unavailable_;  // empty while available
};

}  // namespace shardlm::cuda
