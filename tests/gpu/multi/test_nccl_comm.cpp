// The NCCL communicator under mpiexec, one GPU per rank (label gpu; skipped when there are fewer
// GPUs than ranks): every op on device buffers against a reference each rank computes itself,
// as tests/parallel/test_comm.cpp does for MPI. Inputs are small integers stored as floats, so
// sums are exact in any order and compared with ==; bf16 sums of real values, which round, are
// held to communicator.h's bound. Also: host tensors (staged; larger ones in pieces or
// refused), ordering after a compute stream, the transport memory measured at creation, a group
// of one (device copy), split, two threads on two communicators, an abort while another thread
// polls, a timeout naming the rank, and the compute thread's waits as stream dependencies (a
// timeout nobody waits for ends the process: nccl_failure_main.cpp).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "parallel/mpi_test_env.h"
#include "shardlm/comm/communicator.h"
#include "shardlm/comm/nccl.h"

namespace shardlm {
namespace {

using test::world;

uint64_t mix(uint64_t x) {  // splitmix64
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

float input_f32(uint64_t seed, int rank, int64_t i) {
  const uint64_t h = mix(seed * 0x100000001b3ull ^ mix(static_cast<uint64_t>(rank) << 40 ^ i));
  return static_cast<float>(static_cast<int>(h % 128) - 64);
}

std::vector<float> inputs_f32(uint64_t seed, int rank, int64_t n) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = input_f32(seed, rank, i);
  return v;
}

bool enough_gpus() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess && count >= world().size();
}

#define NEED_GPUS() \
  if (!enough_gpus()) GTEST_SKIP() << "needs one GPU per rank (" << world().size() << ")"

Communicator& nccl() {
  static std::unique_ptr<Communicator> comm = make_nccl_world(&world());
  return *comm;
}

// A device array of T, freed on destruction.
template <typename T>
struct Dev {
  T* p = nullptr;
  int64_t n = 0;
  explicit Dev(int64_t count) : n(count) {
    EXPECT_EQ(cudaMalloc(&p, sizeof(T) * (n ? n : 1)), cudaSuccess);
    EXPECT_EQ(cudaMemset(p, 0xff, sizeof(T) * (n ? n : 1)), cudaSuccess);  // poison
  }
  explicit Dev(const std::vector<T>& v) : Dev(int64_t(v.size())) { put(v); }
  ~Dev() { cudaFree(p); }
  void put(const std::vector<T>& v) {
    EXPECT_EQ(cudaMemcpy(p, v.data(), sizeof(T) * n, cudaMemcpyHostToDevice), cudaSuccess);
  }
  std::vector<T> get() const {
    std::vector<T> v(n);
    EXPECT_EQ(cudaMemcpy(v.data(), p, sizeof(T) * n, cudaMemcpyDeviceToHost), cudaSuccess);
    return v;
  }
  Tensor t(DType dt) const { return Tensor(p, dt, {n}, MemPool::kDevice); }
  Tensor t(DType dt, int64_t offset, int64_t count) const {
    return Tensor(p + offset, dt, {count}, MemPool::kDevice);
  }
};

class NcclSizes : public ::testing::TestWithParam<int64_t> {};
INSTANTIATE_TEST_SUITE_P(Nccl, NcclSizes, ::testing::Values(1, 7, 1000003));

TEST(Nccl, WorldMatchesTheLauncher) {
  NEED_GPUS();
  EXPECT_EQ(nccl().rank(), world().rank());
  EXPECT_EQ(nccl().size(), world().size());
  EXPECT_EQ(nccl().backend(), "nccl");
}

TEST_P(NcclSizes, AllReduceSumAndMaxF32) {
  NEED_GPUS();
  const int64_t n = GetParam();
  const int p = world().size();
  std::vector<float> sum(n, 0.f), mx(n, -1e9f);
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < n; ++i) {
      sum[i] += input_f32(1, r, i);
      mx[i] = std::max(mx[i], input_f32(1, r, i));
    }
  Dev<float> a(inputs_f32(1, world().rank(), n)), b(inputs_f32(1, world().rank(), n));
  nccl().all_reduce(a.t(DType::kF32));
  nccl().all_reduce_async(b.t(DType::kF32), ReduceOp::kMax)->wait();
  EXPECT_EQ(a.get(), sum);
  EXPECT_EQ(b.get(), mx);
}

