// GoogleTest main for the communicator tests over TCP (no MPI): started as
// `test_x --nproc N [gtest flags]`, it launches N copies of itself with the torchrun-style
// variables (launch_local, as `shardlm launch` does); each copy connects the TCP world and runs
// the tests on its rank (rank_main.h).
#include <unistd.h>

#include <climits>
#include <cstdlib>
#include <memory>

#include "parallel/mpi_test_env.h"
#include "parallel/rank_main.h"
#include "shardlm/comm/launcher.h"
#include "shardlm/comm/tcp.h"

namespace shardlm::test {

Communicator* g_world = nullptr;  // owned by main(); test harness only

Communicator& world() { return *g_world; }
std::string_view world_launch() { return "tcp"; }

}  // namespace shardlm::test

int main(int argc, char** argv) {
  if (std::getenv("WORLD_SIZE") == nullptr) {
    if (argc < 3 || std::string(argv[1]) != "--nproc") {
      std::fprintf(stderr, "usage: %s --nproc N [gtest flags]\n", argv[0]);
      return 2;
    }
    char self[PATH_MAX] = {};
    const ssize_t n = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
    shardlm::LocalLaunch launch;
    launch.nproc = std::atoi(argv[2]);
    launch.command.push_back(n > 0 ? std::string(self, size_t(n)) : std::string(argv[0]));
    for (int i = 3; i < argc; ++i) launch.command.push_back(argv[i]);
    return shardlm::launch_local(launch);
  }
  ::testing::InitGoogleTest(&argc, argv);
  std::unique_ptr<shardlm::Communicator> world = shardlm::make_tcp_world(*shardlm::launch_env());
  shardlm::test::g_world = world.get();
  return shardlm::test::run_tests_on_every_rank(*world);
}
