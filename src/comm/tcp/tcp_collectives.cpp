// TcpCommunicator's collectives over the transport's point-to-point transfers. Reductions are
// direct: every rank sends each peer the slice that peer reduces, the peer combines the
// contributions in rank order (one rounding per pairwise combination for bf16) and, for
// all_reduce, a second stage gathers the reduced slices; the same bits land on every rank.
// Traffic per rank is 2 (P - 1) / P of the buffer for all_reduce, as in a ring.
#include <cmath>
#include <cstring>

#include "comm/tcp/tcp_communicator.h"

namespace shardlm::tcp {

namespace {

uint64_t collective_tag(uint64_t seq, int stage) {
  return (uint64_t(1) << 63) | (seq << 2) | stage;
}

template <typename T, typename Combine>
void combine_as(std::byte* acc, const std::byte* in, size_t n, Combine combine) {
  auto* a = reinterpret_cast<T*>(acc);
  const auto* b = reinterpret_cast<const T*>(in);
  for (size_t i = 0; i < n; ++i) a[i] = combine(a[i], b[i]);
}

template <typename T>
void combine_typed(std::byte* acc, const std::byte* in, size_t n, ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      if constexpr (std::is_integral_v<T>)  // wraps as the hardware adds, without UB
        return combine_as<T>(acc, in, n, [](T a, T b) {
          using U = std::make_unsigned_t<T>;
          return T(U(a) + U(b));
        });
      else
        return combine_as<T>(acc, in, n, [](T a, T b) { return a + b; });
    case ReduceOp::kMax:
      if constexpr (std::is_floating_point_v<T>)  // a NaN loses to a number, as in NCCL
        return combine_as<T>(acc, in, n, [](T a, T b) { return std::fmax(a, b); });
      else
        return combine_as<T>(acc, in, n, [](T a, T b) { return a < b ? b : a; });
    case ReduceOp::kMin:
      if constexpr (std::is_floating_point_v<T>)
        return combine_as<T>(acc, in, n, [](T a, T b) { return std::fmin(a, b); });
      else
        return combine_as<T>(acc, in, n, [](T a, T b) { return b < a ? b : a; });
  }
}

// acc [n] = combine(acc, in) element-wise; bf16 in f32, rounded once per element.
void combine(DType dtype, ReduceOp op, std::byte* acc, const std::byte* in, size_t n) {
  switch (dtype) {
    case DType::kF32:
      return combine_typed<float>(acc, in, n, op);
    case DType::kF64:
      return combine_typed<double>(acc, in, n, op);
    case DType::kI32:
      return combine_typed<int32_t>(acc, in, n, op);
    case DType::kI64:
      return combine_typed<int64_t>(acc, in, n, op);
    case DType::kU8:
      return combine_typed<uint8_t>(acc, in, n, op);
    case DType::kBF16: {
      auto* a = reinterpret_cast<uint16_t*>(acc);
      const auto* b = reinterpret_cast<const uint16_t*>(in);
      for (size_t i = 0; i < n; ++i) {
        const float x = bf16_to_f32(a[i]), y = bf16_to_f32(b[i]);
        const float r = op == ReduceOp::kSum   ? x + y
                        : op == ReduceOp::kMax ? std::fmax(x, y)
                                               : std::fmin(x, y);
        a[i] = f32_to_bf16(r);
      }
      return;
    }
  }
}

// out [n] = slot 0 combined with slots 1, ..., P - 1 in order; slots [P][n] contiguous.
void reduce_slots(DType dtype, ReduceOp op, const std::byte* slots, int P, size_t n,
                  std::byte* out) {
  const size_t bytes = n * dtype_size(dtype);
  if (bytes == 0) return;
  std::memmove(out, slots, bytes);
  for (int r = 1; r < P; ++r) combine(dtype, op, out, slots + size_t(r) * bytes, n);
}

}  // namespace

// ---- all_reduce  <->  identity copy ---------------------------------------------------------

std::unique_ptr<CommHandle> TcpCommunicator::start_all_reduce(const Tensor& buf, ReduceOp rop) {
  uint64_t seq = 0;
  auto op =
      begin(fmt::format("all_reduce of {} {}", buf.numel(), dtype_name(buf.dtype())), true, seq);
  const int P = size(), me = rank();
  const size_t es = dtype_size(buf.dtype()), n = size_t(buf.numel());
  const DType dtype = buf.dtype();
  auto* data = static_cast<std::byte*>(buf.data());
  // Slice r: [off(r), off(r) + len(r)) elements, reduced by rank r.
  auto off = [n, P](int r) { return size_t(r) * (n / P) + std::min(size_t(r), n % P); };
  auto len = [n, P](int r) { return n / P + (size_t(r) < n % P ? 1 : 0); };
  const size_t mine = len(me) * es;
  op->scratch.resize(size_t(P) * mine);
  if (mine) std::memcpy(op->scratch.data() + size_t(me) * mine, data + off(me) * es, mine);
  std::lock_guard lock(transport_->mutex);
  for (int r = 0; r < P; ++r) {
    if (r == me) continue;
    recv_from(*op, r, collective_tag(seq, 0), op->scratch.data() + size_t(r) * mine, mine, es);
    send_to(*op, r, collective_tag(seq, 0), data + off(r) * es, len(r) * es, es);
  }
  op->then = [this, seq, P, me, es, dtype, rop, data, off, len](Op& o) {
    reduce_slots(dtype, rop, o.scratch.data(), P, len(me), data + off(me) * es);
    for (int r = 0; r < P; ++r) {
      if (r == me) continue;
      send_to(o, r, collective_tag(seq, 1), data + off(me) * es, len(me) * es, es);
      recv_from(o, r, collective_tag(seq, 1), data + off(r) * es, len(r) * es, es);
    }
  };
  transport_->settle(*op);
  return handle(op);
}

