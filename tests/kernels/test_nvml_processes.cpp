// The host side of the CUDA backend's per-process memory figure on a shared GPU: NVML's
// grow-and-retry listing of a device's compute processes (against a stand-in for
// nvmlDeviceGetComputeRunningProcesses_v3 that answers as NVML documents), picking this process's
// bytes from the list, NvmlProcessMemory's dlopen of NVML (a missing library, and a stand-in
// libnvidia-ml built beside this test, fakes/fake_nvml.cpp), and which ranks of a node share a
// device.
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "kernels/cuda/nvml_process_memory.h"
#include "kernels/cuda/nvml_processes.h"
#include "shardlm/backend/backend.h"

namespace shardlm::cuda::nvml {
namespace {

// NVML's contract: with *count smaller than the list, kErrorInsufficientSize and *count set to
// the list's size; otherwise the entries, *count set to how many. `grow` processes start before
// every call after the first.
struct FakeDevice {
  std::vector<ProcessInfo> processes;
  unsigned grow = 0;
  int calls = 0;

  Return operator()(unsigned* count, ProcessInfo* infos) {
    if (calls++ > 0)
      for (unsigned i = 0; i < grow; ++i)
        processes.push_back({unsigned(1000 + processes.size()), 1 << 20, ~0u, ~0u});
    if (*count < processes.size()) {
      *count = unsigned(processes.size());
      return kErrorInsufficientSize;
    }
    for (size_t i = 0; i < processes.size(); ++i) infos[i] = processes[i];
    *count = unsigned(processes.size());
    return kSuccess;
  }
};

std::vector<ProcessInfo> three() {
  return {{11, 500ull << 20, ~0u, ~0u}, {42, 900ull << 20, ~0u, ~0u}, {7, 1ull << 30, ~0u, ~0u}};
}

TEST(NvmlProcesses, ListsInTwoCallsWhenNothingStartsBetween) {
  FakeDevice dev{three()};
  std::vector<ProcessInfo> list;
  EXPECT_EQ(list_compute_processes(std::ref(dev), list), kSuccess);
  EXPECT_EQ(dev.calls, 2);
  ASSERT_EQ(list.size(), 3u);
  EXPECT_EQ(list[1].pid, 42u);
  EXPECT_EQ(list[1].used_gpu_memory, 900ull << 20);
}

TEST(NvmlProcesses, AnEmptyDeviceAnswersTheFirstCall) {
  FakeDevice dev;
  std::vector<ProcessInfo> list(5);
  EXPECT_EQ(list_compute_processes(std::ref(dev), list), kSuccess);
  EXPECT_EQ(dev.calls, 1);
  EXPECT_TRUE(list.empty());
}

TEST(NvmlProcesses, SpareSlotsAbsorbProcessesStartingBetweenCalls) {
  FakeDevice dev{three(), kSpareProcessSlots};
  std::vector<ProcessInfo> list;
  EXPECT_EQ(list_compute_processes(std::ref(dev), list), kSuccess);
  EXPECT_EQ(dev.calls, 2);
  EXPECT_EQ(list.size(), 3u + kSpareProcessSlots);
}

TEST(NvmlProcesses, RetriesWithTheNewCountThenGivesUp) {
  // More start between calls than the spare slots hold: every attempt is short again.
  FakeDevice dev{three(), kSpareProcessSlots + 1};
  std::vector<ProcessInfo> list;
  EXPECT_EQ(list_compute_processes(std::ref(dev), list), kErrorInsufficientSize);
  EXPECT_EQ(dev.calls, 1 + kListAttempts);
  EXPECT_TRUE(list.empty());
  // One late starter too many for the spare slots, once: the second retry fits.
  struct OnceTooMany {
    FakeDevice dev;
    Return operator()(unsigned* count, ProcessInfo* infos) {
      dev.grow = dev.calls == 1 ? kSpareProcessSlots + 1 : 0;
      return dev(count, infos);
    }
  } once{FakeDevice{three()}};
  EXPECT_EQ(list_compute_processes(std::ref(once), list), kSuccess);
  EXPECT_EQ(once.dev.calls, 3);
  EXPECT_EQ(list.size(), 3u + kSpareProcessSlots + 1);
}

TEST(NvmlProcesses, AnotherErrorLeavesNoList) {
  std::vector<ProcessInfo> list(2);
  const auto not_supported = [](unsigned*, ProcessInfo*) { return Return(3); };
  EXPECT_EQ(list_compute_processes(not_supported, list), Return(3));
  EXPECT_TRUE(list.empty());
}

TEST(NvmlProcesses, PicksThisProcessesBytes) {
  const std::vector<ProcessInfo> list = three();
  EXPECT_EQ(process_device_bytes(list, 42), int64_t(900) << 20);
  EXPECT_EQ(process_device_bytes(list, 7), int64_t(1) << 30);
  // Not listed (a container's own PID namespace: NVML lists host PIDs).
  EXPECT_EQ(process_device_bytes(list, 43), -1);
  EXPECT_EQ(process_device_bytes({}, 42), -1);
}

TEST(NvmlProcesses, SumsAProcessesInstancesAndKnowsAnUnknownFigure) {
  // One entry per MIG instance the process runs on.
  const std::vector<ProcessInfo> mig = {{42, 100, 1, 0}, {11, 5, 1, 0}, {42, 200, 2, 0}};
  EXPECT_EQ(process_device_bytes(mig, 42), 300);
  // A listed process whose figure NVML cannot tell has none, not a partial sum or zero.
  const std::vector<ProcessInfo> hidden = {{42, 100, 1, 0}, {42, kValueNotAvailable, 2, 0}};
  EXPECT_EQ(process_device_bytes(hidden, 42), -1);
  // Zero bytes is a figure.
  const std::vector<ProcessInfo> idle = {{42, 0, ~0u, ~0u}};
  EXPECT_EQ(process_device_bytes(idle, 42), 0);
}

// The stand-in library: libfake_nvml.so beside this executable (the build and the dist put it
// there).
std::string fake_nvml_path() {
  return (std::filesystem::read_symlink("/proc/self/exe").parent_path() / "libfake_nvml.so")
      .string();
}

// The stand-in library's controls, through a handle of this test's own (dlopen returns the one
// NvmlProcessMemory opens, so both see the same state).
class FakeNvml : public ::testing::Test {
 protected:
  using SetFn = void (*)(Return, unsigned, unsigned long long, unsigned);
  using InitialisedFn = int (*)();

