// The torchrun-style launch variables and the TCP rendezvous that gathers every rank's bytes
// (the NCCL unique id, the TCP communicator's listening ports). Protocol: each rank r > 0
// connects to MASTER_ADDR:MASTER_PORT and sends a hello {magic, r, world_size, length} and its
// bytes; once all have arrived rank 0 answers each with {magic, length} and the table of every
// rank's address and bytes, then closes. Every wait is bounded by the timeout.
#include "shardlm/comm/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "comm/socket_io.h"
#include "shardlm/core/check.h"

namespace shardlm {

namespace {

constexpr uint32_t kMagic = 0x534c5256;  // "SLRV"
using net::deadline_after;
using net::Fd;
using net::seconds_left;
using net::transfer;
using net::why;

// A non-negative integer variable; nullopt when unset or empty.
std::optional<long> int_var(const EnvGetter& get, const char* name, long lo, long hi) {
  const char* text = get(name);
  if (text == nullptr || *text == '\0') return std::nullopt;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text, &end, 10);
  if (errno != 0 || end == text || *end != '\0' || v < lo || v > hi)
    SHARDLM_FAIL(ErrorKind::kConfig, "{}='{}' is not an integer in [{}, {}]", name, text, lo, hi);
  return v;
}

std::string where(const LaunchEnv& env) {
  return fmt::format("MASTER_ADDR:MASTER_PORT = {}:{}", env.master_addr, env.master_port);
}

// "1, 3, 4" (the first 16, then how many more).
std::string rank_list(const std::vector<int>& ranks) {
  std::string s;
  for (size_t i = 0; i < ranks.size() && i < 16; ++i)
    s += (i ? ", " : "") + std::to_string(ranks[i]);
  if (ranks.size() > 16) s += fmt::format(" and {} more", ranks.size() - 16);
  return s;
}

struct Hello {
  uint32_t magic;
  int32_t rank;
  int32_t world_size;
  int32_t reserved;
  uint64_t length;  // of the payload that follows
};

struct Header {
  uint32_t magic;
  uint32_t reserved;
  uint64_t length;
};

constexpr uint64_t kMaxPayload = uint64_t(1) << 20;

// The reply table: per rank, u32 address length, address, u64 payload length, payload.
std::vector<std::byte> encode(const std::vector<RankContact>& table) {
  std::vector<std::byte> out;
  auto put = [&out](const void* p, size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    out.insert(out.end(), b, b + n);
  };
  for (const RankContact& c : table) {
    const auto alen = uint32_t(c.address.size());
    const auto plen = uint64_t(c.bytes.size());
    put(&alen, sizeof(alen));
    put(c.address.data(), alen);
    put(&plen, sizeof(plen));
    put(c.bytes.data(), c.bytes.size());
  }
  return out;
}

std::vector<RankContact> decode(const std::vector<std::byte>& in, int world_size) {
  std::vector<RankContact> table(static_cast<size_t>(world_size));
  size_t at = 0;
  auto get = [&](void* p, size_t n) {
    SHARDLM_CHECK(at + n <= in.size(), "TCP rendezvous: truncated reply ({} bytes)", in.size());
    std::memcpy(p, in.data() + at, n);
    at += n;
  };
  for (RankContact& c : table) {
    uint32_t alen = 0;
    uint64_t plen = 0;
    get(&alen, sizeof(alen));
    c.address.resize(alen);
    get(c.address.data(), alen);
    get(&plen, sizeof(plen));
    c.bytes.resize(plen);
    get(c.bytes.data(), plen);
  }
  return table;
}

std::vector<RankContact> serve(const LaunchEnv& env, const std::vector<std::byte>& mine,
                               double timeout_s) {
  Fd listener = net::listen_any(env.master_port, std::max(16, env.world_size));
  if (listener.fd < 0)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "rank 0 cannot listen on MASTER_PORT={} for the rendezvous: {}; choose a free "
                 "port",
                 env.master_port, std::strerror(errno));

