// A job in which rank 1 fails while the other ranks wait in all_reduces, for
// check_comm_failure.sh: "throw" (rank 1 throws and calls abort_world), "sigkill" (rank 1 dies by
// SIGKILL mid-collective), "hang" (rank 1 never arrives), "exit" (rank 1 returns an error
// without abort_world) and "mismatch" (rank 1 waits in a recv instead): in the last three the
// others' timeout names rank 1. The job must always end non-zero, well before anyone would
// notice a hang.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "shardlm/comm/mpi_runtime.h"

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode != "throw" && mode != "sigkill" && mode != "hang" && mode != "exit" &&
      mode != "mismatch") {
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
  world->barrier();  // every rank holds the communicator the failure is judged on

  try {
    if (world->rank() == 1) {
      if (mode == "exit") return 3;  // no abort_world: MPI_Finalize waits for the others
      if (mode == "throw") throw std::runtime_error("injected failure on rank 1");
      if (mode == "sigkill") {
        auto in_flight = world->all_reduce_async(t);
        in_flight->test();
        std::raise(SIGKILL);
      }
      if (mode == "hang") std::this_thread::sleep_for(std::chrono::seconds(120));
      if (mode == "mismatch") {
        float one = 0;
        world->recv(shardlm::Tensor(&one, shardlm::DType::kF32, {1}), 0, 9);  // never sent
      }
    }
    // Enough collectives that a rank which died after sending its part of one still leaves the
    // others waiting in a later one.
    for (int i = 0; i < 1000; ++i) world->all_reduce(t);
  } catch (const std::exception& e) {
    shardlm::abort_world(*world, e.what(), 3);
  }
  std::printf("rank %d: the all_reduces completed, which they must not\n", world->rank());
  return 0;
}
