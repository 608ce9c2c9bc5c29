// Every Communicator op, under MPI and over TCP (tests/CMakeLists.txt), against a reference
// computed locally: each rank can generate every rank's input from (seed, rank, index), so it knows
// the exact expected result. Inputs are small integers stored as floats, so sums are exact in any
// reduction order and compared with
// ==. Runs at 1, 2 and 4 ranks (tests/CMakeLists.txt). The bf16 reductions, which round, are in
// test_comm_bf16.cpp.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <thread>
#include <vector>

#include "parallel/comm_inputs.h"
#include "shardlm/comm/communicator.h"

namespace shardlm {
namespace {

using namespace test;

int32_t input_i32(uint64_t seed, int rank, int64_t i) {
  return static_cast<int32_t>(mix(seed ^ mix(static_cast<uint64_t>(rank) << 40 ^ i)) % 2000001) -
         1000000;
}

std::vector<uint16_t> inputs_bf16(uint64_t seed, int rank, int64_t n) {
  std::vector<uint16_t> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = f32_to_bf16(input_f32(seed, rank, i) + 0.25f * i);
  return v;
}

Tensor i32_view(std::vector<int32_t>& v) {
  return Tensor(v.data(), DType::kI32, {static_cast<int64_t>(v.size())});
}

// Element counts per rank: the degenerate single element, an odd size that no algorithm splits
// evenly, and a large odd size that makes MPI pipeline (segments, rendezvous protocol).
class CommSizes : public ::testing::TestWithParam<int64_t> {};
INSTANTIATE_TEST_SUITE_P(Comm, CommSizes, ::testing::Values(1, 7, 1000003));

TEST(World, MatchesTheLauncher) {
  Communicator& w = world();
  const bool mpi = world_launch() == "mpi";
  EXPECT_EQ(w.backend(), world_launch());
  EXPECT_EQ(w.name(), "world");
  EXPECT_EQ(w.size(), std::atoi(std::getenv(mpi ? "OMPI_COMM_WORLD_SIZE" : "WORLD_SIZE")));
  EXPECT_EQ(w.rank(), std::atoi(std::getenv(mpi ? "OMPI_COMM_WORLD_RANK" : "RANK")));
  EXPECT_EQ(w.local_rank(),
            std::atoi(std::getenv(mpi ? "OMPI_COMM_WORLD_LOCAL_RANK" : "LOCAL_RANK")));
  // Every rank of these tests runs on this machine: the node holds the whole world.
  EXPECT_EQ(w.local_size(), w.size());
  EXPECT_EQ(w.local_size(),
            std::atoi(std::getenv(mpi ? "OMPI_COMM_WORLD_LOCAL_SIZE" : "LOCAL_WORLD_SIZE")));
  w.barrier();
}

// ---- all_reduce -------------------------------------------------------------------------------

TEST_P(CommSizes, AllReduceSumF32) {
  const int64_t n = GetParam();
  std::vector<float> buf = inputs_f32(1, world().rank(), n), want(n, 0.f);
  for (int r = 0; r < world().size(); ++r)
    for (int64_t i = 0; i < n; ++i) want[i] += input_f32(1, r, i);
  world().all_reduce(f32_view(buf));
  EXPECT_TRUE(same(buf, want));
}

TEST_P(CommSizes, AllReduceMaxF32) {
  const int64_t n = GetParam();
  std::vector<float> buf = inputs_f32(2, world().rank(), n), want = inputs_f32(2, 0, n);
  for (int r = 1; r < world().size(); ++r)
    for (int64_t i = 0; i < n; ++i) want[i] = std::max(want[i], input_f32(2, r, i));
  world().all_reduce(f32_view(buf), ReduceOp::kMax);
  EXPECT_TRUE(same(buf, want));
}

TEST(AllReduce, SumAndMinI32) {
  const int64_t n = 7;
  std::vector<int32_t> sum(n), min(n), want_sum(n, 0), want_min(n, INT32_MAX);
  for (int64_t i = 0; i < n; ++i) sum[i] = min[i] = input_i32(3, world().rank(), i);
  for (int r = 0; r < world().size(); ++r) {
    for (int64_t i = 0; i < n; ++i) {
      want_sum[i] += input_i32(3, r, i);
      want_min[i] = std::min(want_min[i], input_i32(3, r, i));
    }
  }
  world().all_reduce(i32_view(sum));
  world().all_reduce(i32_view(min), ReduceOp::kMin);
  EXPECT_TRUE(same(sum, want_sum));
  EXPECT_TRUE(same(min, want_min));
}

// f64 and i64 stay exact where f32 and i32 cannot: token counts past 2^31, sums past 2^24
// with a fractional part, and the extremes of each type through max and min.
TEST(AllReduce, F64AndI64AreExactBeyondF32AndI32) {
  const int rank = world().rank(), size = world().size();
  std::vector<int64_t> counts = {(int64_t{1} << 40) + rank, -(int64_t{3} << 33) * (rank + 1),
                                 INT64_MAX - 8 + rank};
  std::vector<double> sums = {double(int64_t{1} << 30) + 0.125 * (rank + 1), 1e300 * (rank + 1),
                              -0.5 - rank};
  std::vector<int64_t> most = counts;
  world().all_reduce(Tensor(counts.data(), DType::kI64, {2}));  // the first two: sums
  world().all_reduce(Tensor(sums.data(), DType::kF64, {3}));
  world().all_reduce(Tensor(most.data(), DType::kI64, {3}), ReduceOp::kMax);
  int64_t want_counts[2] = {0, 0};
  double want_sums[3] = {0, 0, 0};
  for (int r = 0; r < size; ++r) {
    want_counts[0] += (int64_t{1} << 40) + r;
    want_counts[1] += -(int64_t{3} << 33) * (r + 1);
    want_sums[0] += double(int64_t{1} << 30) + 0.125 * (r + 1);
    want_sums[1] += 1e300 * (r + 1);
    want_sums[2] += -0.5 - r;
  }
  EXPECT_EQ(counts[0], want_counts[0]);
  EXPECT_EQ(counts[1], want_counts[1]);
  EXPECT_EQ(counts[2], INT64_MAX - 8 + rank);  // outside the reduced range: untouched
  EXPECT_EQ(sums[0], want_sums[0]);            // exact: every partial sum is representable
  EXPECT_DOUBLE_EQ(sums[1], want_sums[1]);
  EXPECT_EQ(sums[2], want_sums[2]);
  EXPECT_EQ(most[2], INT64_MAX - 8 + (size - 1));
  EXPECT_EQ(most[0], (int64_t{1} << 40) + size - 1);
}

// Real-valued inputs: the sum depends on MPI's order, so compare with an f64 reference.
TEST(AllReduce, RealValuedSumIsCloseToF64Reference) {
  const int64_t n = 10007;
  auto real = [](int r, int64_t i) { return std::sin(0.001 * i + r) * (1 + r); };
  std::vector<float> buf(n);
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(real(world().rank(), i));
  world().all_reduce(f32_view(buf));
  for (int64_t i = 0; i < n; ++i) {
    double want = 0;
    for (int r = 0; r < world().size(); ++r) want += static_cast<float>(real(r, i));
    ASSERT_NEAR(buf[i], want, 1e-5 * (1 + std::abs(want))) << "at " << i;
  }
}

// ---- reduce_scatter <-> all_gather ------------------------------------------------------------

TEST_P(CommSizes, ReduceScatterSumF32) {
  const int64_t n = GetParam();
  const int p = world().size(), me = world().rank();
  std::vector<float> send = inputs_f32(4, me, p * n), recv(n, -1.f), want(n, 0.f);
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < n; ++i) want[i] += input_f32(4, r, me * n + i);
  world().reduce_scatter(f32_view(send), f32_view(recv));
  EXPECT_TRUE(same(recv, want));
}

TEST_P(CommSizes, AllGatherF32) {
  const int64_t n = GetParam();
  const int p = world().size();
  std::vector<float> send = inputs_f32(5, world().rank(), n), recv(p * n, -1.f), want(p * n);
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < n; ++i) want[r * n + i] = input_f32(5, r, i);
  world().all_gather(f32_view(send), f32_view(recv));
  EXPECT_TRUE(same(recv, want));
}