  void SetUp() override {
    lib_ = dlopen(library_.c_str(), RTLD_NOW | RTLD_LOCAL);
    ASSERT_NE(lib_, nullptr) << dlerror();
    set_ = reinterpret_cast<SetFn>(dlsym(lib_, "fake_nvml_set"));
    initialised_ = reinterpret_cast<InitialisedFn>(dlsym(lib_, "fake_nvml_initialised"));
    ASSERT_TRUE(set_ && initialised_);
  }
  void TearDown() override {
    if (lib_ != nullptr) dlclose(lib_);
  }

  static constexpr const char* kBusId = "00000000:65:00.0";
  const std::string library_ = fake_nvml_path();
  const unsigned pid_ = unsigned(getpid());
  void* lib_ = nullptr;
  SetFn set_ = nullptr;
  InitialisedFn initialised_ = nullptr;
};

TEST_F(FakeNvml, ReadsThisProcessesBytesAndShutsDown) {
  set_(kSuccess, pid_, 600ull << 20, kSpareProcessSlots + 3);  // more than the spare slots
  {
    cuda::NvmlProcessMemory nvml(library_, kBusId, pid_);
    EXPECT_EQ(initialised_(), 1);
    EXPECT_EQ(nvml.used_bytes(), int64_t(600) << 20) << nvml.unavailable();
    set_(kSuccess, pid_, 650ull << 20, 2);
    EXPECT_EQ(nvml.used_bytes(), int64_t(650) << 20);
    EXPECT_EQ(nvml.unavailable(), "");
  }
  EXPECT_EQ(initialised_(), 0);  // nvmlShutdown in the destructor
}

TEST_F(FakeNvml, AProcessItDoesNotListHasNoFigureFromThenOn) {
  set_(kSuccess, pid_ + 1, 600ull << 20, 2);  // another PID namespace: host PIDs
  cuda::NvmlProcessMemory nvml(library_, kBusId, pid_);
  EXPECT_EQ(nvml.used_bytes(), -1);
  EXPECT_NE(nvml.unavailable().find("not this one (pid " + std::to_string(pid_) + ")"),
            std::string::npos)
      << nvml.unavailable();
  set_(kSuccess, pid_, 600ull << 20, 2);
  EXPECT_EQ(nvml.used_bytes(), -1);  // no figure whose baseline was never read
}

TEST_F(FakeNvml, FailuresNameTheCallAndNvmlsMessage) {
  set_(kSuccess, pid_, 1, 0);
  {
    cuda::NvmlProcessMemory nvml(library_, "00000000:01:00.0", pid_);
    EXPECT_EQ(nvml.used_bytes(), -1);
    EXPECT_NE(nvml.unavailable().find("nvmlDeviceGetHandleByPciBusId_v2 failed (6: Not Found"),
              std::string::npos)
        << nvml.unavailable();
  }
  EXPECT_EQ(initialised_(), 0);
  set_(Return(9), pid_, 1, 0);  // NVML_ERROR_DRIVER_NOT_LOADED
  cuda::NvmlProcessMemory nvml(library_, kBusId, pid_);
  EXPECT_EQ(nvml.used_bytes(), -1);
  EXPECT_NE(nvml.unavailable().find("nvmlInit_v2 failed (9: Unknown Error"), std::string::npos)
      << nvml.unavailable();
  EXPECT_EQ(initialised_(), 0);  // never initialised: no nvmlShutdown either
}

TEST(NvmlProcessMemory, AMissingLibraryIsUnavailableWithTheReason) {
  cuda::NvmlProcessMemory nvml("libnvidia-ml-missing.so.1", "00000000:65:00.0", 1);
  EXPECT_EQ(nvml.used_bytes(), -1);
  EXPECT_NE(nvml.unavailable().find("cannot open libnvidia-ml-missing.so.1"), std::string::npos)
      << nvml.unavailable();
}

TEST(DeviceSharedByRanks, AnotherLocalRankOnTheSameDevice) {
  // Local rank r takes device r % devices.
  EXPECT_FALSE(device_shared_by_ranks(0, 1, 1));
  EXPECT_TRUE(device_shared_by_ranks(0, 2, 1));
  EXPECT_TRUE(device_shared_by_ranks(1, 2, 1));
  EXPECT_FALSE(device_shared_by_ranks(1, 2, 2));
  EXPECT_FALSE(device_shared_by_ranks(0, 8, 8));
  // 3 ranks on 2 GPUs: ranks 0 and 2 share GPU 0, rank 1 has GPU 1 alone.
  EXPECT_TRUE(device_shared_by_ranks(0, 3, 2));
  EXPECT_FALSE(device_shared_by_ranks(1, 3, 2));
  EXPECT_TRUE(device_shared_by_ranks(2, 3, 2));
  // 4 ranks on 2 GPUs: every GPU holds two.
  for (int r = 0; r < 4; ++r) EXPECT_TRUE(device_shared_by_ranks(r, 4, 2)) << r;
  EXPECT_FALSE(device_shared_by_ranks(0, 2, 0));  // no devices: nothing to share
}

}  // namespace
}  // namespace shardlm::cuda::nvml