TEST(Nccl, AllReduceMinI32) {
  NEED_GPUS();
  const int p = world().size(), me = world().rank();
  std::vector<int32_t> mine(5), want(5);
  for (int i = 0; i < 5; ++i) {
    mine[i] = 1000 * me - i;
    want[i] = -i;  // rank 0's
  }
  Dev<int32_t> d(mine);
  nccl().all_reduce(d.t(DType::kI32), ReduceOp::kMin);
  EXPECT_EQ(d.get(), want) << p;
}

TEST_P(NcclSizes, ReduceScatterThenAllGatherInPlaceIsAllReduce) {
  NEED_GPUS();
  const int64_t n = GetParam();
  const int p = world().size(), me = world().rank();
  std::vector<float> sum(n * p, 0.f);
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < n * p; ++i) sum[i] += input_f32(2, r, i);
  Dev<float> send(inputs_f32(2, me, n * p)), whole(n * p);
  nccl().reduce_scatter(send.t(DType::kF32), whole.t(DType::kF32, me * n, n));
  const auto chunk = whole.get();
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(chunk[me * n + i], sum[me * n + i]) << i;
  nccl().all_gather(whole.t(DType::kF32, me * n, n), whole.t(DType::kF32));  // in place
  EXPECT_EQ(whole.get(), sum);
}

TEST(Nccl, AllGatherBf16MovesBytes) {
  NEED_GPUS();
  const int64_t n = 9;
  const int p = world().size(), me = world().rank();
  std::vector<uint16_t> mine(n), want(n * p);
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < n; ++i) want[r * n + i] = uint16_t(0x3f00 + 16 * r + i);
  for (int64_t i = 0; i < n; ++i) mine[i] = want[me * n + i];
  Dev<uint16_t> s(mine), r(n * p);
  nccl().all_gather_async(s.t(DType::kBF16), r.t(DType::kBF16))->wait();
  EXPECT_EQ(r.get(), want);
}

// bf16 reductions (communicator.h): integers in (-32, 32) sum exactly over up to 8 ranks (every
// partial sum is a bf16), real-valued sums are within ((1 + 2^-8)^(P-1) - 1) * sum |x_r| of the
// f64 sum, and max is exact; through all_reduce and reduce_scatter.
TEST_P(NcclSizes, Bf16ReductionsRoundPairwise) {
  NEED_GPUS();
  const int64_t n = GetParam();
  const int p = world().size(), me = world().rank();
  auto whole = [](int r, int64_t i) { return std::fmod(input_f32(9, r, i), 32.f); };
  auto real = [](int r, int64_t i) {
    return bf16_to_f32(f32_to_bf16(std::sin(0.001f * float(i) + float(r)) * float(1 + r)));
  };
  std::vector<uint16_t> ints(n), reals(p * n), want_sum(n), want_max(n);
  std::vector<double> exact(n, 0.0), magnitude(n, 0.0);
  for (int64_t i = 0; i < n; ++i) {
    ints[i] = f32_to_bf16(whole(me, i));
    float sum = 0.f, max = real(0, i);
    for (int r = 0; r < p; ++r) {
      sum += whole(r, i);
      max = std::max(max, real(r, i));
      exact[i] += real(r, me * n + i);
      magnitude[i] += std::abs(real(r, me * n + i));
    }
    want_sum[i] = f32_to_bf16(sum);
    want_max[i] = f32_to_bf16(max);
  }
  for (int64_t i = 0; i < p * n; ++i) reals[i] = f32_to_bf16(real(me, i));

  Dev<uint16_t> a(ints), b(std::vector<uint16_t>(reals.begin(), reals.begin() + n)), s(reals), r(n);
  nccl().all_reduce(a.t(DType::kBF16));
  nccl().all_reduce_async(b.t(DType::kBF16), ReduceOp::kMax)->wait();
  nccl().reduce_scatter(s.t(DType::kBF16), r.t(DType::kBF16));
  EXPECT_EQ(a.get(), want_sum);
  EXPECT_EQ(b.get(), want_max);
  const std::vector<uint16_t> got = r.get();
  const double growth = std::pow(1 + 0x1p-8, p - 1) - 1;
  for (int64_t i = 0; i < n; ++i)
    ASSERT_LE(std::abs(bf16_to_f32(got[i]) - exact[i]), growth * magnitude[i]) << "at " << i;
}

