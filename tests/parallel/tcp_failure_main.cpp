// The TCP communicator's failures, for check_tcp_failure.sh: started as `tcp_failure MODE`, it
// launches 3 copies of itself (launch_local) in which rank 1 fails while the others wait in
// all_reduces: "throw" (rank 1 throws and calls abort_world), "sigkill" (rank 1 dies by SIGKILL
// mid-collective), "hang" (rank 1 never arrives), "exit" (rank 1 returns an error without
// abort_world) and "mismatch" (rank 1 waits in a recv instead). The ranks ignore the launcher's
// SIGTERM, so what ends them is the communicator's own detection (its errors name rank 1), not
// the launcher; the launcher's SIGKILL comes only 10 s after the first failure.
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "parallel/failure_modes.h"
#include "shardlm/comm/launcher.h"
#include "shardlm/comm/tcp.h"

namespace {

int run_rank(const std::string& mode) {
  std::signal(SIGTERM, SIG_IGN);
  const shardlm::LaunchEnv env = *shardlm::launch_env();
  std::vector<float> buf(1 << 20, 1.f);  // [1M]: large enough to be mid-transfer when killed
  const shardlm::Tensor t(buf.data(), shardlm::DType::kF32, {static_cast<int64_t>(buf.size())});
  {
    // Every rank is up, under the default timeout: on a loaded machine the ranks start seconds
    // apart, which the short timeout of the failure cases must not take for a failure.
    auto startup = shardlm::make_tcp_world(env, shardlm::CommOptions{});
    startup->all_reduce(t);
  }
  std::unique_ptr<shardlm::Communicator> world = shardlm::make_tcp_world(env);
  return shardlm::test::fail_on_rank_1(*world, mode, t);  // "exit": the world closes its sockets
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (!shardlm::test::is_failure_mode(mode)) {
    std::fprintf(stderr, "usage: tcp_failure throw|sigkill|hang|exit|mismatch\n");
    return 2;
  }
  if (std::getenv("WORLD_SIZE") != nullptr) return run_rank(mode);
  shardlm::LocalLaunch launch;
  launch.nproc = 3;
  launch.command = {"/proc/self/exe", mode};
  launch.grace_s = 10;  // a hung rank 1 only the launcher can end
  return shardlm::launch_local(launch);
}
