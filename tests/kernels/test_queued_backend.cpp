// QueuedBackend (backend/queued.h): compute ops wait in their queue until the host needs them
// finished (a result, host memory, an id check, synchronize, a free), then run in call order;
// copies wait on their own queue for their fence; a failing op's error reaches the waiting
// call; marks time stretches of the queue; the planned attention workspace is the inner
// backend's. The op table runs every op through it (test_op_table's QueuedOpTable).
#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/recording_backend.h"
#include "shardlm/backend/queued.h"
#include "shardlm/core/ledger.h"

namespace shardlm {
namespace {

class QueuedBackendTest : public ::testing::Test {
 protected:
  QueuedBackend be{std::make_unique<cpu::CpuBackend>()};
  MemoryLedger ledger;

  Buffer device(int64_t n) {
    return Buffer(be, ledger, MemCategory::kActivations, MemPool::kDevice, size_t(n) * 4);
  }
  static Tensor host(std::vector<float>& v) {
    return Tensor(v.data(), DType::kF32, {int64_t(v.size())}, MemPool::kHost);
  }
};

TEST_F(QueuedBackendTest, DeviceOpsWaitUntilTheHostReadsTheirResult) {
  Buffer a = device(4), b = device(4);
  std::vector<float> one{1, 2, 3, 4}, back(4, 0.f);
  be.copy(host(one), a.view(DType::kF32, {4}));  // host memory: runs before it returns
  be.copy(host(back), b.view(DType::kF32, {4}));
  EXPECT_EQ(be.queued(), 0);
  be.copy(a.view(DType::kF32, {4}), b.view(DType::kF32, {4}));
  be.scale(b.view(DType::kF32, {4}), 2.f);
  EXPECT_EQ(be.queued(), 2);
  // The device buffer is not written yet: a host that read it directly would see stale bytes.
  EXPECT_EQ(b.view(DType::kF32, {4}).f32()[3], 0.f);
  be.copy(b.view(DType::kF32, {4}), host(back));
  EXPECT_EQ(be.queued(), 0);
  EXPECT_EQ(back, (std::vector<float>{2, 4, 6, 8}));
  be.scale(a.view(DType::kF32, {4}), 3.f);
  EXPECT_DOUBLE_EQ(be.sum_squares(a.view(DType::kF32, {4})), 9.0 * (1 + 4 + 9 + 16));
}

TEST_F(QueuedBackendTest, AsyncCopiesToTheHostFinishAtTheirFence) {
  Buffer a = device(3);
  std::vector<float> src{5, 6, 7}, dst(3, 0.f);
  be.copy(host(src), a.view(DType::kF32, {3}));
  const uint64_t first = be.copy_async(a.view(DType::kF32, {3}), host(dst));
  EXPECT_GE(first, 1u);
  EXPECT_EQ(dst, (std::vector<float>(3, 0.f)));  // read before host_wait_fence: not there yet
  be.wait_fence(first);                          // orders device work only
  EXPECT_EQ(dst, (std::vector<float>(3, 0.f)));
  be.host_wait_fence(first);
  EXPECT_EQ(dst, src);
  EXPECT_THROW(be.host_wait_fence(first + 5), Error);
}

TEST_F(QueuedBackendTest, AFreeRunsTheOpsQueuedBeforeIt) {
  std::vector<float> back(2, 0.f);
  Buffer keep = device(2);
  {
    Buffer tmp = device(2);
    std::vector<float> v{1.5f, -2.f};
    be.copy(host(v), tmp.view(DType::kF32, {2}));
    be.copy(tmp.view(DType::kF32, {2}), keep.view(DType::kF32, {2}));
    EXPECT_EQ(be.queued(), 1);
  }  // tmp's memory is returned only after the copy that reads it ran
  EXPECT_EQ(be.queued(), 0);
  be.copy(keep.view(DType::kF32, {2}), host(back));
  EXPECT_EQ(back, (std::vector<float>{1.5f, -2.f}));
}

// An id check is a device's flag, read at the next wait (the CUDA backend's): the call queues,
// and the wait that runs it raises the bad id; the ops queued after it are dropped.
TEST_F(QueuedBackendTest, AnIdCheckIsRaisedByTheNextWait) {
  Buffer table = device(8), out = device(4), ids = device(2);
  std::vector<int32_t> bad{0, 9};  // id 9 is outside a vocabulary of 4
  be.copy(Tensor(bad.data(), DType::kI32, {2}, MemPool::kHost), ids.view(DType::kI32, {2}));
  be.zero(table.view(DType::kF32, {8}));
  be.embedding_forward(ids.view(DType::kI32, {2}), table.view(DType::kF32, {4, 2}),
                       out.view(DType::kF32, {2, 2}));
  be.scale(out.view(DType::kF32, {4}), 2.f);
  EXPECT_EQ(be.queued(), 3);  // the zero, the embedding and the scale
  std::vector<float> back(4, 0.f);
  EXPECT_THROW(be.copy(out.view(DType::kF32, {4}), host(back)), Error);
  EXPECT_EQ(be.queued(), 0);
}

// The host's waits as a device counts them: reads of results and host memory, synchronize(),
// frees, and a host_wait_fence only while a copy up to its fence is still queued.
TEST_F(QueuedBackendTest, CountsTheHostsWaits) {
  Buffer a = device(2), b = device(2);
  std::vector<float> v{1, 2}, back(2, 0.f);
  const int64_t w0 = be.host_waits();
  be.scale(a.view(DType::kF32, {2}), 2.f);
  be.copy(a.view(DType::kF32, {2}), b.view(DType::kF32, {2}));
  EXPECT_EQ(be.host_waits(), w0);  // device work queues
  const uint64_t up = be.copy_async(host(v), a.view(DType::kF32, {2}));
  be.wait_fence(up);
  EXPECT_EQ(be.host_waits(), w0);
  be.host_wait_fence(up);  // the copy was still queued
  EXPECT_EQ(be.host_waits(), w0 + 1);
  be.host_wait_fence(up);  // it has run: no wait
  EXPECT_EQ(be.host_waits(), w0 + 1);
  be.copy(b.view(DType::kF32, {2}), host(back));
  be.synchronize();
  EXPECT_EQ(be.host_waits(), w0 + 3);
}

// An op that fails only when it runs (document spans that disagree with the starts, which the
// CPU kernel checks) is reported by the wait that runs it; the ops queued after it are dropped.
TEST_F(QueuedBackendTest, AFailingOpIsReportedByTheWaitAndDropsTheRest) {
  const int64_t T = 4, H = 1, Dh = 2;
  Buffer qkv = device(3 * T * H * Dh), out = device(T * H * Dh), lse = device(T * H);
  Buffer seg = device(T), starts = device(3);
  const size_t ws_bytes = be.attention_workspace_bytes(1, T, H, H, Dh);
  Buffer ws(be, ledger, MemCategory::kWorkspace, MemPool::kDevice, std::max<size_t>(ws_bytes, 4));
  std::vector<int32_t> one_doc(T, 0), two_docs{0, 2, 4};  // the spans say two, seg_start one
  be.copy(Tensor(one_doc.data(), DType::kI32, {T}, MemPool::kHost), seg.view(DType::kI32, {1, T}));
  be.copy(Tensor(two_docs.data(), DType::kI32, {3}, MemPool::kHost), starts.view(DType::kI32, {3}));
  be.zero(qkv.view(DType::kF32, {3 * T * H * Dh}));
  const Tensor q = qkv.view(DType::kF32, {1, T, H, Dh});
  be.attention_forward(q, q, q, seg.view(DType::kI32, {1, T}), out.view(DType::kF32, {1, T, H, Dh}),
                       lse.view(DType::kF32, {1, H, T}), {ws.data(), ws.bytes()},
                       DocumentSpans{starts.view(DType::kI32, {3}), 2, 2});
  be.scale(out.view(DType::kF32, {T * H * Dh}), 2.f);
  EXPECT_EQ(be.queued(), 3);  // the zero, the attention and the scale
  EXPECT_THROW(be.synchronize(), Error);
  EXPECT_EQ(be.queued(), 0);
  be.synchronize();  // reported once
}

// copy_async runs on its own queue and only when a fence needs it: compute that reads the
// copy's destination without wait_fence sees the old bytes (a bug on a GPU too), with it the
// new ones; a host wait runs the copy without the compute queued after it.
TEST_F(QueuedBackendTest, CopiesRunWhenTheirFenceIsWaitedFor) {
  Buffer a = device(3), b = device(3);
  std::vector<float> src{5, 6, 7}, zeros(3, 0.f), back(3, 0.f);
  be.copy(host(zeros), a.view(DType::kF32, {3}));
  be.copy(host(zeros), b.view(DType::kF32, {3}));
  const uint64_t fa = be.copy_async(host(src), a.view(DType::kF32, {3}));
  be.scale(a.view(DType::kF32, {3}), 2.f);  // no wait_fence: runs before the copy
  be.copy(a.view(DType::kF32, {3}), host(back));
  EXPECT_EQ(back, zeros);
  be.host_wait_fence(fa);
  be.copy(a.view(DType::kF32, {3}), host(back));
  EXPECT_EQ(back, src);

  const uint64_t fb = be.copy_async(host(src), b.view(DType::kF32, {3}));
  be.wait_fence(fb);
  be.scale(b.view(DType::kF32, {3}), 2.f);
  be.copy(b.view(DType::kF32, {3}), host(back));
  EXPECT_EQ(back, (std::vector<float>{10, 12, 14}));

  // The copy reads its source when it runs: a host source written before the fence is waited
  // for is what it copies (a bug on a GPU too).
  std::vector<float> source{1, 1, 1};
  const uint64_t fc = be.copy_async(host(source), a.view(DType::kF32, {3}));
  source = {3, 3, 3};
  be.scale(b.view(DType::kF32, {3}), 0.5f);
  be.host_wait_fence(fc);
  EXPECT_EQ(be.queued(), 1);  // the scale: a host wait for a copy runs no later compute
  be.copy(a.view(DType::kF32, {3}), host(back));
  EXPECT_EQ(back, (std::vector<float>{3, 3, 3}));
}

TEST_F(QueuedBackendTest, MarksTimeTheQueueAsItRuns) {
  Buffer a = device(1 << 16);
  be.zero(a.view(DType::kF32, {1 << 16}));
  const uint64_t begin = be.mark();
  for (int i = 0; i < 50; ++i) be.scale(a.view(DType::kF32, {1 << 16}), 1.f);
  const uint64_t end = be.mark();
  EXPECT_EQ(end, begin + 1);
  EXPECT_GT(be.queued(), 50);
  const double s = be.seconds_between(begin, end);  // waits for the marks to run
  EXPECT_EQ(be.queued(), 0);
  EXPECT_GT(s, 0.0);
  EXPECT_LT(s, 10.0);
  EXPECT_EQ(be.seconds_between(end, end), 0.0);
  for (uint64_t i = 0; i < Backend::kMarksKept; ++i) be.mark();
  EXPECT_THROW(be.seconds_between(begin, end), Error);  // reused since
}

// The planned attention workspace, with the run's windows, reaches the inner backend (the CUDA
// backend builds its cuDNN graphs there); the CPU's is the plain query's.
TEST(QueuedBackendPlan, ThePlannedAttentionWorkspaceReachesTheInnerBackend) {
  auto inner = std::make_unique<test::RecordingBackend>();
  const test::RecordingBackend& rec = *inner;
  inner->workspace = 4096;
  QueuedBackend be{std::move(inner)};
  const std::vector<int64_t> windows{0, 512, 4096};
  EXPECT_EQ(be.attention_plan_workspace_bytes(1, 64, 4, 2, 16, windows), 4096u);
  EXPECT_EQ(rec.planned_windows, windows);
  rec.planned_windows.clear();
  EXPECT_EQ(be.attention_block_plan_workspace_bytes(1, 64, 64, 4, 2, 16, windows), 4096u);
  EXPECT_EQ(rec.planned_windows, windows);
  cpu::CpuBackend cpu;
  EXPECT_EQ(cpu.attention_plan_workspace_bytes(2, 64, 4, 2, 16, windows),
            cpu.attention_workspace_bytes(2, 64, 4, 2, 16));
  EXPECT_EQ(cpu.attention_block_plan_workspace_bytes(2, 32, 64, 4, 2, 16, windows),
            cpu.attention_block_workspace_bytes(2, 32, 64, 4, 2, 16));
}

}  // namespace
}  // namespace shardlm