TEST_P(NcclSizes, AllToAllTransposesChunks) {
  NEED_GPUS();
  const int64_t n = GetParam();
  const int p = world().size(), me = world().rank();
  std::vector<float> want(n * p);
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < n; ++i) want[r * n + i] = input_f32(3, r, me * n + i);
  Dev<float> s(inputs_f32(3, me, n * p)), r(n * p);
  nccl().all_to_all(s.t(DType::kF32), r.t(DType::kF32));
  EXPECT_EQ(r.get(), want);
}

TEST(Nccl, BroadcastFromEveryRoot) {
  NEED_GPUS();
  for (int root = 0; root < world().size(); ++root) {
    Dev<float> d(inputs_f32(4, world().rank(), 1001));
    nccl().broadcast(d.t(DType::kF32), root);
    EXPECT_EQ(d.get(), inputs_f32(4, root, 1001)) << "root " << root;
  }
}

TEST(Nccl, SendRecvRingVisitsEveryRank) {
  NEED_GPUS();
  const int64_t n = 100003;
  const int p = world().size(), me = world().rank();
  const int next = (me + 1) % p, prev = (me + p - 1) % p;
  Dev<float> a(inputs_f32(5, me, n)), b(n);
  Dev<float>*current = &a, *incoming = &b;
  for (int step = 1; step <= p; ++step) {
    nccl().sendrecv(current->t(DType::kF32), next, incoming->t(DType::kF32), prev);
    std::swap(current, incoming);
    ASSERT_EQ(current->get(), inputs_f32(5, ((me - step) % p + p) % p, n)) << "step " << step;
  }
}

TEST(Nccl, EvenOddBlockingSendRecv) {
  NEED_GPUS();
  const int p = world().size(), me = world().rank();
  if (p < 2) GTEST_SKIP() << "needs a peer";
  const int next = (me + 1) % p, prev = (me + p - 1) % p;
  Dev<float> out(inputs_f32(6, me, 33)), in(33);
  if (me % 2 == 0) {
    nccl().send(out.t(DType::kF32), next);
    nccl().recv(in.t(DType::kF32), prev);
  } else {
    nccl().recv(in.t(DType::kF32), prev);
    nccl().send(out.t(DType::kF32), next);
  }
  EXPECT_EQ(in.get(), inputs_f32(6, prev, 33));
}

TEST(Nccl, HostTensorsAreStaged) {
  NEED_GPUS();
  const int p = world().size(), me = world().rank();
  int32_t flag = me == p - 1 ? 7 : 0;
  nccl().all_reduce(Tensor(&flag, DType::kI32, {1}, MemPool::kHost), ReduceOp::kMax);
  EXPECT_EQ(flag, 7);
  std::vector<float> all(3 * p, -1.f);
  for (int i = 0; i < 3; ++i) all[me * 3 + i] = float(10 * me + i);
  nccl().all_gather(Tensor(all.data() + me * 3, DType::kF32, {3}, MemPool::kHost),
                    Tensor(all.data(), DType::kF32, {3 * int64_t(p)}, MemPool::kHost));
  for (int r = 0; r < p; ++r)
    for (int i = 0; i < 3; ++i) EXPECT_EQ(all[r * 3 + i], float(10 * r + i));
  nccl().barrier();
}

