// MemoryLedger bookkeeping and its human-readable breakdown.
#include "shardlm/core/ledger.h"

#include <string>

#include "shardlm/core/check.h"

namespace shardlm {

std::string_view mem_category_name(MemCategory c) {
  switch (c) {
    case MemCategory::kParams:
      return "params";
    case MemCategory::kGrads:
      return "grads";
    case MemCategory::kOptimizer:
      return "optimizer";
    case MemCategory::kActivations:
      return "activations";
    case MemCategory::kWorkspace:
      return "workspace";
    case MemCategory::kComm:
      return "comm";
    case MemCategory::kHostOffload:
      return "host_offload";
    case MemCategory::kCheckpoints:
      return "checkpoints";
    case MemCategory::kData:
      return "data";
  }
  return "?";
}

LedgerCharge::LedgerCharge(MemoryLedger& ledger, MemCategory cat, MemPool pool, int64_t bytes)
    : cat_(cat), pool_(pool) {
  ledger.on_alloc(cat, pool, bytes);  // throws past a budget, before anything is charged
  ledger_ = &ledger;
  bytes_ = bytes;
}

LedgerCharge& LedgerCharge::operator=(LedgerCharge&& o) noexcept {
  if (this != &o) {
    reset();
    ledger_ = std::exchange(o.ledger_, nullptr);
    cat_ = o.cat_;
    pool_ = o.pool_;
    bytes_ = std::exchange(o.bytes_, 0);
  }
  return *this;
}

void LedgerCharge::reset() {
  if (ledger_ != nullptr) ledger_->on_free(cat_, pool_, bytes_);
  ledger_ = nullptr;
  bytes_ = 0;
}

std::string format_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (int64_t{1} << 30)) return fmt::format("{:.2f} GiB", b / (1 << 30));
  if (bytes >= (int64_t{1} << 20)) return fmt::format("{:.1f} MiB", b / (1 << 20));
  if (bytes >= (int64_t{1} << 10)) return fmt::format("{:.1f} KiB", b / (1 << 10));
  return fmt::format("{} B", bytes);
}

void MemoryLedger::on_alloc(MemCategory cat, MemPool pool, int64_t bytes) {
  const int p = idx(pool), c = idx(cat);
  if (budget_[p] > 0 && current_total_[p] + bytes > budget_[p]) {
    SHARDLM_FAIL(ErrorKind::kOutOfMemory,
                 "out of memory: allocating {} of {} in the {} pool would exceed the budget of "
                 "{}. Held now: {}. Lower train.micro_batch or data.seq_len, enable "
                 "memory.checkpointing, or raise memory.budget_gib.",
                 format_bytes(bytes), mem_category_name(cat), mem_pool_name(pool),
                 format_bytes(budget_[p]), breakdown());
  }
  ++alloc_count_;
  current_[p][c] += bytes;
  current_total_[p] += bytes;
  if (current_[p][c] > peak_[p][c]) peak_[p][c] = current_[p][c];
  if (current_total_[p] > peak_total_[p]) {
    peak_total_[p] = current_total_[p];
    at_peak_[p] = current_[p];
  }
}

void MemoryLedger::on_free(MemCategory cat, MemPool pool, int64_t bytes) {
  const int p = idx(pool), c = idx(cat);
  SHARDLM_CHECK(current_[p][c] >= bytes, "ledger underflow: freeing {} B of {} holding {} B", bytes,
                mem_category_name(cat), current_[p][c]);
  current_[p][c] -= bytes;
  current_total_[p] -= bytes;
}

void MemoryLedger::reset_peaks() {
  peak_ = current_;
  at_peak_ = current_;
  peak_total_ = current_total_;
}

std::string MemoryLedger::breakdown() const {
  std::string s;
  for (int p = 0; p < kNumMemPools; ++p) {
    if (p) s += "; ";
    s += fmt::format("{} {}", mem_pool_name(static_cast<MemPool>(p)),
                     format_bytes(current_total_[p]));
    std::string parts;
    for (int c = 0; c < kNumMemCategories; ++c) {
      if (current_[p][c] == 0) continue;
      parts +=
          fmt::format("{}{} {}", parts.empty() ? "" : ", ",
                      mem_category_name(static_cast<MemCategory>(c)), format_bytes(current_[p][c]));
    }
    if (!parts.empty()) s += " (" + parts + ")";
  }
  return s;
}

}  // namespace shardlm
