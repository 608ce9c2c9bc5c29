// A stand-in for the driver's libnvidia-ml.so.1, built as a module for test_nvml_processes: the
// NVML entry points NvmlProcessMemory opens (nvml_abi.h), answering from what the test set through
// fake_nvml_set. One device, bus id "00000000:65:00.0"; its list holds `others` processes
// (pids from 0x7ff00000) and then `pid` with `bytes`, in NVML's grow-and-retry protocol.
#include "kernels/cuda/nvml_abi.h"

using namespace shardlm::cuda::nvml;

namespace {

struct FakeState {
  Return init_result = kSuccess;
  unsigned pid = 0;
  unsigned long long bytes = 0;
  unsigned others = 0;
  int initialised = 0;  // nvmlInit_v2 successes less nvmlShutdown calls
};

FakeState& state() {
  static FakeState s;
  return s;
}

DeviceHandle* const kDevice = reinterpret_cast<DeviceHandle*>(0x65);

}  // namespace

extern "C" {

void fake_nvml_set(Return init_result, unsigned pid, unsigned long long bytes, unsigned others) {
  FakeState& s = state();
  s.init_result = init_result;
  s.pid = pid;
  s.bytes = bytes;
  s.others = others;
}

int fake_nvml_initialised() { return state().initialised; }

Return nvmlInit_v2() {
  if (state().init_result == kSuccess) ++state().initialised;
  return state().init_result;
}

Return nvmlShutdown() {
  --state().initialised;
  return kSuccess;
}

const char* nvmlErrorString(Return r) { return r == 6 ? "Not Found" : "Unknown Error"; }

Return nvmlDeviceGetHandleByPciBusId_v2(const char* bus_id, Device* device) {
  const char* want = "00000000:65:00.0";
  for (int i = 0; want[i] != '\0' || bus_id[i] != '\0'; ++i)
    if (want[i] != bus_id[i]) return 6;  // NVML_ERROR_NOT_FOUND
  *device = kDevice;
  return kSuccess;
}

Return nvmlDeviceGetComputeRunningProcesses_v3(Device device, unsigned* count, ProcessInfo* infos) {
  if (device != kDevice) return 2;  // NVML_ERROR_INVALID_ARGUMENT
  const FakeState& s = state();
  const unsigned n = s.others + 1;
  if (*count < n) {
    *count = n;
    return kErrorInsufficientSize;
  }
  for (unsigned i = 0; i < s.others; ++i) infos[i] = {0x7ff00000u + i, 1ull << 20, ~0u, ~0u};
  infos[s.others] = {s.pid, s.bytes, ~0u, ~0u};
  *count = n;
  return kSuccess;
}

}  // extern "C"