// Host tensors larger than the communicator's 1 MiB of device staging: all_reduce, broadcast and
// send/recv move them in pieces; the other collectives refuse them, naming the fix.
TEST(Nccl, LargeHostTensorsMoveInPiecesOrAreRefused) {
  NEED_GPUS();
  const int p = world().size(), me = world().rank();
  const int64_t n = 600001;  // 2.4 MB of f32: three pieces
  std::vector<float> sum = inputs_f32(20, me, n);
  nccl().all_reduce(Tensor(sum.data(), DType::kF32, {n}, MemPool::kHost));
  std::vector<float> want(size_t(n), 0.f);
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < n; ++i) want[size_t(i)] += input_f32(20, r, i);
  EXPECT_EQ(sum, want);

  std::vector<float> cast = me == p - 1 ? inputs_f32(21, me, n) : std::vector<float>(n, 0.f);
  nccl().broadcast(Tensor(cast.data(), DType::kF32, {n}, MemPool::kHost), p - 1);
  EXPECT_EQ(cast, inputs_f32(21, p - 1, n));

  if (p > 1) {  // a ring: even ranks send first, odd ranks receive first
    const int next = (me + 1) % p, prev = (me + p - 1) % p;
    std::vector<float> out = inputs_f32(22, me, n), in(size_t(n), 0.f);
    const Tensor send(out.data(), DType::kF32, {n}, MemPool::kHost);
    const Tensor recv(in.data(), DType::kF32, {n}, MemPool::kHost);
    if (me % 2 == 0) {
      nccl().send(send, next);
      nccl().recv(recv, prev);
    } else {
      nccl().recv(recv, prev);
      nccl().send(send, next);
    }
    EXPECT_EQ(in, inputs_f32(22, prev, n));
  }

  std::vector<float> mine(size_t(n), 1.f), all(size_t(n) * size_t(p), 0.f);
  try {
    nccl().all_gather(Tensor(mine.data(), DType::kF32, {n}, MemPool::kHost),
                      Tensor(all.data(), DType::kF32, {n * p}, MemPool::kHost));
    ADD_FAILURE() << "a host all_gather over the staging was taken";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("pass device tensors"), std::string::npos) << e.what();
  }
  nccl().barrier();
}

// What NCCL takes for a communicator is measured while it is made (the collectives'
// connections made then) and while connect_peers makes its point-to-point pairs: its staging
// at least, and the first collectives and transfers add less than the measure.
TEST(Nccl, TransportMemoryIsMeasuredWhenTheCommunicatorIsMade) {
  NEED_GPUS();
  const int p = world().size(), me = world().rank();
  EXPECT_GE(nccl().transport_device_bytes(), int64_t(1) << 20);
  auto all = nccl().split(0, me, "measured");
  const int64_t at_creation = all->transport_device_bytes();
  EXPECT_GE(at_creation, int64_t(1) << 20);
  connect_all_peers(*all);
  const int64_t made = all->transport_device_bytes();
  if (p > 1) {
    EXPECT_GT(made, at_creation);  // point-to-point pairs took memory of their own
  }
  const int64_t n = 1 << 20;
  Dev<float> d(inputs_f32(23, me, n)), out(n);
  size_t free_b = 0, total_b = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
  const int64_t before = int64_t(total_b - free_b);
  all->all_reduce(d.t(DType::kF32));
  all->all_to_all(d.t(DType::kF32, 0, n / p * p), out.t(DType::kF32, 0, n / p * p));
  all->sendrecv(d.t(DType::kF32), (me + 1) % p, out.t(DType::kF32), (me + p - 1) % p);
  all->barrier();
  ASSERT_EQ(cudaMemGetInfo(&free_b, &total_b), cudaSuccess);
  const int64_t later = int64_t(total_b - free_b) - before;
  std::cout << "rank " << me << ": world " << nccl().transport_device_bytes() << " B; a copy of "
            << "it " << at_creation << " B at creation, " << made << " B with its pairs "
            << "connected; the first collectives and transfers added " << later << " B\n";
  EXPECT_LT(later, made);
}

// The grid's step scalars: f64 sums and i64 counts, exact past f32's and i32's range.
TEST(Nccl, F64AndI64HostScalarsReduceExactly) {
  NEED_GPUS();
  const int p = world().size(), me = world().rank();
  double loss[2] = {16777216.0 + 0.25 * (me + 1), 1e300};
  int64_t tokens = (int64_t{1} << 33) + me;
  nccl().all_reduce(Tensor(loss, DType::kF64, {2}, MemPool::kHost));
  nccl().all_reduce(Tensor(&tokens, DType::kI64, {1}, MemPool::kHost));
  EXPECT_EQ(loss[0], 16777216.0 * p + 0.25 * p * (p + 1) / 2);
  EXPECT_DOUBLE_EQ(loss[1], 1e300 * p);
  EXPECT_EQ(tokens, (int64_t{1} << 33) * p + int64_t(p) * (p - 1) / 2);
}

