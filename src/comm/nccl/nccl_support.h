// What the NCCL communicator and its bootstrap share, private to src/comm/nccl: CUDA and NCCL
// error checks, the type and op maps, the wait for a nonblocking NCCL call, and the driver's
// measure of what NCCL allocates.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "shardlm/comm/communicator.h"

namespace shardlm::nccl_detail {

using Clock = std::chrono::steady_clock;

// Host tensors pass through this much device memory per communicator, allocated with it.
inline constexpr size_t kHostStagingBytes = size_t(1) << 20;

void cuda_ok(cudaError_t e, std::string_view what);
ncclDataType_t nccl_type(DType t);
ncclRedOp_t nccl_op(ReduceOp op);

// Yields for the first millisecond, then sleeps 1/32 of the time waited (at most 10 ms): a
// quick op costs no sleep, a long wait costs little CPU.
void backoff(double waited_s);
double since(Clock::time_point t);

// Bytes in use on the current GPU, every allocation of every process: the difference across a
// communicator's creation is what NCCL took for it (one rank per GPU: NCCL refuses two).
int64_t gpu_used_bytes();

// NCCL connects a communicator's peers at their first collective unless told otherwise, so
// its buffers would appear in the middle of a step: the collectives' connections are made at
// creation instead, where the driver measures them (an environment's own NCCL_RUNTIME_CONNECT
// is kept). Point-to-point pairs are not among them (connect_peers). Read by NCCL when the
// first communicator is made.
void connect_at_creation();

[[noreturn]] void nccl_fail(ncclComm_t comm, ncclResult_t r, const std::string& what);

// Nonblocking NCCL: a call may return ncclInProgress and finish in the background. Polls the
// communicator's state until the call has finished; a failure, or no end within timeout_s,
// aborts the communicator (abort_comm, given the failure's text first, so that it can record it
// before anything is aborted) and throws that text.
void settle(ncclComm_t comm, ncclResult_t r, double timeout_s, const std::string& what,
            const std::function<void(const std::string&)>& abort_comm);

}  // namespace shardlm::nccl_detail
