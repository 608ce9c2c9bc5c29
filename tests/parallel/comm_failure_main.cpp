// A job in which rank 1 fails while the other ranks wait in all_reduces, for
// check_comm_failure.sh: "throw" (rank 1 throws and calls abort_world), "sigkill" (rank 1 dies by
// SIGKILL mid-collective), "hang" (rank 1 never arrives), "exit" (rank 1 returns an error
// without abort_world) and "mismatch" (rank 1 waits in a recv instead): in the last three the
// others' timeout names rank 1. The job must always end non-zero, well before anyone would
// notice a hang.
#include <cstdio>
#include <string>
#include <vector>

#include "parallel/failure_modes.h"
#include "shardlm/comm/mpi_runtime.h"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (!shardlm::test::is_failure_mode(mode)) {
    std::fprintf(stderr, "usage: comm_failure throw|sigkill|hang|exit|mismatch\n");
    return 2;
  }
  shardlm::MpiRuntime runtime;
  std::vector<float> buf(1 << 20, 1.f);  // [1M]: large enough to be mid-transfer when killed
  const shardlm::Tensor t(buf.data(), shardlm::DType::kF32, {static_cast<int64_t>(buf.size())});
  {
    // Every rank is up, under the default timeout: on a loaded machine the ranks start seconds
    // apart, which the short timeout of the failure cases (SHARDLM_COMM_TIMEOUT_S) must not
    // take for a failure.
    std::unique_ptr<shardlm::Communicator> startup = runtime.world(shardlm::CommOptions{});
    startup->all_reduce(t);
  }
  std::unique_ptr<shardlm::Communicator> world = runtime.world();
  // "exit" returns without abort_world: MPI_Finalize (runtime's destructor) waits for the others.
  return shardlm::test::fail_on_rank_1(*world, mode, t);
}