// The compute stream's last write (a copy still queued when the collective starts) is what
// the collective reads.
TEST(Nccl, OrderedAfterTheComputeStream) {
  NEED_GPUS();
  const int64_t n = 1 << 22;
  const int p = world().size(), me = world().rank();
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  float* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, n * sizeof(float)), cudaSuccess);
  for (int64_t i = 0; i < n; ++i) pinned[i] = float(me + 1);
  Dev<float> d(n);
  ASSERT_EQ(cudaMemcpyAsync(d.p, pinned, n * sizeof(float), cudaMemcpyHostToDevice, s),
            cudaSuccess);
  nccl().set_compute_stream(s);
  nccl().all_reduce(d.t(DType::kF32));
  nccl().set_compute_stream(nullptr);
  const auto got = d.get();
  const float want = float(p * (p + 1) / 2);
  for (int64_t i = 0; i < n; i += 4099) ASSERT_EQ(got[i], want) << i;
  cudaFreeHost(pinned);
  cudaStreamDestroy(s);
}

void hold_stream(void* ms) {  // a host function on a stream: nothing after it runs meanwhile
  std::this_thread::sleep_for(std::chrono::milliseconds(*static_cast<int*>(ms)));
}

// On the thread that set the compute stream, a blocking collective on device tensors is a
// stream dependency: it returns while the compute stream is still held, and the compute
// stream's later work reads its result. On another thread (ZeRO's worker) the host waits.
TEST(Nccl, TheComputeThreadsWaitIsAStreamDependency) {
  NEED_GPUS();
  const int64_t n = 1 << 20;
  const int p = world().size(), me = world().rank();
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  float* out = nullptr;
  ASSERT_EQ(cudaMallocHost(&out, n * sizeof(float)), cudaSuccess);
  Dev<float> d(std::vector<float>(n, float(me + 1))), w(std::vector<float>(n, float(me + 2)));
  int hold_ms = 500;
  nccl().set_compute_stream(s);
  ASSERT_EQ(cudaLaunchHostFunc(s, hold_stream, &hold_ms), cudaSuccess);
  nccl().all_reduce(d.t(DType::kF32));
  // Still held: had the host waited for the all_reduce, which starts after the hold, the
  // stream would have drained.
  EXPECT_EQ(cudaStreamQuery(s), cudaErrorNotReady);
  ASSERT_EQ(cudaMemcpyAsync(out, d.p, n * sizeof(float), cudaMemcpyDeviceToHost, s), cudaSuccess);
  // Another thread: its all_reduce starts after the compute stream's work and returns once done.
  std::thread worker([&] {
    EXPECT_EQ(cudaSetDevice(nccl().local_rank()), cudaSuccess);
    nccl().all_reduce(w.t(DType::kF32));
    const auto got = w.get();  // the legacy stream does not wait for NCCL's: the host did
    EXPECT_EQ(got[0], float(p * (p + 3) / 2));
    EXPECT_EQ(got[n - 1], float(p * (p + 3) / 2));
  });
  worker.join();
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  nccl().set_compute_stream(nullptr);
  const float want = float(p * (p + 1) / 2);
  for (int64_t i = 0; i < n; i += 4099) ASSERT_EQ(out[i], want) << i;
  cudaFreeHost(out);
  cudaStreamDestroy(s);
}

TEST(Nccl, SplitByParityAndGroupsOfOneCopyOnTheDevice) {
  NEED_GPUS();
  const int p = world().size(), me = world().rank();
  auto half = nccl().split(me % 2, me, "parity");
  EXPECT_EQ(half->backend(), "nccl");
  EXPECT_EQ(half->size(), (p - me % 2 + 1) / 2);
  Dev<float> d(inputs_f32(7, me, 17));
  half->all_reduce(d.t(DType::kF32));
  std::vector<float> want(17, 0.f);
  for (int r = me % 2; r < p; r += 2)
    for (int i = 0; i < 17; ++i) want[i] += input_f32(7, r, i);
  EXPECT_EQ(d.get(), want);

  auto alone = nccl().split(me, 0, "alone");
  ASSERT_EQ(alone->size(), 1);
  Dev<float> s(inputs_f32(8, me, 29)), r(29);
  alone->all_gather(s.t(DType::kF32), r.t(DType::kF32));  // the size-1 path: a device copy
  EXPECT_EQ(r.get(), inputs_f32(8, me, 29));
}