  const auto deadline = deadline_after(timeout_s);
  std::vector<Fd> peers(size_t(env.world_size));
  std::vector<RankContact> table(size_t(env.world_size));
  table[0] = {env.master_addr, mine};
  int arrived = 1;
  while (arrived < env.world_size) {
    const double left = seconds_left(deadline);
    if (left <= 0) {
      std::vector<int> missing;
      for (int r = 1; r < env.world_size; ++r)
        if (peers[size_t(r)].fd < 0) missing.push_back(r);
      SHARDLM_FAIL(ErrorKind::kInternal,
                   "TCP rendezvous timed out: rank 0 waited {} s on port {} and rank{} {} never "
                   "connected (is every rank started with the same MASTER_ADDR, MASTER_PORT and "
                   "WORLD_SIZE={}? SHARDLM_COMM_TIMEOUT_S sets the wait)",
                   timeout_s, env.master_port, missing.size() == 1 ? "" : "s", rank_list(missing),
                   env.world_size);
    }
    pollfd pfd{listener.fd, POLLIN, 0};
    const int ready = ::poll(&pfd, 1, int(std::min(left * 1000.0, 1000.0)) + 1);
    if (ready <= 0) continue;
    Fd conn(::accept(listener.fd, nullptr, nullptr));
    if (conn.fd < 0) continue;
    Hello h{};
    int err = 0;
    // A stray or broken connection (a port scanner) is dropped, not fatal.
    const auto hello_deadline = std::min(deadline, deadline_after(10));
    if (!transfer(conn.fd, &h, sizeof(h), true, hello_deadline, err) || h.magic != kMagic ||
        h.length > kMaxPayload)
      continue;
    if (h.world_size != env.world_size)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "TCP rendezvous: rank {} was started with WORLD_SIZE={} but rank 0 with {}",
                   h.rank, h.world_size, env.world_size);
    if (h.rank <= 0 || h.rank >= env.world_size || peers[size_t(h.rank)].fd >= 0)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "TCP rendezvous: two processes claim RANK={} (or it is outside [1, {}]); give "
                   "every process its own RANK",
                   h.rank, env.world_size - 1);
    RankContact& c = table[size_t(h.rank)];
    c.bytes.resize(h.length);
    if (!transfer(conn.fd, c.bytes.data(), c.bytes.size(), true, hello_deadline, err)) continue;
    c.address = net::peer_address(conn.fd);
    peers[size_t(h.rank)] = std::move(conn);
    ++arrived;
  }
  const std::vector<std::byte> reply = encode(table);
  const Header head{kMagic, 0, uint64_t(reply.size())};
  for (int r = 1; r < env.world_size; ++r) {
    int err = 0;
    const int fd = peers[size_t(r)].fd;
    if (!transfer(fd, const_cast<Header*>(&head), sizeof(head), false, deadline, err) ||
        !transfer(fd, const_cast<std::byte*>(reply.data()), reply.size(), false, deadline, err))
      SHARDLM_FAIL(ErrorKind::kInternal, "TCP rendezvous: rank 0 could not send to rank {}: {}", r,
                   why(err));
  }
  return table;
}

