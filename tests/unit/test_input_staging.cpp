// InputStaging (src/train/input_staging.h): a micro-batch's inputs go up from two pinned slots
// without the host waiting for the device, and a slot is written again only after the copies
// out of it have run. A backend whose copies run only when waited for stands in for a device
// that is behind: a slot overwritten too early would show in the data that arrives.
#include "train/input_staging.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "shardlm/backend/forwarding.h"
#include "shardlm/core/check.h"
#include "shardlm/plan/plan.h"

namespace shardlm::trainer_detail {
namespace {

// The CPU backend, except that copy_async only queues its copy: it runs when its fence (or a
// later one) is waited for by the host, or at drain(), reading its source then, as a device
// that has not reached the copy yet would.
class LateCopies final : public ForwardingBackend {
 public:
  LateCopies() : ForwardingBackend(make_backend(DeviceKind::kCpu)) {}
  std::string name() const override { return "late copies"; }

  std::vector<uint64_t> device_waits;  // wait_fence's fences, in order
  std::vector<uint64_t> host_waits;    // host_wait_fence's fences, in order

  void wait_fence(uint64_t fence) override { device_waits.push_back(fence); }
  void host_wait_fence(uint64_t fence) override {
    host_waits.push_back(fence);
    run_through(fence);
  }
  void drain() { run_through(issued_); }
  uint64_t pending() const { return issued_ - done_; }

 private:
  struct Copy {
    Tensor src, dst;
  };
  void run(OpFamily, HostWaits, std::function<void()> op) override { op(); }
  uint64_t do_copy_async(const Tensor& src, const Tensor& dst) override {
    queue_.push_back({src, dst});
    return ++issued_;
  }
  void run_through(uint64_t fence) {
    for (; done_ < fence; ++done_) inner().copy(queue_[done_].src, queue_[done_].dst);
  }
  std::vector<Copy> queue_;
  uint64_t issued_ = 0, done_ = 0;
};

// A micro-batch's inputs in the model's layout, in host memory owned by the test.
struct Inputs {
  std::vector<int32_t> tokens, targets, positions, seg_start, doc_starts;
  explicit Inputs(int64_t n)
      : tokens(size_t(n)),
        targets(size_t(n)),
        positions(size_t(n)),
        seg_start(size_t(n)),
        doc_starts(size_t(n + 1)) {}
  BatchInputs view() {
    auto t = [](std::vector<int32_t>& v) {
      return Tensor(v.data(), DType::kI32, {int64_t(v.size())}, MemPool::kHost);
    };
    return {t(tokens), t(targets), t(positions), t(seg_start), t(doc_starts)};
  }
};

// Rows whose every value says which micro-batch, which row and which element it is.
void fill(const BatchInputs& rows, int32_t batch) {
  const Tensor* parts[] = {&rows.tokens, &rows.targets, &rows.positions, &rows.seg_start,
                           &rows.doc_starts};
  for (int p = 0; p < 5; ++p)
    for (int64_t i = 0; i < parts[p]->numel(); ++i)
      parts[p]->i32()[i] = batch * 100000 + p * 1000 + int32_t(i);
}

TEST(InputStaging, SlotsAreLedgeredAsPlanned) {
  LateCopies be;
  MemoryLedger ledger;
  const InputStaging staging(be, ledger, 48);
  EXPECT_EQ(ledger.current(MemPool::kHost, MemCategory::kActivations), input_staging_bytes(48));
  EXPECT_EQ(input_staging_bytes(48), 3 * (5 * 48 + 1) * 4);  // the rows and two slots
  EXPECT_EQ(ledger.current(MemPool::kDevice, MemCategory::kActivations), 0);
}

// Three micro-batches, each to inputs of its own (a pipeline's slots), with the device never
// having run a copy unless the host waited: each arrives exactly, the host waits only for the
// copies two uploads back, and the compute is told to wait for each upload's last copy.
TEST(InputStaging, UploadsWaitOnlyForTheSlotTwoBack) {
  constexpr int64_t n = 12, docs = 3;
  LateCopies be;
  MemoryLedger ledger;
  InputStaging staging(be, ledger, n);
  std::vector<Inputs> dev(3, Inputs(n));
  std::vector<std::vector<int32_t>> sent;
  for (int k = 0; k < 3; ++k) {
    const BatchInputs rows = staging.rows(n);
    fill(rows, k);
    EXPECT_EQ(*(staging.begin() + n), k * 100000 + 1000) << "the targets follow the tokens";
    sent.emplace_back(staging.begin(), staging.begin() + 5 * n + 1);
    staging.upload(be, dev[size_t(k)].view(), docs);
    const uint64_t last = uint64_t(5 * (k + 1));  // five copies an upload
    ASSERT_EQ(be.device_waits.size(), size_t(k + 1));
    EXPECT_EQ(be.device_waits.back(), last);
    // Upload 2 reuses upload 0's slot: it waited for that upload's copies, not upload 1's.
    EXPECT_EQ(be.host_waits.back(), k < 2 ? 0 : uint64_t(5));
    EXPECT_EQ(be.pending(), k < 2 ? last : uint64_t(10));
  }
  be.drain();
  for (int k = 0; k < 3; ++k) {
    const Inputs& d = dev[size_t(k)];
    const std::vector<int32_t>& s = sent[size_t(k)];
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(d.tokens[size_t(i)], s[size_t(i)]) << k;
      ASSERT_EQ(d.targets[size_t(i)], s[size_t(n + i)]) << k;
      ASSERT_EQ(d.positions[size_t(i)], s[size_t(2 * n + i)]) << k;
      ASSERT_EQ(d.seg_start[size_t(i)], s[size_t(3 * n + i)]) << k;
    }
    for (int64_t i = 0; i <= docs; ++i) ASSERT_EQ(d.doc_starts[size_t(i)], s[size_t(4 * n + i)]);
    EXPECT_EQ(d.doc_starts[size_t(docs + 1)], 0) << "only the used document starts go up";
  }
}

// Shorter micro-batches fit the slots (the layout follows the rows' length); longer are refused.
TEST(InputStaging, ShorterBatchesFitLongerAreRefused) {
  LateCopies be;
  MemoryLedger ledger;
  InputStaging staging(be, ledger, 16);
  Inputs small(8);
  fill(staging.rows(8), 7);
  staging.upload(be, small.view(), 0);
  be.drain();
  EXPECT_EQ(small.tokens[5], 7 * 100000 + 5);
  EXPECT_EQ(small.seg_start[5], 7 * 100000 + 3 * 1000 + 5);
  EXPECT_THROW((void)staging.rows(17), Error);
  InputStaging none;
  EXPECT_THROW((void)none.rows(4), Error);
  Inputs four(4);
  EXPECT_THROW(none.upload(be, four.view(), 0), Error);
}

}  // namespace
}  // namespace shardlm::trainer_detail
