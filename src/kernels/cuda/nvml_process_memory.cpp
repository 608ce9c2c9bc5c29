// NvmlProcessMemory: NVML through dlopen (nvml_abi.h's entry points), the list logic of
// nvml_processes.h.
#include "kernels/cuda/nvml_process_memory.h"

#include <dlfcn.h>
#include <fmt/format.h>

#include <vector>

#include "kernels/cuda/nvml_processes.h"

namespace shardlm::cuda {

namespace {

template <class Fn>
Fn symbol(void* library, const char* name) {
  return reinterpret_cast<Fn>(dlsym(library, name));
}

}  // namespace

NvmlProcessMemory::NvmlProcessMemory(const std::string& library, const std::string& pci_bus_id,
                                     unsigned pid)
    : pid_(pid), where_(fmt::format("{}, GPU {}", library, pci_bus_id)) {
  library_ = dlopen(library.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library_ == nullptr) {
    const char* why = dlerror();
    unavailable_ = fmt::format("cannot open {} (NVML ships with the NVIDIA driver): {}", library,
                               why != nullptr ? why : "dlopen failed");
    return;
  }
  const auto init = symbol<nvml::InitFn>(library_, "nvmlInit_v2");
  const auto by_bus_id =
      symbol<nvml::HandleByPciBusIdFn>(library_, "nvmlDeviceGetHandleByPciBusId_v2");
  shutdown_ = symbol<nvml::ShutdownFn>(library_, "nvmlShutdown");
  error_string_ = symbol<nvml::ErrorStringFn>(library_, "nvmlErrorString");
  compute_processes_ =
      symbol<nvml::ComputeProcessesFn>(library_, "nvmlDeviceGetComputeRunningProcesses_v3");
  if (!init || !by_bus_id || !shutdown_ || !compute_processes_) {
    unavailable_ = fmt::format(
        "{} lacks nvmlInit_v2, nvmlDeviceGetHandleByPciBusId_v2, nvmlShutdown or "
        "nvmlDeviceGetComputeRunningProcesses_v3 (a driver older than 510)",
        library);
    return;
  }
  if (const nvml::Return r = init(); r != nvml::kSuccess) {
    fail("nvmlInit_v2", r);
    return;
  }
  initialised_ = true;
  if (const nvml::Return r = by_bus_id(pci_bus_id.c_str(), &device_); r != nvml::kSuccess)
    fail("nvmlDeviceGetHandleByPciBusId_v2", r);
}

NvmlProcessMemory::~NvmlProcessMemory() {
  if (initialised_) shutdown_();
  if (library_ != nullptr) dlclose(library_);
}

void NvmlProcessMemory::fail(std::string reason, nvml::Return code) {
  unavailable_ = fmt::format("{} failed ({}: {}; {})", reason, code,
                             error_string_ != nullptr ? error_string_(code) : "no message", where_);
}

int64_t NvmlProcessMemory::used_bytes() {
  if (!unavailable_.empty()) return -1;
  std::vector<nvml::ProcessInfo> list;
  const nvml::Return r = nvml::list_compute_processes(
      [&](unsigned* count, nvml::ProcessInfo* infos) {
        return compute_processes_(device_, count, infos);
      },
      list);
  if (r != nvml::kSuccess) {
    fail("nvmlDeviceGetComputeRunningProcesses_v3", r);
    return -1;
  }
  const int64_t bytes = nvml::process_device_bytes(list, pid_);
  if (bytes < 0)
    unavailable_ = fmt::format(
        "NVML lists {} compute processes on {} but not this one (pid {}) with a known figure: a "
        "container with its own PID namespace (NVML lists the host's), or no permission to "
        "read processes' memory",
        list.size(), where_, pid_);
  return bytes;
}

}  // namespace shardlm::cuda