TEST_P(CommSizes, AllGatherBf16MovesBytes) {
  const int64_t n = GetParam();
  const int p = world().size();
  std::vector<uint16_t> send = inputs_bf16(6, world().rank(), n), recv(p * n, 0), want;
  for (int r = 0; r < p; ++r) {
    const std::vector<uint16_t> part = inputs_bf16(6, r, n);
    want.insert(want.end(), part.begin(), part.end());
  }
  world().all_gather(bf16_view(send), bf16_view(recv));
  EXPECT_TRUE(same(recv, want));
}

// The ZeRO round trip: reduce-scatter into this rank's chunk of a flat buffer, then gather the
// chunks in place, equals an all_reduce of the whole buffer.
TEST_P(CommSizes, ReduceScatterThenAllGatherInPlaceIsAllReduce) {
  const int64_t n = GetParam();
  const int p = world().size(), me = world().rank();
  std::vector<float> grads = inputs_f32(7, me, p * n), want = grads, flat(p * n, -1.f);
  world().all_reduce(f32_view(want));
  const Tensor shard = f32_view(flat).rows(me * n, n);  // [n], this rank's chunk of flat
  world().reduce_scatter(f32_view(grads), shard);
  world().all_gather(shard, f32_view(flat));
  EXPECT_TRUE(same(flat, want));
}

