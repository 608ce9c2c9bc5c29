// Plain POSIX socket helpers shared by the TCP rendezvous and the TCP communicator's mesh: an
// owning descriptor, deadlines, exact reads and writes bounded by a deadline, a dual-stack
// listener and a retrying connect. No MPI, no CUDA. Private to src/comm.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>
#include <utility>

namespace shardlm::net {

using Clock = std::chrono::steady_clock;

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
  ~Fd();
  int release() { return std::exchange(fd, -1); }
};

Clock::time_point deadline_after(double seconds);
double seconds_left(Clock::time_point deadline);

// Reads or writes exactly `n` bytes before `deadline`; false on timeout, EOF or error (errno_out
// says which: 0 for EOF, ETIMEDOUT for the deadline).
bool transfer(int fd, void* data, size_t n, bool reading, Clock::time_point deadline,
              int& errno_out);

// strerror, or "connection closed" for 0.
std::string why(int err);

// A listening socket on every address (IPv6 and IPv4 where the host has IPv6) at `port` (0: any
// free port). Invalid Fd on failure, errno set.
Fd listen_any(int port, int backlog);
// The port a bound socket listens on.
int bound_port(int fd);
// The numeric address of the other end of a connected socket ("10.0.0.7", "fe80::1"; an
// IPv4-mapped IPv6 address as plain IPv4).
std::string peer_address(int fd);

// Connects to host:port, retrying every 50 ms until `deadline` (the other side may not be
// listening yet). Invalid Fd on timeout, with the last error in last_err; throws Error(kConfig)
// when `host` does not resolve (`who` names the caller in that message). TCP_NODELAY is set.
Fd connect_retrying(const std::string& host, int port, Clock::time_point deadline, int& last_err,
                    const std::string& who);

}  // namespace shardlm::net