// The trainer's thread and ZeRO's worker, each on a communicator of its own split from one
// world, issuing collectives at the same time: the world's enqueue lock lets one thread enqueue
// at a time (NCCL forbids parallel issue to communicators on one device), and every result is
// right.
TEST(Nccl, TwoThreadsOnTwoCommunicatorsEnqueueOneAtATime) {
  NEED_GPUS();
  const int p = world().size(), me = world().rank();
  auto tp = nccl().split(0, me, "tp"), dp = nccl().split(0, me, "dp");
  const auto work = [&](Communicator& c, uint64_t seed, std::vector<float>& got) {
    EXPECT_EQ(cudaSetDevice(c.local_rank()), cudaSuccess);  // the worker thread's device too
    Dev<float> d(inputs_f32(seed, me, 1000));
    for (int i = 0; i < 40; ++i) c.all_reduce(d.t(DType::kF32), ReduceOp::kMax);
    got = d.get();
  };
  std::vector<float> got_tp, got_dp;
  std::thread worker([&] { work(*dp, 31, got_dp); });
  work(*tp, 30, got_tp);
  worker.join();
  const auto check = [&](uint64_t seed, const std::vector<float>& got) {
    std::vector<float> want(1000, -1e30f);
    for (int r = 0; r < p; ++r)
      for (int i = 0; i < 1000; ++i) want[i] = std::max(want[i], input_f32(seed, r, i));
    EXPECT_EQ(got, want) << "seed " << seed;
  };
  check(30, got_tp);
  check(31, got_dp);
}

// One thread polls an op nobody joins while another thread's op on the same communicator times
// out and aborts it: ncclCommAbort runs under the communicator's lock, and the poller, which
// re-checks after taking it, fails with an Error instead of reading a freed communicator.
TEST(Nccl, AnAbortWhileAnotherThreadPollsIsACleanError) {
  NEED_GPUS();
  if (world().size() < 2) GTEST_SKIP() << "needs a peer";
  CommOptions quick;
  quick.timeout_s = 2;
  auto comm = make_nccl_world(&world(), quick);
  if (world().rank() == 0) {
    Dev<float> a(8), b(8);
    std::string first, second;
    auto pending = comm->all_reduce_async(a.t(DType::kF32));
    std::thread poller([&] {
      try {
        pending->wait();
      } catch (const Error& e) {
        first = e.what();
      }
    });
    try {
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      comm->all_reduce(b.t(DType::kF32));
    } catch (const Error& e) {
      second = e.what();
    }
    poller.join();
    EXPECT_FALSE(first.empty());
    EXPECT_FALSE(second.empty());
    EXPECT_TRUE(first.find("aborted") != std::string::npos ||
                second.find("aborted") != std::string::npos)
        << first << "\n"
        << second;
    EXPECT_THROW(comm->barrier(), Error);
  }
  world().barrier();
}

// Rank 0 calls a collective nobody else joins; its timeout names it and aborts the
// communicator, which then refuses further use. (It leaves a collective that never ran: last.)
TEST(Nccl, AHungCollectiveTimesOutNamingTheRank) {
  NEED_GPUS();
  if (world().size() < 2) GTEST_SKIP() << "needs a peer";
  CommOptions quick;
  quick.timeout_s = 2;
  auto comm = make_nccl_world(&world(), quick);
  if (world().rank() == 0) {
    Dev<float> d(8);
    try {
      comm->all_reduce(d.t(DType::kF32));
      ADD_FAILURE() << "expected a timeout";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 0 of"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("did not complete within 2 s"), std::string::npos)
          << e.what();
    }
    EXPECT_THROW(comm->barrier(), Error);
  }
  world().barrier();
}

}  // namespace
}  // namespace shardlm