// ---- all_to_all -------------------------------------------------------------------------------

TEST_P(CommSizes, AllToAllF32AndBack) {
  const int64_t n = GetParam();
  const int p = world().size(), me = world().rank();
  std::vector<float> send = inputs_f32(8, me, p * n), recv(p * n, -1.f), want(p * n);
  for (int r = 0; r < p; ++r)
    for (int64_t i = 0; i < n; ++i) want[r * n + i] = input_f32(8, r, me * n + i);
  world().all_to_all(f32_view(send), f32_view(recv));
  EXPECT_TRUE(same(recv, want));
  // Its own adjoint: applying it again restores every rank's input.
  std::vector<float> back(p * n, -1.f);
  world().all_to_all(f32_view(recv), f32_view(back));
  EXPECT_TRUE(same(back, send));
}

TEST(AllToAll, Bf16) {
  const int64_t n = 5;
  const int p = world().size(), me = world().rank();
  std::vector<uint16_t> send = inputs_bf16(9, me, p * n), recv(p * n, 0), want(p * n);
  for (int r = 0; r < p; ++r) {
    const std::vector<uint16_t> theirs = inputs_bf16(9, r, p * n);
    for (int64_t i = 0; i < n; ++i) want[r * n + i] = theirs[me * n + i];
  }
  world().all_to_all(bf16_view(send), bf16_view(recv));
  EXPECT_TRUE(same(recv, want));
}

// ---- broadcast --------------------------------------------------------------------------------

TEST(Broadcast, FromEveryRoot) {
  const int64_t n = 1001;
  for (int root = world().size() - 1; root >= 0; --root) {
    std::vector<float> buf =
        world().rank() == root ? inputs_f32(10 + root, root, n) : std::vector<float>(n, -1.f);
    world().broadcast(f32_view(buf), root);
    EXPECT_TRUE(same(buf, inputs_f32(10 + root, root, n))) << "root " << root;

    std::vector<uint16_t> half =
        world().rank() == root ? inputs_bf16(20, root, 7) : std::vector<uint16_t>(7, 0);
    world().broadcast(bf16_view(half), root);
    EXPECT_TRUE(same(half, inputs_bf16(20, root, 7))) << "root " << root;
  }
}