// ---- reduce_scatter  <->  all_gather --------------------------------------------------------

std::unique_ptr<CommHandle> TcpCommunicator::start_reduce_scatter(const Tensor& send,
                                                                  const Tensor& recv,
                                                                  ReduceOp rop) {
  uint64_t seq = 0;
  auto op = begin(fmt::format("reduce_scatter of {} {}", send.numel(), dtype_name(send.dtype())),
                  true, seq);
  const int P = size(), me = rank();
  const size_t es = dtype_size(send.dtype()), chunk = recv.bytes();
  const DType dtype = send.dtype();
  const auto* in = static_cast<const std::byte*>(send.data());
  auto* out = static_cast<std::byte*>(recv.data());
  const size_t n = size_t(recv.numel());
  op->scratch.resize(size_t(P) * chunk);
  if (chunk) std::memcpy(op->scratch.data() + size_t(me) * chunk, in + size_t(me) * chunk, chunk);
  std::lock_guard lock(transport_->mutex);
  for (int r = 0; r < P; ++r) {
    if (r == me) continue;
    recv_from(*op, r, collective_tag(seq, 0), op->scratch.data() + size_t(r) * chunk, chunk, es);
    send_to(*op, r, collective_tag(seq, 0), in + size_t(r) * chunk, chunk, es);
  }
  op->then = [P, dtype, rop, out, n](Op& o) {
    reduce_slots(dtype, rop, o.scratch.data(), P, n, out);
  };
  transport_->settle(*op);
  return handle(op);
}

std::unique_ptr<CommHandle> TcpCommunicator::start_all_gather(const Tensor& send,
                                                              const Tensor& recv, bool in_place) {
  uint64_t seq = 0;
  auto op =
      begin(fmt::format("all_gather of {} {}", recv.numel(), dtype_name(recv.dtype())), true, seq);
  const int P = size(), me = rank();
  const size_t es = dtype_size(send.dtype()), chunk = send.bytes();
  auto* out = static_cast<std::byte*>(recv.data());
  if (!in_place && chunk) std::memcpy(out + size_t(me) * chunk, send.data(), chunk);
  std::lock_guard lock(transport_->mutex);
  for (int r = 0; r < P; ++r) {
    if (r == me) continue;
    recv_from(*op, r, collective_tag(seq, 0), out + size_t(r) * chunk, chunk, es);
    send_to(*op, r, collective_tag(seq, 0), out + size_t(me) * chunk, chunk, es);
  }
  transport_->settle(*op);
  return handle(op);
}

// ---- all_to_all  <->  all_to_all ------------------------------------------------------------

std::unique_ptr<CommHandle> TcpCommunicator::start_all_to_all(const Tensor& send,
                                                              const Tensor& recv) {
  uint64_t seq = 0;
  auto op =
      begin(fmt::format("all_to_all of {} {}", send.numel(), dtype_name(send.dtype())), true, seq);
  const int P = size(), me = rank();
  const size_t es = dtype_size(send.dtype()), chunk = send.bytes() / size_t(P);
  const auto* in = static_cast<const std::byte*>(send.data());
  auto* out = static_cast<std::byte*>(recv.data());
  if (chunk) std::memcpy(out + size_t(me) * chunk, in + size_t(me) * chunk, chunk);
  std::lock_guard lock(transport_->mutex);
  for (int r = 0; r < P; ++r) {
    if (r == me) continue;
    recv_from(*op, r, collective_tag(seq, 0), out + size_t(r) * chunk, chunk, es);
    send_to(*op, r, collective_tag(seq, 0), in + size_t(r) * chunk, chunk, es);
  }
  transport_->settle(*op);
  return handle(op);
}

// ---- broadcast  <->  sum-reduce to root -----------------------------------------------------

std::unique_ptr<CommHandle> TcpCommunicator::start_broadcast(const Tensor& buf, int root) {
  uint64_t seq = 0;
  auto op = begin(
      fmt::format("broadcast of {} {} from root {}", buf.numel(), dtype_name(buf.dtype()), root),
      true, seq);
  const size_t es = dtype_size(buf.dtype());
  std::lock_guard lock(transport_->mutex);
  if (rank() == root) {
    for (int r = 0; r < size(); ++r)
      if (r != root) send_to(*op, r, collective_tag(seq, 0), buf.data(), buf.bytes(), es);
  } else {
    recv_from(*op, root, collective_tag(seq, 0), buf.data(), buf.bytes(), es);
  }
  transport_->settle(*op);
  return handle(op);
}

std::unique_ptr<CommHandle> TcpCommunicator::start_barrier() {
  uint64_t seq = 0;
  auto op = begin("barrier", true, seq);
  std::lock_guard lock(transport_->mutex);
  for (int r = 0; r < size(); ++r) {
    if (r == rank()) continue;
    recv_from(*op, r, collective_tag(seq, 0), nullptr, 0, 1);
    send_to(*op, r, collective_tag(seq, 0), nullptr, 0, 1);
  }
  transport_->settle(*op);
  return handle(op);
}

}  // namespace shardlm::tcp
