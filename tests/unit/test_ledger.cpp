// MemoryLedger, Buffer and LedgerCharge: per-category current/peak bytes, the breakdown at the
// pool's peak, budgets that fail before allocating, allocation counting, RAII release.
#include <gtest/gtest.h>

#include "shardlm/backend/backend.h"
#include "shardlm/core/buffer.h"

namespace shardlm {
namespace {

TEST(Ledger, TracksCurrentPeakAndBreakdownAtPeak) {
  MemoryLedger l;
  l.on_alloc(MemCategory::kParams, MemPool::kDevice, 100);
  l.on_alloc(MemCategory::kActivations, MemPool::kDevice, 50);
  l.on_free(MemCategory::kActivations, MemPool::kDevice, 50);
  l.on_alloc(MemCategory::kWorkspace, MemPool::kDevice, 30);
  l.on_alloc(MemCategory::kHostOffload, MemPool::kHost, 7);
  EXPECT_EQ(l.current_total(MemPool::kDevice), 130);
  EXPECT_EQ(l.peak_total(MemPool::kDevice), 150);
  EXPECT_EQ(l.peak(MemPool::kDevice, MemCategory::kActivations), 50);
  EXPECT_EQ(l.peak(MemPool::kDevice, MemCategory::kWorkspace), 30);
  // At the peak (150) the workspace did not exist yet.
  const CategoryBytes& at = l.at_peak(MemPool::kDevice);
  EXPECT_EQ(at[int(MemCategory::kParams)], 100);
  EXPECT_EQ(at[int(MemCategory::kActivations)], 50);
  EXPECT_EQ(at[int(MemCategory::kWorkspace)], 0);
  EXPECT_EQ(l.peak_total(MemPool::kHost), 7);
  EXPECT_EQ(l.alloc_count(), 4);
  l.reset_peaks();
  EXPECT_EQ(l.peak_total(MemPool::kDevice), 130);
}

TEST(Ledger, BudgetThrowsOutOfMemoryBeforeAllocating) {
  MemoryLedger l;
  l.set_budget(MemPool::kDevice, 1000);
  l.on_alloc(MemCategory::kParams, MemPool::kDevice, 800);
  try {
    l.on_alloc(MemCategory::kActivations, MemPool::kDevice, 300);
    FAIL() << "expected out of memory";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOutOfMemory);
    EXPECT_NE(std::string(e.what()).find("params"), std::string::npos) << e.what();
  }
  EXPECT_EQ(l.current_total(MemPool::kDevice), 800);       // nothing recorded for the failure
  l.on_alloc(MemCategory::kParams, MemPool::kHost, 5000);  // other pool: no budget
}

TEST(Ledger, FreeingMoreThanHeldIsABug) {
  MemoryLedger l;
  EXPECT_THROW(l.on_free(MemCategory::kGrads, MemPool::kDevice, 1), Error);
}

TEST(Buffer, RecordsAndReleasesThroughTheLedger) {
  auto be = make_backend(DeviceKind::kCpu);
  MemoryLedger l;
  {
    Buffer a(*be, l, MemCategory::kGrads, MemPool::kDevice, 1000);
    Buffer b(*be, l, MemCategory::kHostOffload, MemPool::kHost, 64);
    EXPECT_EQ(l.current(MemPool::kDevice, MemCategory::kGrads), 1000);
    EXPECT_EQ(l.current(MemPool::kHost, MemCategory::kHostOffload), 64);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(a.data()) % kAlignBytes, 0u);
    Buffer moved = std::move(a);
    EXPECT_TRUE(a.empty());
    EXPECT_EQ(l.current(MemPool::kDevice, MemCategory::kGrads), 1000);
    // Zero-initialised, and views are bounds-checked.
    const Tensor t = moved.view(DType::kF32, {250});
    EXPECT_EQ(t.f32()[249], 0.f);
    EXPECT_THROW(moved.view(DType::kF32, {251}), Error);
  }
  EXPECT_EQ(l.current_total(MemPool::kDevice), 0);
  EXPECT_EQ(l.current_total(MemPool::kHost), 0);
  EXPECT_EQ(l.peak_total(MemPool::kDevice), 1000);
}

TEST(LedgerCharge, CountsAContainersBytesWhileItLives) {
  MemoryLedger l;
  {
    LedgerCharge c(l, MemCategory::kData, MemPool::kHost, 300);
    EXPECT_EQ(l.current(MemPool::kHost, MemCategory::kData), 300);
    LedgerCharge moved = std::move(c);
    EXPECT_EQ(c.bytes(), 0);
    EXPECT_EQ(moved.bytes(), 300);
    EXPECT_EQ(l.current(MemPool::kHost, MemCategory::kData), 300);
  }
  EXPECT_EQ(l.current_total(MemPool::kHost), 0);
  EXPECT_EQ(l.peak(MemPool::kHost, MemCategory::kData), 300);
  EXPECT_EQ(mem_category_name(MemCategory::kData), "data");
  // Past a budget it throws, and nothing stays charged.
  l.set_budget(MemPool::kHost, 100);
  EXPECT_THROW(LedgerCharge(l, MemCategory::kData, MemPool::kHost, 101), Error);
  EXPECT_EQ(l.current_total(MemPool::kHost), 0);
}

TEST(Check, CarriesLocationAndKind) {
  try {
    SHARDLM_CHECK(1 + 1 == 3, "arithmetic is broken; value {}", 42);
    FAIL();
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_EQ(e.kind(), ErrorKind::kInternal);
    EXPECT_NE(what.find("arithmetic is broken; value 42"), std::string::npos);
    EXPECT_NE(what.find("test_ledger.cpp:"), std::string::npos) << what;
  }
}

TEST(Shape, ValidatesAndDescribes) {
  EXPECT_EQ(Shape({2, 3, 4}).numel(), 24);
  EXPECT_EQ(Shape({2, 3}).str(), "[2, 3]");
  EXPECT_THROW(Shape({1, 2, 3, 4, 5, 6, 7}), Error);
  EXPECT_THROW(Shape({-1}), Error);
  float x[6];
  Tensor t(x, DType::kF32, {2, 3});
  EXPECT_EQ(t.rows(1, 1).data(), x + 3);
  EXPECT_THROW(t.rows(1, 2), Error);
  EXPECT_THROW(t.view({4}), Error);
  EXPECT_THROW(t.i32(), Error);
}

}  // namespace
}  // namespace shardlm