// ---- send <-> recv ----------------------------------------------------------------------------

// Pass every rank's block once around the ring (size steps) with async ops, as ring attention
// does; afterwards each rank holds its own block again, having seen every other on the way.
TEST(SendRecv, RingAsyncVisitsEveryRank) {
  const int64_t n = 100003;
  const int p = world().size(), me = world().rank();
  const int next = (me + 1) % p, prev = (me + p - 1) % p;
  std::vector<float> current = inputs_f32(30, me, n), incoming(n);
  for (int step = 1; step <= p; ++step) {
    auto r = world().recv_async(f32_view(incoming), prev, step);
    auto s = world().send_async(f32_view(current), next, step);
    r->wait();
    s->wait();
    std::swap(current, incoming);
    const int owner = ((me - step) % p + p) % p;
    ASSERT_TRUE(same(current, inputs_f32(30, owner, n))) << "step " << step;
  }
}

// sendrecv is one ring step: every rank sends to the next and receives from the previous.
TEST(SendRecv, SendRecvRingVisitsEveryRank) {
  const int64_t n = 1001;
  const int p = world().size(), me = world().rank();
  const int next = (me + 1) % p, prev = (me + p - 1) % p;
  std::vector<float> current = inputs_f32(31, me, n), incoming(n);
  for (int step = 1; step <= p; ++step) {
    if (step % 2)
      world().sendrecv(f32_view(current), next, f32_view(incoming), prev, step);
    else
      world().sendrecv_async(f32_view(current), next, f32_view(incoming), prev, step)->wait();
    std::swap(current, incoming);
    const int owner = ((me - step) % p + p) % p;
    ASSERT_TRUE(same(current, inputs_f32(31, owner, n))) << "step " << step;
  }
}

// Blocking send/recv in the even/odd order that cannot deadlock.
TEST(SendRecv, BlockingEvenOddPairs) {
  const int p = world().size(), me = world().rank();
  if (p < 2) GTEST_SKIP() << "needs a peer";
  const int next = (me + 1) % p, prev = (me + p - 1) % p;
  std::vector<int32_t> out(3), in(3, 0), want(3);
  for (int i = 0; i < 3; ++i) out[i] = 100 * me + i, want[i] = 100 * prev + i;
  if (me % 2 == 0) {
    world().send(i32_view(out), next, 7);
    world().recv(i32_view(in), prev, 7);
  } else {
    world().recv(i32_view(in), prev, 7);
    world().send(i32_view(out), next, 7);
  }
  EXPECT_TRUE(same(in, want));
}

TEST(SendRecv, ElementCountMismatchIsAnError) {
  const int p = world().size(), me = world().rank();
  if (p < 2) GTEST_SKIP() << "needs a peer";
  std::vector<float> seven(7, 1.f), eight(8, 0.f);
  if (me == 0) world().send(f32_view(seven), 1, 3);
  if (me == 1) {
    try {
      world().recv(f32_view(eight), 0, 3);
      ADD_FAILURE() << "a recv of 8 matched with a send of 7 did not throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("7 elements"), std::string::npos) << e.what();
    }
  }
  world().barrier();
}

// ---- async ------------------------------------------------------------------------------------

