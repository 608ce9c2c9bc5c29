// MpiRuntime: owns MPI's lifetime for this process (MPI_Init_thread in the constructor,
// MPI_Finalize when the runtime and every communicator made from it are gone) and makes world
// communicators. This header names no MPI type, so code outside src/comm/mpi can hold a runtime.
#pragma once

#include <memory>

#include "shardlm/comm/communicator.h"

namespace shardlm {

namespace mpi {
struct Session;
}

// MPI is initialised with MPI_THREAD_SERIALIZED: any thread may communicate, and every MPI call
// of shardlm is made under one lock owned by the runtime (never held across a wait: blocking ops
// poll nonblocking requests). Not THREAD_MULTIPLE: that makes Open MPI lock inside every call
// anyway, is not supported by every transport, and we have no thread that would need it.
class MpiRuntime {
 public:
  // Initialises MPI unless the host program already has (then it is borrowed and not
  // finalised). Throws Error when MPI cannot provide THREAD_SERIALIZED.
  MpiRuntime();
  ~MpiRuntime();
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  int world_rank() const;
  int world_size() const;
  // Rank among the processes on this node (MPI_Comm_split_type SHARED) and their count.
  int local_rank() const;
  int local_size() const;

  // A new communicator over every rank (a duplicate of MPI_COMM_WORLD), named "world".
  // Collective: every rank must call it.
  std::unique_ptr<Communicator> world(const CommOptions& options = CommOptions::from_env()) const;

 private:
  std::shared_ptr<mpi::Session> session_;
};

}  // namespace shardlm
