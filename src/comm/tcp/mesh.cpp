// connect_mesh: the TCP communicator's sockets. Each rank listens on a free port and sends
// {port, machine identity} through the rendezvous; rank i then connects to every rank j < i at
// the address rank 0 saw j connect from, and accepts the connections of the ranks above it.
// The machine identity (the kernel's boot id, else the host name) tells which ranks share a node.
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

#include "comm/tcp/transport.h"
#include "shardlm/core/check.h"

namespace shardlm::tcp {

namespace {

constexpr uint32_t kMeshMagic = 0x534c4d53;  // "SLMS"

struct MeshHello {
  uint32_t magic;
  int32_t rank;
  int32_t world_size;
  int32_t reserved;
};

std::string machine_identity() {
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  std::string id;
  if (in && std::getline(in, id) && !id.empty()) return id;
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  return host;
}

void accept_peers(const LaunchEnv& env, int listener, net::Clock::time_point deadline,
                  double timeout_s, Mesh& mesh) {
  for (int arrived = env.rank + 1; arrived < env.world_size;) {
    const double left = net::seconds_left(deadline);
    if (left <= 0) {
      std::string missing;
      for (int r = env.rank + 1; r < env.world_size; ++r)
        if (mesh.sockets[size_t(r)].fd < 0)
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      SHARDLM_FAIL(ErrorKind::kInternal,
                   "TCP communicator setup timed out: rank {} waited {} s for rank(s) {} to "
                   "connect (SHARDLM_COMM_TIMEOUT_S sets the wait)",
                   env.rank, timeout_s, missing);
    }
    pollfd pfd{listener, POLLIN, 0};
    if (::poll(&pfd, 1, int(std::min(left * 1000.0, 1000.0)) + 1) <= 0) continue;
    net::Fd conn(::accept(listener, nullptr, nullptr));
    if (conn.fd < 0) continue;
    MeshHello h{};
    int err = 0;
    if (!net::transfer(conn.fd, &h, sizeof(h), true, std::min(deadline, net::deadline_after(10)),
                       err) ||
        h.magic != kMeshMagic)
      continue;  // a stray connection
    SHARDLM_CHECK(h.world_size == env.world_size && h.rank > env.rank && h.rank < env.world_size &&
                      mesh.sockets[size_t(h.rank)].fd < 0,
                  "TCP communicator setup: rank {} got a connection claiming rank {} of {}",
                  env.rank, h.rank, h.world_size);
    const int one = 1;
    ::setsockopt(conn.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    mesh.sockets[size_t(h.rank)] = std::move(conn);
    ++arrived;
  }
}

}  // namespace

Mesh connect_mesh(const LaunchEnv& env, double timeout_s) {
  Mesh mesh;
  mesh.sockets.resize(size_t(env.world_size));
  mesh.nodes.assign(size_t(env.world_size), machine_identity());
  if (env.world_size == 1) return mesh;
  net::Fd listener = net::listen_any(0, std::max(16, env.world_size));
  SHARDLM_CHECK(listener.fd >= 0, "rank {}: cannot listen for the TCP communicator: {}", env.rank,
                std::strerror(errno));
  const uint16_t port = uint16_t(net::bound_port(listener.fd));
  const std::string node = mesh.nodes[0];
  std::vector<std::byte> mine(sizeof(port) + node.size());
  std::memcpy(mine.data(), &port, sizeof(port));
  std::memcpy(mine.data() + sizeof(port), node.data(), node.size());
  const std::vector<RankContact> table = tcp_gather_bytes(env, mine, timeout_s);

  const auto deadline = net::deadline_after(timeout_s);
  for (int r = 0; r < env.world_size; ++r) {
    const std::vector<std::byte>& b = table[size_t(r)].bytes;
    SHARDLM_CHECK(b.size() >= sizeof(uint16_t), "rank {}: rank {}'s mesh address is {} bytes",
                  env.rank, r, b.size());
    mesh.nodes[size_t(r)].assign(reinterpret_cast<const char*>(b.data()) + sizeof(uint16_t),
                                 b.size() - sizeof(uint16_t));
  }
  for (int r = 0; r < env.rank; ++r) {
    const std::vector<std::byte>& b = table[size_t(r)].bytes;
    uint16_t peer_port = 0;
    std::memcpy(&peer_port, b.data(), sizeof(peer_port));
    int last_err = 0;
    const std::string& address = table[size_t(r)].address;
    net::Fd conn = net::connect_retrying(address, peer_port, deadline, last_err,
                                         fmt::format("rank {}: rank {}'s address", env.rank, r));
    if (conn.fd < 0)
      SHARDLM_FAIL(ErrorKind::kInternal,
                   "TCP communicator setup: rank {} could not connect to rank {} at {}:{} within "
                   "{} s: {}",
                   env.rank, r, address, peer_port, timeout_s, net::why(last_err));
    const MeshHello hello{kMeshMagic, env.rank, env.world_size, 0};
    int err = 0;
    if (!net::transfer(conn.fd, const_cast<MeshHello*>(&hello), sizeof(hello), false, deadline,
                       err))
      SHARDLM_FAIL(ErrorKind::kInternal, "TCP communicator setup: rank {} lost rank {}: {}",
                   env.rank, r, net::why(err));
    mesh.sockets[size_t(r)] = std::move(conn);
  }
  accept_peers(env, listener.fd, deadline, timeout_s, mesh);
  return mesh;
}

}  // namespace shardlm::tcp
