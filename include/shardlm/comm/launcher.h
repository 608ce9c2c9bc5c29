// launch_local: several ranks of one command on this machine, started the way torchrun
// --standalone starts them (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT on each), so that no MPI launcher is needed. `shardlm launch` and the TCP
// communicator's tests use it.
#pragma once

#include <string>
#include <vector>

namespace shardlm {

struct LocalLaunch {
  int nproc = 1;
  // The argv of every rank; command[0] is a path, or a name looked up on PATH.
  std::vector<std::string> command;
  // Between SIGTERM and SIGKILL for the ranks still running after the first one fails (or
  // after the first SIGINT/SIGTERM passed on to them).
  double grace_s = 10;
};

// Forks nproc ranks (each in a process group of its own, so a terminal's Ctrl-C reaches them
// once, through this process) on a free port of 127.0.0.1, forwards SIGINT and SIGTERM to them
// (to each rank's process group) and waits. Returns 0 when every rank exits with 0; otherwise, once
// the first rank fails, the others get SIGTERM (SIGKILL after grace_s) and the first failure's exit
// code is returned (128 + the signal for a rank killed by one; of failures seen together, a
// rank killed by a signal counts as the first). OMP_NUM_THREADS, when unset,
// becomes the cores divided among the ranks. Only the ranks' pids are waited for; the caller's
// signal handlers are restored on return. Error(kConfig) for nproc < 1 or an empty command;
// Error(kInternal) when a fork fails (the ranks already started are killed first).
int launch_local(const LocalLaunch& launch);

}  // namespace shardlm