// Several ops in flight at once, local work between them, completion polled with test() and
// waited in a different order from the one they were started in.
TEST(Async, SeveralInFlightOverlapWithLocalWork) {
  const int64_t n = 1000003;
  const int p = world().size(), me = world().rank();
  std::vector<float> a = inputs_f32(40, me, n), want_a(n, 0.f);
  std::vector<float> rs_send = inputs_f32(41, me, p * 7), rs_recv(7), want_rs(7, 0.f);
  std::vector<float> ag_send = inputs_f32(42, me, 7), ag_recv(p * 7), want_ag(p * 7);
  std::vector<int32_t> mx(3), want_mx(3, INT32_MIN);
  for (int i = 0; i < 3; ++i) mx[i] = input_i32(43, me, i);
  for (int r = 0; r < p; ++r) {
    for (int64_t i = 0; i < n; ++i) want_a[i] += input_f32(40, r, i);
    for (int64_t i = 0; i < 7; ++i) want_rs[i] += input_f32(41, r, me * 7 + i);
    for (int64_t i = 0; i < 7; ++i) want_ag[r * 7 + i] = input_f32(42, r, i);
    for (int i = 0; i < 3; ++i) want_mx[i] = std::max(want_mx[i], input_i32(43, r, i));
  }

  auto h_a = world().all_reduce_async(f32_view(a));
  auto h_rs = world().reduce_scatter_async(f32_view(rs_send), f32_view(rs_recv));
  auto h_ag = world().all_gather_async(f32_view(ag_send), f32_view(ag_recv));
  auto h_mx = world().all_reduce_async(i32_view(mx), ReduceOp::kMax);

  // Local work that touches none of the buffers in flight, polling now and then.
  double acc = 0;
  int polls_done = 0;
  for (int step = 0; step < 200; ++step) {
    for (int i = 0; i < 20000; ++i) acc += std::sqrt(static_cast<double>(i + step));
    polls_done += h_ag->test() ? 1 : 0;
  }
  EXPECT_GT(acc, 0);

  h_mx->wait();
  h_ag->wait();
  EXPECT_TRUE(h_ag->test());
  h_rs->wait();
  while (!h_a->test()) {
  }
  h_a->wait();
  EXPECT_TRUE(same(a, want_a));
  EXPECT_TRUE(same(rs_recv, want_rs));
  EXPECT_TRUE(same(ag_recv, want_ag));
  EXPECT_TRUE(same(mx, want_mx));
}

TEST(Async, DestroyingAnUnfinishedHandleWaitsForIt) {
  std::vector<float> buf = inputs_f32(50, world().rank(), 1000), want(1000, 0.f);
  for (int r = 0; r < world().size(); ++r)
    for (int64_t i = 0; i < 1000; ++i) want[i] += input_f32(50, r, i);
  { auto handle = world().all_reduce_async(f32_view(buf)); }
  EXPECT_TRUE(same(buf, want));
}

// ---- split ------------------------------------------------------------------------------------

// A 2x2 grid: rows {0,1}, {2,3} and columns {0,2}, {1,3}.
TEST(Split, GridRowsAndColumns2x2) {
  if (world().size() != 4) GTEST_SKIP() << "the 2x2 grid needs 4 ranks";
  const int me = world().rank(), row = me / 2, col = me % 2;
  auto rows = world().split(row, col, "row");
  auto cols = world().split(col, row, "col");
  EXPECT_EQ(rows->name(), "world/row");
  EXPECT_EQ(rows->size(), 2);
  EXPECT_EQ(rows->rank(), col);
  EXPECT_EQ(cols->size(), 2);
  EXPECT_EQ(cols->rank(), row);

  std::vector<float> x = inputs_f32(60, me, 1001), want_row(1001), want_col(1001);
  for (int64_t i = 0; i < 1001; ++i) {
    want_row[i] = input_f32(60, 2 * row, i) + input_f32(60, 2 * row + 1, i);
    want_col[i] = input_f32(60, col, i) + input_f32(60, col + 2, i);
  }
  std::vector<float> y = x;
  rows->all_reduce(f32_view(x));
  cols->all_reduce(f32_view(y));
  EXPECT_TRUE(same(x, want_row));
  EXPECT_TRUE(same(y, want_col));

  std::vector<int32_t> mine = {me}, members(2);
  cols->all_gather(i32_view(mine), i32_view(members));
  EXPECT_TRUE(same(members, std::vector<int32_t>{col, col + 2}));
  rows->broadcast(i32_view(mine), 1);
  EXPECT_EQ(mine[0], 2 * row + 1);
}

