// The NCCL communicator's shared helpers (nccl_support.h).
#include "nccl_support.h"

#include <algorithm>
#include <cstdlib>
#include <thread>

namespace shardlm::nccl_detail {

void cuda_ok(cudaError_t e, std::string_view what) {
  if (e != cudaSuccess)
    SHARDLM_FAIL(ErrorKind::kInternal, "CUDA error in {}: {} ({})", what, cudaGetErrorString(e),
                 cudaGetErrorName(e));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::kF32:
      return ncclFloat32;
    case DType::kBF16:
      return ncclBfloat16;  // reduced pairwise, each result rounded to bf16 (communicator.h)
    case DType::kI32:
      return ncclInt32;
    case DType::kF64:
      return ncclFloat64;
    case DType::kI64:
      return ncclInt64;
    case DType::kU8:
      return ncclUint8;  // packed NF4 codes: moved, never reduced
  }
  SHARDLM_FAIL(ErrorKind::kInternal, "no NCCL type for {}", dtype_name(t));
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return ncclSum;
    case ReduceOp::kMax:
      return ncclMax;
    case ReduceOp::kMin:
      return ncclMin;
  }
  return ncclSum;
}

void backoff(double waited_s) {
  if (waited_s < 1e-3) {
    std::this_thread::yield();
    return;
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(std::min(waited_s / 32, 0.01)));
}

double since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

int64_t gpu_used_bytes() {
  size_t free_b = 0, total_b = 0;
  cuda_ok(cudaMemGetInfo(&free_b, &total_b), "cudaMemGetInfo");
  return int64_t(total_b - free_b);
}

void connect_at_creation() { ::setenv("NCCL_RUNTIME_CONNECT", "0", /*overwrite=*/0); }

[[noreturn]] void nccl_fail(ncclComm_t comm, ncclResult_t r, const std::string& what) {
  const char* detail = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  SHARDLM_FAIL(ErrorKind::kInternal, "{}: NCCL error: {}{}{}", what, ncclGetErrorString(r),
               detail && *detail ? ": " : "", detail ? detail : "");
}

void settle(ncclComm_t comm, ncclResult_t r, double timeout_s, const std::string& what,
            const std::function<void(const std::string&)>& abort_comm) {
  const auto fail = [&](const std::string& text) {
    if (comm != nullptr) abort_comm(text);
    SHARDLM_FAIL(ErrorKind::kInternal, "{}", text);
  };
  if (r != ncclSuccess && r != ncclInProgress)
    fail(fmt::format("{}: NCCL error: {}", what, ncclGetErrorString(r)));
  const auto start = Clock::now();
  for (;;) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t q = ncclCommGetAsyncError(comm, &state);
    if (q != ncclSuccess) state = q;
    if (state == ncclSuccess) return;
    if (state != ncclInProgress)
      fail(fmt::format("{}: NCCL error: {}", what, ncclGetErrorString(state)));
    const double waited = since(start);
    if (waited > timeout_s)
      fail(
          fmt::format("{} did not finish within {} s (SHARDLM_COMM_TIMEOUT_S): another rank never "
                      "joined it or failed; NCCL was aborted",
                      what, timeout_s));
    backoff(waited);
  }
}

}  // namespace shardlm::nccl_detail
