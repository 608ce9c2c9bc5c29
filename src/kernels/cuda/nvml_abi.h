// The few entry points and types of NVML (the NVIDIA Management Library) the CUDA backend uses
// for a process's own device memory, declared here from NVML's stable C ABI: the build needs no
// NVML header or library (libnvidia-ml.so.1 ships with the driver and is opened at run time,
// nvml_process_memory.cpp). Versioned NVML symbols (the _v2 and _v3 suffixes) keep their
// signatures and struct layouts for good; the names here are ours, NVML's in the comments. No
// CUDA header: CPU tests include it for the logic in nvml_processes.h.
#pragma once

#include <cstdint>

namespace shardlm::cuda::nvml {

using Return = int;                                  // nvmlReturn_t (a C enum)
inline constexpr Return kSuccess = 0;                // NVML_SUCCESS
inline constexpr Return kErrorInsufficientSize = 7;  // NVML_ERROR_INSUFFICIENT_SIZE

struct DeviceHandle;           // struct nvmlDevice_st
using Device = DeviceHandle*;  // nvmlDevice_t

// nvmlProcessInfo_t as nvmlDeviceGetComputeRunningProcesses_v3 fills it (nvmlProcessInfo_v2_t).
struct ProcessInfo {
  unsigned int pid = 0;
  unsigned long long used_gpu_memory = 0;  // usedGpuMemory, bytes
  unsigned int gpu_instance_id = 0;        // MIG instance; ~0u without MIG
  unsigned int compute_instance_id = 0;
};
static_assert(sizeof(ProcessInfo) == 24, "nvmlProcessInfo_t is 24 bytes");

// usedGpuMemory when NVML cannot tell (NVML_VALUE_NOT_AVAILABLE).
inline constexpr unsigned long long kValueNotAvailable = ~0ull;

// The entry points, as NVML names them (function types with C linkage).
extern "C" {
// nvmlInit_v2
using InitFn = Return (*)();
// nvmlShutdown
using ShutdownFn = Return (*)();
// nvmlErrorString
using ErrorStringFn = const char* (*)(Return);
// nvmlDeviceGetHandleByPciBusId_v2
using HandleByPciBusIdFn = Return (*)(const char* bus_id, Device* device);
// nvmlDeviceGetComputeRunningProcesses_v3
using ComputeProcessesFn = Return (*)(Device device, unsigned int* count, ProcessInfo* infos);
}

}  // namespace shardlm::cuda::nvml
