// The world communicator factory of a build without MPI (SHARDLM_MPI=OFF, as `make dist` builds
// for bare GPU nodes): CMake compiles this file instead of world.cpp and src/comm/mpi/. A
// torchrun-style launch gets the TCP world, a plain run the local size-1 world; a process that
// an MPI launcher started is refused, naming the launch that works without MPI, rather than
// training alone while its peers wait.
#include "shardlm/comm/tcp.h"
#include "shardlm/comm/world.h"

namespace shardlm {

std::unique_ptr<Communicator> make_world_communicator(const CommOptions& options) {
  if (launched_under_mpi())
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "this shardlm was built without MPI (SHARDLM_MPI=OFF, as in the relocatable "
                 "dist) but an MPI launcher started it; start the ranks with `shardlm launch "
                 "--nproc N -- train ...` (one node) or with the torchrun-style variables RANK, "
                 "WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT on each process, or use a "
                 "build with MPI (make build)");
  return make_world_without_mpi(options);
}

}  // namespace shardlm
