// The TCP communicator: every Communicator operation on host tensors over plain sockets, for
// launches without MPI (a torchrun-style launch, `shardlm launch`, a bare GPU node). The ranks
// of the launch form a full mesh of connections, set up through the rendezvous on
// MASTER_ADDR:MASTER_PORT; one progress thread per process moves the bytes, so a started
// operation advances while its caller computes. Splits share the mesh.
#pragma once

#include <memory>

#include "shardlm/comm/communicator.h"
#include "shardlm/comm/rendezvous.h"

namespace shardlm {

// Collective over the env.world_size processes of the launch: connects the mesh (every wait
// bounded by options.timeout_s) and returns the communicator over all of them, named "world",
// backend "tcp". Its local_rank() is env.local_rank.
//
// Reductions: each rank reduces one slice of the buffer over the ranks' contributions in rank
// order (f32, f64, i32, i64, u8; bf16 rounded after each pairwise combination, as
// communicator.h says) and the slices are then gathered, so every rank gets the same bits.
// Failures: an op that has not finished after options.timeout_s throws Error naming the ranks
// it still waits for, and a peer whose connection closes fails every op that needs it, naming
// it; either leaves the communicator unusable. A size mismatch fails only that receive.
// abort() shuts every connection (the peers' operations with this rank fail) and exits.
std::unique_ptr<Communicator> make_tcp_world(const LaunchEnv& env,
                                             const CommOptions& options = CommOptions::from_env());

// The world of a process that no MPI launcher started: the TCP world when the torchrun-style
// variables say WORLD_SIZE > 1 (`shardlm launch`, torchrun, a scheduler setting them), else a
// LocalCommunicator named "world".
std::unique_ptr<Communicator> make_world_without_mpi(const CommOptions& options);

}  // namespace shardlm
