// The NCCL communicator (GPU collectives, one GPU per rank), made by its bootstrap. This header
// names no NCCL or CUDA type; the implementation lives in src/comm/nccl/ (target
// shardlm_comm_nccl, built with SHARDLM_CUDA=ON; without it the factory throws a config error).
#pragma once

#include <memory>

#include "shardlm/comm/communicator.h"

namespace shardlm {

// True when this build has the NCCL communicator.
bool nccl_built();

// The GPU a rank of the NCCL world drives: its local rank, when the node's local_size ranks
// (<= 0: unknown) each get one of its `devices` visible GPUs. NCCL refuses two ranks of a
// communicator on one GPU, so more ranks on a node than GPUs (local_size, or local_rank + 1
// when that is larger) is Error(kConfig) naming parallel.device_comm = "host", the way ranks
// share a GPU. Host-only (every build).
int nccl_device_for(int rank, int local_rank, int local_size, int devices);

// A communicator named "world" over every rank of this job, on the GPU number local_rank
// (nccl_device_for: more ranks on a node than visible GPUs is a config error, before any
// rank joins NCCL), which its local_rank() returns (the device to build the CUDA backend on).
// Collective: every rank calls it.
// - Under mpirun/srun, `host_world` (size > 1) gives rank, size and local rank, and rank 0's
//   NCCL unique id reaches the others through host_world->broadcast.
// - Otherwise (host_world null or of size 1) the torchrun-style variables (launch_env():
//   RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) do, and the id goes over the TCP
//   rendezvous (rendezvous.h).
// Tensors may be device memory (used in place) or host memory (staged through a device buffer
// the communicator keeps, and then the op completes before it returns). NCCL runs in nonblocking
// mode on the communicator's own stream; every wait is bounded by options.timeout_s, after which
// the communicator is aborted (ncclCommAbort) and the Error names this rank and the op.
std::unique_ptr<Communicator> make_nccl_world(Communicator* host_world,
                                              const CommOptions& options = CommOptions::from_env());

}  // namespace shardlm
