// Session: the state MPI's lifetime hangs on, shared (shared_ptr) by the MpiRuntime and every
// communicator made from it, so MPI_Finalize runs only after the last of them is gone. Holds the
// lock that serialises shardlm's MPI calls (MPI_THREAD_SERIALIZED) and the process's bf16
// reduction ops (MPI handles, valid only between MPI_Init and MPI_Finalize). Not a global: one
// per runtime.
#pragma once

#include <atomic>
#include <mutex>

#include "comm/mpi/bf16_ops.h"

namespace shardlm::mpi {

struct Session {
  // MPI_Init_thread(MPI_THREAD_SERIALIZED) unless MPI is already initialised (then borrowed);
  // then creates bf16_ops.
  Session();
  // Frees bf16_ops (unless a borrowed MPI was finalised already). When owned: a timed barrier
  // over all ranks, then MPI_Finalize. Skipped when poisoned (finalising with requests abandoned
  // after a timeout would hang) or when the barrier times out: the process then exits without
  // it and the launcher ends the job.
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  std::mutex mutex;  // held around every MPI call made by shardlm
  bool owns_mpi = false;
  std::atomic<bool> poisoned{false};  // a request was abandoned after a timeout
  int world_rank = 0;
  int world_size = 1;
  int local_rank = 0;  // among the ranks on this node (MPI_Comm_split_type SHARED)
  int local_size = 1;
  Bf16Ops bf16_ops;  // the MPI_Ops of bf16 reductions, one per ReduceOp
};

}  // namespace shardlm::mpi
