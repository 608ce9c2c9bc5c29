// The only file with build-flag conditionals for backends: maps a DeviceKind to its Backend.
#include "kernels/cpu/cpu_backend.h"
#include "shardlm/backend/backend.h"

namespace shardlm {

std::unique_ptr<Backend> make_backend(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kCpu:
      return std::make_unique<cpu::CpuBackend>();
    case DeviceKind::kCuda:
#if defined(SHARDLM_WITH_CUDA)
      SHARDLM_FAIL(ErrorKind::kConfig, "the CUDA backend is not implemented yet");
#else
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "this shardlm was built without CUDA; rebuild with -DSHARDLM_CUDA=ON");
#endif
  }
  SHARDLM_FAIL(ErrorKind::kInternal, "unknown device kind");
}

}  // namespace shardlm
