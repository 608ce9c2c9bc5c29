// The staged communicator (device tensors through a host staging buffer) over MPI, on the CPU:
// tensors in the "device" pool (host memory here, copied by memcpy) are staged in chunks that
// fit a deliberately tiny slot, so every op runs in many chunks whose sizes are not multiples
// of the slot; results are compared exactly with the references of test_comm.cpp's inputs.
// Also: host tensors pass straight through, sends left in flight advance while the rank blocks
// in a receive, ordered messages keep their order, and the errors. Runs at 1, 2 and 4 ranks.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "parallel/comm_inputs.h"
#include "shardlm/comm/staged.h"

namespace shardlm {
namespace {

using namespace test;

// memcpy for every pool pair (the CPU backend's "device" is host memory); counts its calls.
class CountingCopier final : public DeviceCopier {
 public:
  void copy(const Tensor& src, const Tensor& dst) override {
    ASSERT_EQ(src.bytes(), dst.bytes());
    std::memcpy(dst.data(), src.data(), src.bytes());
    ++calls;
  }
  std::atomic<int64_t> calls{0};
};

// A staged communicator over a split of the world, with kSlots slots of `slot` bytes.
struct Staged {
  explicit Staged(size_t slot = 64)
      : memory(slot * StagedCommunicator::kSlots),
        comm(world().split(0, world().rank(), "staged_host")) {
    comm.attach(copier, memory);
  }
  ~Staged() { comm.detach(); }
  CountingCopier copier;
  std::vector<std::byte> memory;
  StagedCommunicator comm;
};

int64_t chunks(int64_t n, int64_t per_chunk) { return (n + per_chunk - 1) / per_chunk; }

class StagedSizes : public ::testing::TestWithParam<int64_t> {};
INSTANTIATE_TEST_SUITE_P(Staged, StagedSizes, ::testing::Values(1, 16, 1001));

TEST_P(StagedSizes, AllReduceInChunksOfTheSlot) {
  const int64_t n = GetParam();
  Staged s;
  std::vector<float> buf = inputs_f32(11, world().rank(), n), want(n, 0.f);
  for (int r = 0; r < world().size(); ++r)
    for (int64_t i = 0; i < n; ++i) want[i] += input_f32(11, r, i);
  s.comm.all_reduce(f32_view(buf));
  EXPECT_TRUE(same(buf, want));
  // One copy in and one out per chunk of 64 / 4 = 16 elements (size 1: one local copy, none).
  if (world().size() > 1) {
    EXPECT_EQ(s.copier.calls, 2 * chunks(n, 16));
  }
}

TEST_P(StagedSizes, ReduceScatterAllGatherAndAllToAll) {
  const int64_t n = GetParam();
  const int P = world().size(), me = world().rank();
  Staged s;
  std::vector<float> send = inputs_f32(12, me, P * n), recv(n), want(n, 0.f);
  for (int r = 0; r < P; ++r)
    for (int64_t i = 0; i < n; ++i) want[i] += input_f32(12, r, me * n + i);
  s.comm.reduce_scatter(f32_view(send), f32_view(recv));
  EXPECT_TRUE(same(recv, want));

  std::vector<float> mine = inputs_f32(13, me, n), all(P * n), all_want(P * n);
  for (int r = 0; r < P; ++r)
    for (int64_t i = 0; i < n; ++i) all_want[r * n + i] = input_f32(13, r, i);
  s.comm.all_gather(f32_view(mine), f32_view(all));
  EXPECT_TRUE(same(all, all_want));
  // In place: send is recv's own chunk.
  std::vector<float> in_place(P * n, -1.f);
  std::copy(mine.begin(), mine.end(), in_place.begin() + me * n);
  s.comm.all_gather(Tensor(in_place.data() + me * n, DType::kF32, {n}), f32_view(in_place));
  EXPECT_TRUE(same(in_place, all_want));

  std::vector<float> a2a = inputs_f32(14, me, P * n), a2a_recv(P * n), a2a_want(P * n);
  for (int r = 0; r < P; ++r)
    for (int64_t i = 0; i < n; ++i) a2a_want[r * n + i] = input_f32(14, r, me * n + i);
  s.comm.all_to_all(f32_view(a2a), f32_view(a2a_recv));
  EXPECT_TRUE(same(a2a_recv, a2a_want));
}

TEST_P(StagedSizes, BroadcastAndBf16Sum) {
  const int64_t n = GetParam();
  const int P = world().size(), me = world().rank();
  Staged s(40);  // 20 bf16 per chunk: no power of two
  std::vector<float> buf = inputs_f32(15, me, n);
  const int root = P - 1;
  s.comm.broadcast(f32_view(buf), root);
  EXPECT_TRUE(same(buf, inputs_f32(15, root, n)));

  // Small integers: every partial sum is a bf16, so the rounded sum is exact.
  std::vector<uint16_t> b(n), want(n);
  for (int64_t i = 0; i < n; ++i) {
    b[i] = f32_to_bf16(float((me + i) % 5));
    float sum = 0;
    for (int r = 0; r < P; ++r) sum += float((r + i) % 5);
    want[i] = f32_to_bf16(sum);
  }
  s.comm.all_reduce(bf16_view(b));
  EXPECT_TRUE(same(b, want));
}

// Every rank sends three messages ahead to the next rank, then blocks receiving the previous
// rank's three: each send is many chunks, so the receive's wait must advance the sends (a rank
// polling only its receive would deadlock with its peer), and the three arrive in order.
TEST(Staged, SendsInFlightAdvanceWhileBlockedInAReceive) {
  const int P = world().size(), me = world().rank();
  const int next = (me + 1) % P, prev = (me + P - 1) % P;
  Staged s;
  const int64_t n = 777;
  std::vector<std::vector<float>> out(3), in(3, std::vector<float>(n));
  std::vector<std::unique_ptr<CommHandle>> sends;
  for (int m = 0; m < 3; ++m) {
    out[m] = inputs_f32(20 + m, me, n);
    sends.push_back(s.comm.send_async(f32_view(out[m]), next, /*tag=*/5));
  }
  for (int m = 0; m < 3; ++m) {
    s.comm.recv(f32_view(in[m]), prev, 5);
    EXPECT_TRUE(same(in[m], inputs_f32(20 + m, prev, n))) << "message " << m;
  }
  for (auto& h : sends) h->wait();
}

TEST(Staged, SendRecvRingStepWithDifferentSizes) {
  const int P = world().size(), me = world().rank();
  const int next = (me + 1) % P, prev = (me + P - 1) % P;
  Staged s;
  auto length = [](int r) { return int64_t(100 + 37 * r); };
  std::vector<float> out = inputs_f32(30, me, length(me)), in(length(prev));
  auto h = s.comm.sendrecv_async(f32_view(out), next, f32_view(in), prev, 2);
  h->wait();
  EXPECT_TRUE(same(in, inputs_f32(30, prev, length(prev))));
}

TEST(Staged, HostTensorsPassStraightThroughWithoutStaging) {
  // No staging attached: host-pool tensors need none.
  StagedCommunicator comm(world().split(0, world().rank(), "unattached"));
  const int64_t n = 100;
  std::vector<float> buf = inputs_f32(40, world().rank(), n), want(n, 0.f);
  for (int r = 0; r < world().size(); ++r)
    for (int64_t i = 0; i < n; ++i) want[i] += input_f32(40, r, i);
  comm.all_reduce(Tensor(buf.data(), DType::kF32, {n}, MemPool::kHost));
  EXPECT_TRUE(same(buf, want));
  // A device tensor without staging memory is refused, by name, on every rank alike.
  try {
    comm.all_reduce(f32_view(buf));
    if (world().size() > 1) ADD_FAILURE() << "a device tensor was reduced without staging";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no device copier"), std::string::npos) << e.what();
  }
}

TEST(Staged, ASlotTooSmallForOneChunkNamesTheKey) {
  if (world().size() == 1) GTEST_SKIP() << "a group of one never stages a collective";
  Staged s(8);  // all_to_all needs 2 x size pieces of 4 bytes
  std::vector<float> a(2 * world().size()), b(a.size());
  try {
    s.comm.all_to_all(f32_view(a), f32_view(b));
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("parallel.device_comm_staging_kib"), std::string::npos)
        << e.what();
  }
}

TEST(Staged, SplitsShareTheStagingAndName) {
  Staged s;
  const int me = world().rank();
  auto pairs = s.comm.split(me / 2, me, "pairs");
  EXPECT_EQ(pairs->name(), s.comm.name() + "/pairs");
  EXPECT_EQ(pairs->backend(), std::string(world_launch()) + "-staged");
  const int64_t n = 50;
  std::vector<float> buf = inputs_f32(50, me, n), want(n, 0.f);
  for (int r = (me / 2) * 2; r < std::min(world().size(), (me / 2) * 2 + 2); ++r)
    for (int64_t i = 0; i < n; ++i) want[i] += input_f32(50, r, i);
  pairs->all_reduce(f32_view(buf));
  EXPECT_TRUE(same(buf, want));
}

}  // namespace
}  // namespace shardlm
