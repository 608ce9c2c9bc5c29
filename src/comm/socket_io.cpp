// The socket helpers of socket_io.h: every wait polls with a bounded timeout, so no call blocks
// past its deadline.
#include "comm/socket_io.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include "shardlm/core/check.h"

namespace shardlm::net {

Fd::~Fd() {
  if (fd >= 0) ::close(fd);
}

Clock::time_point deadline_after(double seconds) {
  const std::chrono::duration<double> d(std::min(seconds, 1e9));
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(d);
}

double seconds_left(Clock::time_point deadline) {
  return std::chrono::duration<double>(deadline - Clock::now()).count();
}

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

Fd listen_any(int port, int backlog) {
  Fd listener(::socket(AF_INET6, SOCK_STREAM, 0));
  const bool v6 = listener.fd >= 0;
  if (!v6) listener = Fd(::socket(AF_INET, SOCK_STREAM, 0));
  if (listener.fd < 0) return listener;
  const int one = 1, zero = 0;
  ::setsockopt(listener.fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  int rc = 0;
  if (v6) {
    ::setsockopt(listener.fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof(zero));  // v4 too
    sockaddr_in6 a{};
    a.sin6_family = AF_INET6;
    a.sin6_addr = in6addr_any;
    a.sin6_port = htons(uint16_t(port));
    rc = ::bind(listener.fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  } else {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(uint16_t(port));
    rc = ::bind(listener.fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  }
  if (rc != 0 || ::listen(listener.fd, backlog) != 0) return Fd();
  return listener;
}

int bound_port(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  SHARDLM_CHECK(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0,
                "getsockname failed: {}", std::strerror(errno));
  if (a.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&a)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&a)->sin_port);
}

std::string peer_address(int fd) {
  sockaddr_storage a{};
  socklen_t len = sizeof(a);
  char host[NI_MAXHOST] = {};
  if (::getpeername(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0 ||
      ::getnameinfo(reinterpret_cast<sockaddr*>(&a), len, host, sizeof(host), nullptr, 0,
                    NI_NUMERICHOST) != 0)
    return "";
  std::string s = host;
  if (s.starts_with("::ffff:") && s.find('.') != std::string::npos) s = s.substr(7);
  return s;
}

Fd connect_retrying(const std::string& host, int port, Clock::time_point deadline, int& last_err,
                    const std::string& who) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const std::string port_text = std::to_string(port);
  const int gai = ::getaddrinfo(host.c_str(), port_text.c_str(), &hints, &found);
  if (gai != 0)
    SHARDLM_FAIL(ErrorKind::kConfig, "{}: address '{}' does not resolve: {}", who, host,
                 ::gai_strerror(gai));
  struct Free {
    addrinfo* p;
    ~Free() { ::freeaddrinfo(p); }
  } free_found{found};
  while (true) {
    for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
      Fd s(::socket(a->ai_family, a->ai_socktype, a->ai_protocol));
      if (s.fd < 0) continue;
      timeval tv{1, 0};  // one attempt never blocks longer than a second
      ::setsockopt(s.fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
      if (::connect(s.fd, a->ai_addr, a->ai_addrlen) == 0) {
        const int one = 1;
        ::setsockopt(s.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
        timeval none{0, 0};
        ::setsockopt(s.fd, SOL_SOCKET, SO_SNDTIMEO, &none, sizeof(none));
        return s;
      }
      last_err = errno;
    }
    if (seconds_left(deadline) <= 0) return Fd();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

}  // namespace shardlm::net
