// The only file with build-flag conditionals for backends: maps a DeviceKind to its Backend.
#include "kernels/cpu/cpu_backend.h"
#if defined(SHARDLM_WITH_CUDA)
#include "kernels/cuda/cuda_backend.h"
#endif
#include "shardlm/backend/backend.h"
#include "shardlm/backend/queued.h"

namespace shardlm {

std::unique_ptr<Backend> make_backend(DeviceKind kind, int device_index, bool device_shared) {
  switch (kind) {
    case DeviceKind::kCpu:
      return std::make_unique<cpu::CpuBackend>();
    case DeviceKind::kCpuQueued:
      return std::make_unique<QueuedBackend>(std::make_unique<cpu::CpuBackend>());
    case DeviceKind::kCuda:
#if defined(SHARDLM_WITH_CUDA)
      return std::make_unique<cuda::CudaBackend>(device_index, device_shared);
#else
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "this shardlm was built without CUDA; rebuild with -DSHARDLM_CUDA=ON");
#endif
  }
  SHARDLM_FAIL(ErrorKind::kInternal, "unknown device kind");
}

int visible_devices(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kCpu:
    case DeviceKind::kCpuQueued:
      return 1;
    case DeviceKind::kCuda:
#if defined(SHARDLM_WITH_CUDA)
      return cuda::visible_devices();
#else
      return 0;
#endif
  }
  return 0;
}

}  // namespace shardlm