// Any size: groups by parity, ordered by descending world rank (key = -rank).
TEST(Split, ByParityWithReversedKeys) {
  const int p = world().size(), me = world().rank();
  auto sub = world().split(me % 2, -me);
  std::vector<int32_t> want;
  for (int r = p - 1; r >= 0; --r)
    if (r % 2 == me % 2) want.push_back(r);
  ASSERT_EQ(sub->size(), static_cast<int>(want.size()));
  EXPECT_EQ(sub->name(), "world/color" + std::to_string(me % 2));
  std::vector<int32_t> mine = {me}, got(want.size());
  sub->all_gather(i32_view(mine), i32_view(got));
  EXPECT_TRUE(same(got, want));
  // A split of a split, back to ascending order.
  auto again = sub->split(0, -sub->rank());
  std::vector<int32_t> got_again(want.size());
  again->all_gather(i32_view(mine), i32_view(got_again));
  std::reverse(want.begin(), want.end());
  EXPECT_TRUE(same(got_again, want));
}

// ---- threads ----------------------------------------------------------------------------------

// MPI_THREAD_SERIALIZED plus the session lock: two threads may drive two communicators at once.
TEST(Threads, TwoThreadsOnTwoCommunicatorsAtOnce) {
  const int p = world().size(), me = world().rank();
  auto a = world().split(0, me, "a");
  auto b = world().split(0, me, "b");
  const int64_t n = 10007;
  std::vector<float> x = inputs_f32(70, me, n), want_x = inputs_f32(70, 0, n);
  std::vector<float> y = inputs_f32(71, me, n), gathered(p * n), want_y(p * n);
  for (int r = 0; r < p; ++r) {
    for (int64_t i = 0; i < n; ++i) {
      want_x[i] = std::max(want_x[i], input_f32(70, r, i));
      want_y[r * n + i] = input_f32(71, r, i);
    }
  }
  std::thread other([&] {
    for (int k = 0; k < 20; ++k) a->all_reduce(f32_view(x), ReduceOp::kMax);  // idempotent
  });
  for (int k = 0; k < 20; ++k) b->all_gather(f32_view(y), f32_view(gathered));
  other.join();
  EXPECT_TRUE(same(x, want_x));
  EXPECT_TRUE(same(gathered, want_y));
}

// ---- validation -------------------------------------------------------------------------------

// Bad calls fail on every rank, before any transfer, and leave the communicator usable.
TEST(Validation, BadCallsThrowEverywhereAndTheCommunicatorStaysUsable) {
  const int p = world().size();
  std::vector<float> a(p * 3 + 1), b(3);
  std::vector<uint16_t> half(p * 4);
  EXPECT_THROW(world().reduce_scatter(f32_view(a), f32_view(b)), Error);
  EXPECT_THROW(world().all_gather(f32_view(b), f32_view(a)), Error);
  try {
    world().reduce_scatter(bf16_view(half), f32_view(b), ReduceOp::kMax);
    ADD_FAILURE() << "a reduce_scatter from bf16 into f32 did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("send is bf16 but recv is f32"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(world().broadcast(f32_view(b), p), Error);
  EXPECT_THROW(world().send(f32_view(b), 0, Communicator::kMaxTag + 1), Error);
  EXPECT_THROW(world().recv(f32_view(b), p, 0), Error);
  EXPECT_THROW(world().all_to_all(f32_view(a), f32_view(a)), Error);
  EXPECT_THROW(world().split(-1, 0), Error);

  std::vector<float> one = {1.f};
  world().all_reduce(f32_view(one));
  EXPECT_EQ(one[0], static_cast<float>(p));
}

}  // namespace
}  // namespace shardlm
