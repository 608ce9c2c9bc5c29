// InputStaging: the host rows and the double-buffered pinned slots of a micro-batch's inputs.
#include "input_staging.h"

#include <algorithm>

#include "shardlm/core/check.h"

namespace shardlm::trainer_detail {
namespace {

// int32 elements of a micro-batch of n tokens: four rows of n and the n + 1 document starts
// (input_staging_bytes counts three of these: two upload slots and the host rows).
int64_t row_elems(int64_t n) { return 5 * n + 1; }

}  // namespace

InputStaging::InputStaging(Backend& backend, MemoryLedger& ledger, int64_t tokens)
    : tokens_(tokens),
      slots_(backend, ledger, MemCategory::kActivations, MemPool::kHost,
             size_t(input_staging_bytes(tokens))),
      rows_(reinterpret_cast<int32_t*>(slots_.data()) + 2 * row_elems(tokens)) {}

BatchInputs InputStaging::rows(int64_t n) {
  SHARDLM_CHECK(rows_ != nullptr && n <= tokens_,
                "input staging: {} tokens do not fit its rows and pinned slots ({} tokens)", n,
                tokens_);
  n_ = n;
  auto at = [&](int i, int64_t len) {
    return Tensor(rows_ + i * n, DType::kI32, {len}, MemPool::kHost);
  };
  return {at(0, n), at(1, n), at(2, n), at(3, n), at(4, n + 1)};
}

void InputStaging::upload(Backend& backend, const BatchInputs& dev, int64_t docs) {
  SHARDLM_CHECK(!slots_.empty() && n_ <= tokens_,
                "input staging: {} tokens do not fit its pinned slots ({} tokens)", n_, tokens_);
  const int s = next_;
  next_ = 1 - next_;
  // The copies out of this slot two uploads ago must have read it before it is written: a
  // wait only if the device has not reached them yet.
  backend.host_wait_fence(fence_[size_t(s)]);
  const int64_t elems = 4 * n_ + docs + 1;  // the document starts past docs + 1 are not sent
  auto* slot = reinterpret_cast<int32_t*>(slots_.data()) + s * row_elems(tokens_);
  std::copy_n(rows_, elems, slot);
  auto at = [&](int i, int64_t len) {
    return Tensor(slot + i * n_, DType::kI32, {len}, MemPool::kHost);
  };
  backend.copy_async(at(0, n_), dev.tokens);
  backend.copy_async(at(1, n_), dev.targets);
  backend.copy_async(at(2, n_), dev.positions);
  backend.copy_async(at(3, n_), dev.seg_start);
  // The last fence covers the copies started before it (the copy queue runs in order).
  fence_[size_t(s)] = backend.copy_async(at(4, docs + 1), dev.doc_starts.rows(0, docs + 1));
  backend.wait_fence(fence_[size_t(s)]);
}

}  // namespace shardlm::trainer_detail
