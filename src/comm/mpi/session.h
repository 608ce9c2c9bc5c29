// Session: the state MPI's lifetime hangs on, shared (shared_ptr) by the MpiRuntime and every
// communicator made from it, so MPI_Finalize runs only after the last of them is gone. Holds the
// lock that serialises shardlm's MPI calls (MPI_THREAD_SERIALIZED). Not a global: one per runtime.
#pragma once

#include <atomic>
#include <mutex>

namespace shardlm::mpi {

struct Session {
  // MPI_Init_thread(MPI_THREAD_SERIALIZED) unless MPI is already initialised (then borrowed).
  Session();
  // When owned: a timed barrier over all ranks, then MPI_Finalize. Skipped when poisoned
  // (finalising with requests abandoned after a timeout would hang) or when the barrier times
  // out: the process then exits without it and the launcher ends the job.
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
};

}  // namespace shardlm::mpi
