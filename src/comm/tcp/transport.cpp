// The TCP communicator's transport: posting and matching transfers, the progress thread that
// moves bytes between nonblocking sockets, failures (a lost peer, a size mismatch, a timeout)
// and the orderly close. Every state change happens under `mutex`; the progress thread holds
// it while it reads and writes, never while it sleeps in poll().
#include "comm/tcp/transport.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <set>

#include "shardlm/core/check.h"

namespace shardlm::tcp {

Transport::Transport(int rank, Mesh mesh, double close_timeout_s)
    : rank_(rank),
      close_timeout_s_(close_timeout_s),
      peers_(mesh.nodes.size()),
      nodes_(std::move(mesh.nodes)),
      sockets_(std::move(mesh.sockets)) {
  for (size_t p = 0; p < peers_.size(); ++p) {
    if (int(p) == rank_) continue;
    peers_[p].fd = sockets_[p].fd;
    ::fcntl(peers_[p].fd, F_SETFL, ::fcntl(peers_[p].fd, F_GETFL) | O_NONBLOCK);
  }
  if (peers_.size() > 1) {
    wake_fd_ = net::Fd(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
    SHARDLM_CHECK(wake_fd_.fd >= 0, "eventfd failed: {}", std::strerror(errno));
    progress_ = std::thread([this] { progress_loop(); });
  }
}

Transport::~Transport() {
  if (!progress_.joinable()) return;
  const auto deadline = net::deadline_after(close_timeout_s_);
  std::unique_lock lock(mutex);
  closing_ = true;
  auto queued = [this] {
    for (const Peer& p : peers_)
      if (p.fd >= 0 && p.lost.empty() && !p.sendq.empty()) return true;
    return false;
  };
  changed_.wait_until(lock, deadline, [&] { return !queued(); });
  for (Peer& p : peers_)
    if (p.fd >= 0) ::shutdown(p.fd, SHUT_WR);
  auto open = [this] {
    for (const Peer& p : peers_)
      if (p.fd >= 0 && p.lost.empty() && !p.eof) return true;
    return false;
  };
  wake();
  changed_.wait_until(lock, deadline, [&] { return !open(); });
  stop_ = true;
  lock.unlock();
  wake();
  progress_.join();
}

void Transport::wake() {
  const uint64_t one = 1;
  if (wake_fd_.fd >= 0) (void)!::write(wake_fd_.fd, &one, sizeof(one));
}

// ---- posting ----------------------------------------------------------------------------------

namespace {

std::unique_ptr<Transfer> make_transfer(bool is_send, int peer, uint64_t comm_id, uint64_t tag,
                                        std::byte* data, size_t bytes, size_t elem_bytes, Op* op) {
  auto t = std::make_unique<Transfer>();
  t->is_send = is_send;
  t->peer = peer;
  t->comm_id = comm_id;
  t->tag = tag;
  t->data = data;
  t->bytes = bytes;
  t->elem_bytes = elem_bytes;
  t->op = op;
  return t;
}

}  // namespace

void Transport::post_send(Op& op, int peer, uint64_t comm_id, uint64_t tag, const void* data,
                          size_t bytes, size_t elem_bytes) {
  if (op.complete) return;  // failed while its transfers were being posted
  auto owned =
      make_transfer(true, peer, comm_id, tag, static_cast<std::byte*>(const_cast<void*>(data)),
                    bytes, elem_bytes, &op);
  Transfer& t = *owned;
  op.transfers.push_back(std::move(owned));
  ++op.outstanding;
  Peer& p = peers_[size_t(peer)];
  if (peer == rank_) {  // to self: straight into the matching receive or the unexpected queue
    const std::vector<std::byte> copy(t.data, t.data + bytes);
    auto& q = p.posted[{comm_id, tag}];
    if (!q.empty()) {
      Transfer* r = q.front();
      q.pop_front();
      deliver(*r, copy, /*settle_now=*/r->op != &op);
    } else {
      p.unexpected[{comm_id, tag}].push_back(copy);
    }
    finish(t, /*settle_now=*/false);
    return;
  }
  if (!p.lost.empty()) return fail(op, p.lost, true);
  p.sendq.push_back(&t);
  // Write what the socket takes now, saving the progress thread's wake-up on small messages;
  // the rest goes when the socket has room.
  if (p.sendq.size() == 1) write_peer(peer, /*settle_now=*/false);
  if (!p.sendq.empty()) wake();
}

void Transport::post_recv(Op& op, int peer, uint64_t comm_id, uint64_t tag, void* data,
                          size_t bytes, size_t elem_bytes) {
  if (op.complete) return;
  auto owned = make_transfer(false, peer, comm_id, tag, static_cast<std::byte*>(data), bytes,
                             elem_bytes, &op);
  Transfer& t = *owned;
  op.transfers.push_back(std::move(owned));
  ++op.outstanding;
  Peer& p = peers_[size_t(peer)];
  auto found = p.unexpected.find({comm_id, tag});
  if (found != p.unexpected.end() && !found->second.empty()) {
    const std::vector<std::byte> bytes_in = std::move(found->second.front());
    found->second.pop_front();
    if (found->second.empty()) p.unexpected.erase(found);
    return deliver(t, bytes_in, /*settle_now=*/false);
  }
  if (!p.lost.empty()) return fail(op, p.lost, true);
  p.posted[{comm_id, tag}].push_back(&t);
}

// A receive matched with a whole message already in memory.
void Transport::deliver(Transfer& t, const std::vector<std::byte>& bytes, bool settle_now) {
  if (bytes.size() != t.bytes) {
    t.finished = true;
    return fail(*t.op,
                fmt::format("the matching send had {} elements; sizes must agree",
                            bytes.size() / t.elem_bytes),
                false);
  }
  if (!bytes.empty()) std::memcpy(t.data, bytes.data(), bytes.size());
  finish(t, settle_now);
}

// settle_now is false while the op's transfers are being posted: the poster settles it once
// all of them (and its continuation) are in place.
void Transport::finish(Transfer& t, bool settle_now) {
  t.finished = true;
  if (t.op == nullptr) return;
  Op& op = *t.op;
  if (op.complete) return;
  --op.outstanding;
  if (settle_now) settle(op);
}

void Transport::settle(Op& op) {
  while (!op.complete && op.outstanding == 0) {
    if (!op.then) {
      op.complete = true;
      changed_.notify_all();
      return;
    }
    auto next = std::move(op.then);
    op.then = nullptr;
    next(op);
  }
}

void Transport::fail(Op& op, const std::string& reason, bool breaks) {
  if (op.complete) return;
  op.complete = true;
  op.error = reason;
  op.breaks = breaks;
  op.then = nullptr;
  for (auto& t : op.transfers)
    if (!t->finished) cancel(*t);
  changed_.notify_all();
}

// Withdraws an unfinished transfer: a receive stops matching (its message, if half read, is
// read to the end and dropped); a send not yet begun is dropped, and one half written goes on
// with zeros, so the stream stays framed (its communicator is unusable by then).
void Transport::cancel(Transfer& t) {
  t.finished = true;
  Peer& p = peers_[size_t(t.peer)];
  if (!t.is_send) {
    if (p.rx_target == &t) {
      p.rx_target = nullptr;
      p.rx_discard = true;
      p.rx_buffer.resize(p.rx.bytes);
      return;
    }
    auto q = p.posted.find({t.comm_id, t.tag});
    if (q != p.posted.end()) q->second.remove(&t);
    return;
  }
  auto it = std::find(p.sendq.begin(), p.sendq.end(), &t);
  if (it == p.sendq.end()) return;
  if (it != p.sendq.begin() || t.sent == 0) {
    p.sendq.erase(it);
    return;
  }
  auto rest = make_transfer(true, t.peer, t.comm_id, t.tag, nullptr, t.bytes, 1, nullptr);
  rest->sent = t.sent;
  rest->zeros.resize(t.bytes);
  rest->data = rest->zeros.data();
  *it = rest.get();
  p.orphans.push_back(std::move(rest));
}

std::vector<int> Transport::pending_peers(const Op& op) const {
  std::set<int> peers;
  for (const auto& t : op.transfers)
    if (!t->finished) peers.insert(t->peer);
  return {peers.begin(), peers.end()};
}

void Transport::wait(Op& op, double timeout_s,
                     const std::function<std::string(const std::vector<int>&)>& on_timeout) {
  std::unique_lock lock(mutex);
  const auto deadline = net::deadline_after(timeout_s);
  if (!changed_.wait_until(lock, deadline, [&] { return op.complete; }))
    fail(op, on_timeout(pending_peers(op)), true);
}

void Transport::abort(int exit_code) {
  for (const net::Fd& s : sockets_)
    if (s.fd >= 0) ::shutdown(s.fd, SHUT_RDWR);
  std::_Exit(exit_code);
}

// ---- the progress thread ------------------------------------------------------------------

void Transport::progress_loop() {
  std::vector<pollfd> fds;
  std::vector<int> owner;
  std::unique_lock lock(mutex);
  while (!stop_) {
    fds.assign(1, pollfd{wake_fd_.fd, POLLIN, 0});
    owner.assign(1, -1);
    for (size_t p = 0; p < peers_.size(); ++p) {
      const Peer& peer = peers_[p];
      if (peer.fd < 0 || !peer.lost.empty()) continue;
      short events = peer.eof ? 0 : POLLIN;
      if (!peer.sendq.empty()) events |= POLLOUT;
      if (events == 0) continue;
      fds.push_back(pollfd{peer.fd, events, 0});
      owner.push_back(int(p));
    }
    lock.unlock();
    ::poll(fds.data(), fds.size(), 500);
    lock.lock();
    if (fds[0].revents & POLLIN) {
      uint64_t count = 0;
      (void)!::read(wake_fd_.fd, &count, sizeof(count));
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      const int p = owner[i];
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) read_peer(p);
      if ((fds[i].revents & POLLOUT) && peers_[size_t(p)].lost.empty()) write_peer(p, true);
    }
  }
}

void Transport::read_peer(int p) {
  Peer& peer = peers_[size_t(p)];
  while (peer.lost.empty() && !peer.eof) {
    std::byte* dst = nullptr;
    size_t want = 0;
    const bool header = peer.rx_header < sizeof(WireHeader);
    if (header) {
      dst = reinterpret_cast<std::byte*>(&peer.rx) + peer.rx_header;
      want = sizeof(WireHeader) - peer.rx_header;
    } else {
      std::byte* base = peer.rx_target ? peer.rx_target->data : peer.rx_buffer.data();
      dst = base + peer.rx_body;
      want = peer.rx.bytes - peer.rx_body;
    }
    const ssize_t got = ::recv(peer.fd, dst, want, MSG_DONTWAIT);
    if (got < 0 && errno == EINTR) continue;
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (got == 0 && header && peer.rx_header == 0) {
      peer.eof = true;  // a clean close between messages
      changed_.notify_all();
      if (!closing_) peer_gone(p, "closed its connection (it exited or failed)");
      return;
    }
    if (got <= 0)
      return peer_gone(p, got == 0 ? "closed its connection in the middle of a message"
                                   : fmt::format("connection failed: {}", std::strerror(errno)));
    if (header) {
      peer.rx_header += size_t(got);
      if (peer.rx_header == sizeof(WireHeader)) begin_body(peer);
    } else {
      peer.rx_body += size_t(got);
    }
    if (peer.rx_header == sizeof(WireHeader) && peer.rx_body == peer.rx.bytes) finish_body(peer);
  }
}

void Transport::begin_body(Peer& peer) {
  peer.rx_body = 0;
  peer.rx_target = nullptr;
  peer.rx_discard = false;
  auto q = peer.posted.find({peer.rx.comm_id, peer.rx.tag});
  if (q != peer.posted.end() && !q->second.empty() && q->second.front()->bytes == peer.rx.bytes) {
    peer.rx_target = q->second.front();
    q->second.pop_front();
    return;
  }
  peer.rx_buffer.assign(peer.rx.bytes, std::byte{0});
}

void Transport::finish_body(Peer& peer) {
  peer.rx_header = 0;
  if (Transfer* t = peer.rx_target) {
    peer.rx_target = nullptr;
    finish(*t, true);
    return;
  }
  if (peer.rx_discard) return;
  std::vector<std::byte> bytes = std::move(peer.rx_buffer);
  peer.rx_buffer.clear();
  auto q = peer.posted.find({peer.rx.comm_id, peer.rx.tag});
  if (q != peer.posted.end() && !q->second.empty()) {  // posted while the body arrived
    Transfer* t = q->second.front();
    q->second.pop_front();
    return deliver(*t, bytes, true);
  }
  peer.unexpected[{peer.rx.comm_id, peer.rx.tag}].push_back(std::move(bytes));
}

void Transport::write_peer(int p, bool settle_now) {
  Peer& peer = peers_[size_t(p)];
  while (!peer.sendq.empty()) {
    Transfer& t = *peer.sendq.front();
    const WireHeader head{t.comm_id, t.tag, t.bytes};
    iovec parts[2];
    int count = 0;
    if (t.sent < sizeof(head)) {
      parts[count++] = {reinterpret_cast<char*>(const_cast<WireHeader*>(&head)) + t.sent,
                        sizeof(head) - t.sent};
      parts[count++] = {t.data, t.bytes};
    } else {
      parts[count++] = {t.data + (t.sent - sizeof(head)), t.bytes - (t.sent - sizeof(head))};
    }
    msghdr msg{};
    msg.msg_iov = parts;
    msg.msg_iovlen = size_t(count);
    const ssize_t put = ::sendmsg(peer.fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (put < 0 && errno == EINTR) continue;
    if (put < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (put < 0) return peer_gone(p, fmt::format("connection failed: {}", std::strerror(errno)));
    t.sent += size_t(put);
    if (t.sent < sizeof(head) + t.bytes) continue;
    peer.sendq.pop_front();
    if (t.op == nullptr) {
      peer.orphans.remove_if([&t](const auto& o) { return o.get() == &t; });
      continue;
    }
    finish(t, settle_now);
  }
  changed_.notify_all();  // the close waits for empty queues
}

// The connection to `p` is gone: every op with a transfer to or from it fails, naming it, and
// so will every later one (messages already received from it still match).
void Transport::peer_gone(int p, const std::string& reason) {
  Peer& peer = peers_[size_t(p)];
  if (!peer.lost.empty()) return;
  peer.lost = fmt::format("world rank {} {}", p, reason);
  std::set<Op*> ops;
  for (Transfer* t : peer.sendq)
    if (t->op) ops.insert(t->op);
  for (auto& [key, q] : peer.posted)
    for (Transfer* t : q) ops.insert(t->op);
  if (peer.rx_target) ops.insert(peer.rx_target->op);
  peer.rx_target = nullptr;
  for (Op* op : ops) fail(*op, peer.lost, true);
  peer.sendq.clear();
  peer.posted.clear();
  changed_.notify_all();
}

}  // namespace shardlm::tcp
