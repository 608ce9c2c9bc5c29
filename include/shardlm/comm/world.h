// The world communicator of this process: MPI when the process was started by mpirun/mpiexec/
// srun, else the TCP communicator when the torchrun-style variables say WORLD_SIZE > 1 (`shardlm
// launch`), else the local size-1 communicator, so a plain `shardlm train` never initialises MPI.
// launched_under_mpi is in shardlm_comm; make_world_communicator in shardlm_comm_mpi (the one
// target allowed to reference MPI).
#pragma once

#include <memory>

#include "shardlm/comm/communicator.h"

namespace shardlm {

// True when a launcher's variables are set (OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_RANK).
bool launched_under_mpi();

// Under MPI: initialises MPI (see MpiRuntime) and returns a communicator over all ranks named
// "world"; MPI is finalised when it and every communicator split from it are destroyed.
// Otherwise make_world_without_mpi (tcp.h): the TCP world of a torchrun-style launch, or a
// LocalCommunicator named "world".
std::unique_ptr<Communicator> make_world_communicator(
    const CommOptions& options = CommOptions::from_env());

}  // namespace shardlm
