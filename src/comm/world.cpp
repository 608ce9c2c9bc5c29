// The world communicator factory: MPI when a launcher started this process, else the TCP world
// of a torchrun-style launch, else local. Lives in the shardlm_comm_mpi target because it may
// start MPI; it names no MPI symbol itself.
#include "shardlm/comm/world.h"

#include "shardlm/comm/mpi_runtime.h"
#include "shardlm/comm/tcp.h"

namespace shardlm {

std::unique_ptr<Communicator> make_world_communicator(const CommOptions& options) {
  if (!launched_under_mpi()) return make_world_without_mpi(options);
  // The communicator shares MPI's session: MPI stays up until it and its splits are destroyed.
  const MpiRuntime runtime;
  return runtime.world(options);
}

}  // namespace shardlm