std::vector<RankContact> join(const LaunchEnv& env, const std::vector<std::byte>& mine,
                              double timeout_s) {
  SHARDLM_CHECK(mine.size() <= kMaxPayload, "TCP rendezvous: payload of {} bytes", mine.size());
  int last_err = 0;
  Fd conn = net::connect_retrying(env.master_addr, env.master_port, deadline_after(timeout_s),
                                  last_err, fmt::format("rank {}: MASTER_ADDR", env.rank));
  if (conn.fd < 0)
    SHARDLM_FAIL(ErrorKind::kInternal,
                 "TCP rendezvous timed out: rank {} could not reach rank 0 at {} within {} s "
                 "(last error: {}); is rank 0 running, and is MASTER_ADDR its address?",
                 env.rank, where(env), timeout_s, why(last_err));
  const Hello hello{kMagic, env.rank, env.world_size, 0, uint64_t(mine.size())};
  Header head{};
  int err = 0;
  // Rank 0 answers once the last rank has arrived: allow the whole timeout again.
  const auto reply_deadline = deadline_after(timeout_s);
  const bool got =
      transfer(conn.fd, const_cast<Hello*>(&hello), sizeof(hello), false, reply_deadline, err) &&
      transfer(conn.fd, const_cast<std::byte*>(mine.data()), mine.size(), false, reply_deadline,
               err) &&
      transfer(conn.fd, &head, sizeof(head), true, reply_deadline, err);
  if (!got || head.magic != kMagic)
    SHARDLM_FAIL(ErrorKind::kInternal,
                 "TCP rendezvous: rank {} connected to rank 0 at {} but got no bootstrap reply "
                 "({}); rank 0 failed, timed out waiting for another rank, or the address is "
                 "some other service",
                 env.rank, where(env),
                 !got
                     ? (err == ETIMEDOUT ? fmt::format("nothing within {} s", timeout_s) : why(err))
                     : std::string("an unexpected reply"));
  SHARDLM_CHECK(head.length <= uint64_t(env.world_size) * (kMaxPayload + 1024),
                "TCP rendezvous: reply of {} bytes", head.length);
  std::vector<std::byte> bytes(head.length);
  if (!transfer(conn.fd, bytes.data(), bytes.size(), true, reply_deadline, err))
    SHARDLM_FAIL(ErrorKind::kInternal, "TCP rendezvous: rank {} lost rank 0 mid-reply: {}",
                 env.rank, why(err));
  return decode(bytes, env.world_size);
}

}  // namespace

std::optional<LaunchEnv> launch_env_from(const EnvGetter& get) {
  const auto world = int_var(get, "WORLD_SIZE", 1, 1 << 20);
  if (!world) return std::nullopt;
  LaunchEnv env;
  env.world_size = int(*world);
  const char* vars =
      "a torchrun-style launch sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and "
      "MASTER_PORT on every process";
  const auto rank = int_var(get, "RANK", 0, env.world_size - 1);
  if (!rank && env.world_size > 1)
    SHARDLM_FAIL(ErrorKind::kConfig, "WORLD_SIZE={} is set but RANK is not; {}", env.world_size,
                 vars);
  env.rank = rank.value_or(0);
  std::optional<long> local = int_var(get, "LOCAL_RANK", 0, 1 << 20);
  for (const char* alt : {"OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"})
    if (!local) local = int_var(get, alt, 0, 1 << 20);
  if (!local && env.world_size > 1)
    SHARDLM_FAIL(ErrorKind::kConfig, "WORLD_SIZE={} is set but LOCAL_RANK is not; {}",
                 env.world_size, vars);
  env.local_rank = int(local.value_or(0));
  if (env.world_size == 1) return env;
  const char* addr = get("MASTER_ADDR");
  if (addr == nullptr || *addr == '\0')
    SHARDLM_FAIL(ErrorKind::kConfig, "WORLD_SIZE={} is set but MASTER_ADDR is not; {}",
                 env.world_size, vars);
  env.master_addr = addr;
  const auto port = int_var(get, "MASTER_PORT", 1, 65535);
  if (!port)
    SHARDLM_FAIL(ErrorKind::kConfig, "WORLD_SIZE={} is set but MASTER_PORT is not; {}",
                 env.world_size, vars);
  env.master_port = int(*port);
  return env;
}

std::optional<LaunchEnv> launch_env() {
  return launch_env_from([](const char* name) { return std::getenv(name); });
}

std::vector<RankContact> tcp_gather_bytes(const LaunchEnv& env, const std::vector<std::byte>& mine,
                                          double timeout_s) {
  SHARDLM_CHECK(env.world_size >= 1 && env.rank >= 0 && env.rank < env.world_size, "rank {} of {}",
                env.rank, env.world_size);
  if (env.world_size == 1) return {RankContact{env.master_addr, mine}};
  return env.rank == 0 ? serve(env, mine, timeout_s) : join(env, mine, timeout_s);
}

std::vector<std::byte> tcp_broadcast_bytes(const LaunchEnv& env,
                                           const std::vector<std::byte>& payload,
                                           double timeout_s) {
  const std::vector<std::byte> none;
  return tcp_gather_bytes(env, env.rank == 0 ? payload : none, timeout_s)[0].bytes;
}

}  // namespace shardlm
