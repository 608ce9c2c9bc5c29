// GoogleTest main for tests/parallel, one process per rank under mpiexec: initialises MPI and
// runs the tests on every rank (rank_main.h).
#include <memory>

#include "parallel/mpi_test_env.h"
#include "parallel/rank_main.h"
#include "shardlm/comm/mpi_runtime.h"

namespace shardlm::test {

Communicator* g_world = nullptr;  // owned by main(); test harness only

Communicator& world() { return *g_world; }
std::string_view world_launch() { return "mpi"; }

}  // namespace shardlm::test

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  shardlm::MpiRuntime runtime;
  std::unique_ptr<shardlm::Communicator> world = runtime.world();
  shardlm::test::g_world = world.get();
  return shardlm::test::run_tests_on_every_rank(*world);
}
