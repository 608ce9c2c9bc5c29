// The torchrun-style launch variables and the TCP rendezvous that hands rank 0's bytes (the
// NCCL unique id) to every rank. Protocol: each rank r > 0 connects to MASTER_ADDR:MASTER_PORT
// and sends a hello {magic, r, world_size}; once all have arrived rank 0 answers each with
// {magic, length} and the bytes, then closes. Every wait is bounded by the timeout.
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

#include "shardlm/core/check.h"

namespace shardlm {

namespace {

constexpr uint32_t kMagic = 0x534c5256;  // "SLRV"
using Clock = std::chrono::steady_clock;

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

// Closes its descriptor on destruction.
struct Fd {
  int fd = -1;
  Fd() = default;
  explicit Fd(int f) : fd(f) {}
  Fd(Fd&& o) noexcept : fd(o.fd) { o.fd = -1; }
  Fd& operator=(Fd&& o) noexcept {
    std::swap(fd, o.fd);
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

Clock::time_point deadline_after(double seconds) {
  const std::chrono::duration<double> d(std::min(seconds, 1e9));
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(d);
}

double seconds_left(Clock::time_point deadline) {
  return std::chrono::duration<double>(deadline - Clock::now()).count();
}

// Reads or writes exactly `n` bytes before `deadline`; false on timeout, EOF or error (errno_out
// says which: 0 for EOF, ETIMEDOUT for the deadline).
bool transfer(int fd, void* data, size_t n, bool reading, Clock::time_point deadline,
              int& errno_out) {
  auto* p = static_cast<std::byte*>(data);
  size_t done = 0;
  while (done < n) {
    const double left = seconds_left(deadline);
    if (left <= 0) {
      errno_out = ETIMEDOUT;
      return false;
    }
    pollfd pfd{fd, short(reading ? POLLIN : POLLOUT), 0};
    const int ready = ::poll(&pfd, 1, int(std::min(left * 1000.0, 1000.0)) + 1);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) {
      errno_out = errno;
      return false;
    }
    if (ready == 0) continue;
    const ssize_t got =
        reading ? ::recv(fd, p + done, n - done, 0) : ::send(fd, p + done, n - done, MSG_NOSIGNAL);
    if (got < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    if (got <= 0) {
      errno_out = got == 0 ? 0 : errno;
      return false;
    }
    done += size_t(got);
  }
  return true;
}

std::string why(int err) { return err == 0 ? "connection closed" : std::strerror(err); }

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
};

struct Header {
  uint32_t magic;
  uint32_t reserved;
  uint64_t length;
};

std::vector<std::byte> serve(const LaunchEnv& env, const std::vector<std::byte>& payload,
                             double timeout_s) {
  Fd listener(::socket(AF_INET6, SOCK_STREAM, 0));
  bool v6 = listener.fd >= 0;
  if (!v6) listener = Fd(::socket(AF_INET, SOCK_STREAM, 0));
  SHARDLM_CHECK(listener.fd >= 0, "rank 0: socket() failed: {}", std::strerror(errno));
  const int one = 1, zero = 0;
  ::setsockopt(listener.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  int rc = 0;
  if (v6) {
    ::setsockopt(listener.fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));  // v4 too
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(uint16_t(env.master_port));
    rc = ::bind(listener.fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(uint16_t(env.master_port));
    rc = ::bind(listener.fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  }
  if (rc != 0 || ::listen(listener.fd, std::max(16, env.world_size)) != 0)
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "rank 0 cannot listen on MASTER_PORT={} for the rendezvous: {}; choose a free "
                 "port",
                 env.master_port, std::strerror(errno));

  const auto deadline = deadline_after(timeout_s);
  std::vector<Fd> peers(size_t(env.world_size));
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
    if (!transfer(conn.fd, &h, sizeof(h), true, hello_deadline, err) || h.magic != kMagic) continue;
    if (h.world_size != env.world_size)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "TCP rendezvous: rank {} was started with WORLD_SIZE={} but rank 0 with {}",
                   h.rank, h.world_size, env.world_size);
    if (h.rank <= 0 || h.rank >= env.world_size || peers[size_t(h.rank)].fd >= 0)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "TCP rendezvous: two processes claim RANK={} (or it is outside [1, {}]); give "
                   "every process its own RANK",
                   h.rank, env.world_size - 1);
    peers[size_t(h.rank)] = std::move(conn);
    ++arrived;
  }
  const Header head{kMagic, 0, uint64_t(payload.size())};
  for (int r = 1; r < env.world_size; ++r) {
    int err = 0;
    const int fd = peers[size_t(r)].fd;
    if (!transfer(fd, const_cast<Header*>(&head), sizeof(head), false, deadline, err) ||
        !transfer(fd, const_cast<std::byte*>(payload.data()), payload.size(), false, deadline, err))
      SHARDLM_FAIL(ErrorKind::kInternal, "TCP rendezvous: rank 0 could not send to rank {}: {}", r,
                   why(err));
  }
  return payload;
}

std::vector<std::byte> join(const LaunchEnv& env, double timeout_s) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(env.master_port);
  const int gai = ::getaddrinfo(env.master_addr.c_str(), port.c_str(), &hints, &found);
  if (gai != 0)
    SHARDLM_FAIL(ErrorKind::kConfig, "rank {}: MASTER_ADDR='{}' does not resolve: {}", env.rank,
                 env.master_addr, ::gai_strerror(gai));
  struct Free {
    addrinfo* p;
    ~Free() { ::freeaddrinfo(p); }
  } free_found{found};

