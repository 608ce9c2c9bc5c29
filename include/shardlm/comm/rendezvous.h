// The torchrun-style launch (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) and a small
// TCP rendezvous over it: rank 0 listens on MASTER_PORT, every other rank connects (retrying
// until rank 0 is up) with its bytes and receives every rank's from it. This is how the NCCL
// communicator shares its unique id, and the TCP communicator its ranks' listening ports, when
// no MPI launcher started the job. Plain POSIX sockets: no MPI, no
// CUDA, so it builds and is tested everywhere.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace shardlm {

struct LaunchEnv {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr;  // host name or address of rank 0
  int master_port = 0;      // [1, 65535]
};

// Reads the variables through `get` (std::getenv by default). nullopt when WORLD_SIZE is unset
// (not a torchrun-style launch). Otherwise every variable must be valid: a missing or malformed
// one is Error(kConfig) naming it. LOCAL_RANK falls back to the launcher's own local-rank
// variable (OMPI_COMM_WORLD_LOCAL_RANK, SLURM_LOCALID, MPI_LOCALRANKID), then to 0 when
// WORLD_SIZE is 1; MASTER_ADDR and MASTER_PORT are required only when WORLD_SIZE > 1.
using EnvGetter = std::function<const char*(const char*)>;
std::optional<LaunchEnv> launch_env_from(const EnvGetter& get);
std::optional<LaunchEnv> launch_env();  // from this process's environment

struct RankContact {
  std::string address;  // rank 0: MASTER_ADDR; others: the address rank 0 saw them connect from
  std::vector<std::byte> bytes;
};

// Collective over the env.world_size processes of the launch: every rank passes its bytes (at
// most 1 MiB) and gets every rank's, in rank order, with the address each connected from.
// Waits and errors as tcp_broadcast_bytes.
std::vector<RankContact> tcp_gather_bytes(const LaunchEnv& env, const std::vector<std::byte>& mine,
                                          double timeout_s);

// Collective over the env.world_size processes of the launch: rank 0 passes `payload` and every
// rank returns it (rank 0 included). Rank 0 waits up to timeout_s for every other rank to
// connect; the others retry connecting for up to timeout_s, then wait as long again for the
// bytes. Errors (Error kind internal, or config for a port rank 0 cannot listen on) name this
// rank, the address, and which ranks never arrived. `payload` is ignored on ranks other than 0.
std::vector<std::byte> tcp_broadcast_bytes(const LaunchEnv& env,
                                           const std::vector<std::byte>& payload, double timeout_s);

}  // namespace shardlm
