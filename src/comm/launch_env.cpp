// launched_under_mpi: reads the launcher's environment variables, nothing else, so that code
// without MPI (and its tests) can ask whether a launcher started this process.
#include <cstdlib>

#include "shardlm/comm/world.h"

namespace shardlm {

bool launched_under_mpi() {
  // Open MPI's mpirun, PMI-1/2 launchers (MPICH hydra, srun --mpi=pmi2), PMIx (srun, prterun).
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"}) {
    if (std::getenv(var) != nullptr) return true;
  }
  return false;
}

}  // namespace shardlm