  const auto deadline = deadline_after(timeout_s);
  Fd conn;
  int last_err = 0;
  while (conn.fd < 0) {
    for (addrinfo* a = found; a != nullptr && conn.fd < 0; a = a->ai_next) {
      Fd s(::socket(a->ai_family, a->ai_socktype, a->ai_protocol));
      if (s.fd < 0) continue;
      timeval tv{1, 0};  // one attempt never blocks longer than a second
      ::setsockopt(s.fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
      if (::connect(s.fd, a->ai_addr, a->ai_addrlen) == 0)
        conn = std::move(s);
      else
        last_err = errno;
    }
    if (conn.fd >= 0) break;
    if (seconds_left(deadline) <= 0)
      SHARDLM_FAIL(ErrorKind::kInternal,
                   "TCP rendezvous timed out: rank {} could not reach rank 0 at {} within {} s "
                   "(last error: {}); is rank 0 running, and is MASTER_ADDR its address?",
                   env.rank, where(env), timeout_s, why(last_err));
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  const int one = 1;
  ::setsockopt(conn.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  const Hello hello{kMagic, env.rank, env.world_size, 0};
  Header head{};
  int err = 0;
  // Rank 0 answers once the last rank has arrived: allow the whole timeout again.
  const auto reply_deadline = deadline_after(timeout_s);
  const bool got =
      transfer(conn.fd, const_cast<Hello*>(&hello), sizeof(hello), false, reply_deadline, err) &&
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
  SHARDLM_CHECK(head.length <= (uint64_t(1) << 20), "TCP rendezvous: reply of {} bytes",
                head.length);
  std::vector<std::byte> bytes(head.length);
  if (!transfer(conn.fd, bytes.data(), bytes.size(), true, reply_deadline, err))
    SHARDLM_FAIL(ErrorKind::kInternal, "TCP rendezvous: rank {} lost rank 0 mid-reply: {}",
                 env.rank, why(err));
  return bytes;
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

std::vector<std::byte> tcp_broadcast_bytes(const LaunchEnv& env,
                                           const std::vector<std::byte>& payload,
                                           double timeout_s) {
  SHARDLM_CHECK(env.world_size >= 1 && env.rank >= 0 && env.rank < env.world_size, "rank {} of {}",
                env.rank, env.world_size);
  if (env.world_size == 1) return payload;
  return env.rank == 0 ? serve(env, payload, timeout_s) : join(env, timeout_s);
}

}  // namespace shardlm
