// MemoryLedger: every byte the engine allocates is recorded here with a category and a pool.
// It keeps current and peak bytes per (pool, category), the breakdown at each pool's peak,
// and an allocation counter (the steady-state step must not allocate).
// It does not allocate memory itself: Buffer (buffer.h) calls it, and LedgerCharge (below)
// counts the memory a container owns.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "shardlm/core/device.h"

namespace shardlm {

enum class MemCategory : uint8_t {
  kParams = 0,
  kGrads,
  kOptimizer,
  kActivations,
  kWorkspace,
  kComm,
  kHostOffload,
  // Per-layer activations kept from a layer's forward until its backward (activation
  // checkpoints); the device pool holds those on the device, the host pool those offloaded.
  kCheckpoints,
  // What the trainer holds of its data on the host: the data sets' tokens, loss masks, document
  // and packing tables, and full fine-tuning DPO's reference sums.
  kData,
};
inline constexpr int kNumMemCategories = 9;

// The names used in memory_rank{R}.json and the planner's output.
std::string_view mem_category_name(MemCategory c);

using CategoryBytes = std::array<int64_t, kNumMemCategories>;

class MemoryLedger {
 public:
  MemoryLedger() = default;
  MemoryLedger(const MemoryLedger&) = delete;
  MemoryLedger& operator=(const MemoryLedger&) = delete;

  // Optional budget per pool (0 = unlimited): an allocation past it throws kOutOfMemory
  // with the breakdown, before the memory is requested.
  void set_budget(MemPool pool, int64_t bytes) { budget_[idx(pool)] = bytes; }

  void on_alloc(MemCategory cat, MemPool pool, int64_t bytes);
  void on_free(MemCategory cat, MemPool pool, int64_t bytes);

  int64_t current(MemPool pool, MemCategory cat) const { return current_[idx(pool)][idx(cat)]; }
  int64_t current_total(MemPool pool) const { return current_total_[idx(pool)]; }
  // Highest bytes ever held in this category (not necessarily at the same moment).
  int64_t peak(MemPool pool, MemCategory cat) const { return peak_[idx(pool)][idx(cat)]; }
  // Highest bytes ever held in the pool, and the per-category breakdown at that moment.
  int64_t peak_total(MemPool pool) const { return peak_total_[idx(pool)]; }
  const CategoryBytes& at_peak(MemPool pool) const { return at_peak_[idx(pool)]; }

  // Number of allocations so far (frees do not decrement it).
  int64_t alloc_count() const { return alloc_count_; }

  // Forget peaks (keep current holdings), e.g. to measure one phase.
  void reset_peaks();

  // "device: 1.2 GiB (params 400 MiB, ...)" for error messages.
  std::string breakdown() const;

 private:
  static constexpr int idx(MemPool p) { return static_cast<int>(p); }
  static constexpr int idx(MemCategory c) { return static_cast<int>(c); }

  std::array<CategoryBytes, kNumMemPools> current_{};
  std::array<CategoryBytes, kNumMemPools> peak_{};
  std::array<CategoryBytes, kNumMemPools> at_peak_{};
  std::array<int64_t, kNumMemPools> current_total_{};
  std::array<int64_t, kNumMemPools> peak_total_{};
  std::array<int64_t, kNumMemPools> budget_{};
  int64_t alloc_count_ = 0;
};

// Bytes the ledger did not allocate but counts: memory a container owns (a data set's tables, a
// runner's host rows in a std::vector), charged under a category and pool while the charge
// lives and returned by its destructor. Move-only.
class LedgerCharge {
 public:
  LedgerCharge() = default;
  LedgerCharge(MemoryLedger& ledger, MemCategory cat, MemPool pool, int64_t bytes);
  ~LedgerCharge() { reset(); }
  LedgerCharge(const LedgerCharge&) = delete;
  LedgerCharge& operator=(const LedgerCharge&) = delete;
  LedgerCharge(LedgerCharge&& o) noexcept { *this = std::move(o); }
  LedgerCharge& operator=(LedgerCharge&& o) noexcept;
  void reset();
  int64_t bytes() const { return bytes_; }

 private:
  MemoryLedger* ledger_ = nullptr;
  MemCategory cat_ = MemCategory::kWorkspace;
  MemPool pool_ = MemPool::kHost;
  int64_t bytes_ = 0;
};

std::string format_bytes(int64_t bytes);

}  // namespace shardlm
