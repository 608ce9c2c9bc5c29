// PlanCache: the CUDA backend's bounded cache of per-shape plans (the cuBLASLt GEMM plans of
// cuda_linear.cpp), least recently used evicted first, and GemmKey, what a GEMM plan depends
// on. Free of CUDA headers, so the CPU suite tests it (tests/kernels/test_plan_cache.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <unordered_map>
#include <utility>

#include "shardlm/core/check.h"

namespace shardlm::cuda {

// The largest alignment a GEMM plan asks of its pointers: cuBLASLt's default assumption for
// every matrix, the most any of its kernels needs.
inline constexpr uint32_t kMaxPlanAlignment = 256;

// The alignment of p in bytes, a power of two up to kMaxPlanAlignment (a null pointer counts as
// fully aligned: no buffer to read).
inline uint32_t pointer_alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = kMaxPlanAlignment;
  while (align > 1 && a % align != 0) align /= 2;
  return align;
}

// Everything a cuBLASLt matmul's descriptors, layouts and heuristic choice depend on:
// column-major C [m, n] = op(A) op(B) (+ bias) (+ beta C), element types as ints (Elem), the
// pointers' alignments (an algorithm chosen for 256-byte aligned operands may not run on a
// view that starts mid-buffer). The per-call pointers are not in it.
struct GemmKey {
  bool trans_a = false, trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  int a_type = 0, b_type = 0, c_type = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;
  bool bias = false;       // the bias epilogue
  bool beta_zero = false;  // C is not read
  bool c_apart = false;    // C (the residual) is a buffer apart from D
  uint32_t align_a = 0, align_b = 0, align_c = 0, align_d = 0;

  bool operator==(const GemmKey&) const = default;
};

struct GemmKeyHash {
  size_t operator()(const GemmKey& k) const {
    uint64_t h = 0xcbf29ce484222325ULL;
    const auto mix = [&h](uint64_t v) { h = (h ^ v) * 0x100000001b3ULL + (h >> 29); };
    mix(uint64_t(k.trans_a) | uint64_t(k.trans_b) << 1 | uint64_t(k.bias) << 2 |
        uint64_t(k.beta_zero) << 3 | uint64_t(k.c_apart) << 4);
    for (const int64_t v : {k.m, k.n, k.k, k.lda, k.ldb, k.ldc}) mix(uint64_t(v));
    mix(uint64_t(k.a_type) | uint64_t(k.b_type) << 8 | uint64_t(k.c_type) << 16);
    mix(uint64_t(k.align_a) | uint64_t(k.align_b) << 16 | uint64_t(k.align_c) << 32 |
        uint64_t(k.align_d) << 48);
    return size_t(h);
  }
};

// At most `capacity` plans; a miss at capacity destroys the least recently used one before the
// new plan is made. Plans are move-constructible and own what they hold (their destructors
// release it), so clear() and the cache's destructor release everything.
template <class Key, class Plan, class Hash = std::hash<Key>>
class PlanCache {
 public:
  explicit PlanCache(size_t capacity) : capacity_(capacity) {
    SHARDLM_CHECK_KIND(ErrorKind::kInternal, capacity > 0, "PlanCache: capacity 0");
  }

  // The plan of key: the cached one, or make() (which may throw: nothing is then cached).
  // The reference is valid until the next get() or clear().
  template <class Make>
  Plan& get(const Key& key, Make&& make) {
    ++clock_;
    if (auto it = plans_.find(key); it != plans_.end()) {
      ++hits_;
      it->second.last_use = clock_;
      return it->second.plan;
    }
    Plan plan = make();
    if (plans_.size() >= capacity_) evict_oldest();
    ++misses_;
    return plans_.emplace(key, Entry{std::move(plan), clock_}).first->second.plan;
  }

  void clear() { plans_.clear(); }
  size_t size() const { return plans_.size(); }
  size_t capacity() const { return capacity_; }
  uint64_t hits() const { return hits_; }
  uint64_t misses() const { return misses_; }
  uint64_t evictions() const { return evictions_; }
  bool contains(const Key& key) const { return plans_.count(key) != 0; }

 private:
  struct Entry {
    Plan plan;
    uint64_t last_use;
  };

  // A scan, on misses at capacity only: the shapes of a training step repeat every step, so
  // this runs when a new shape arrives, never per call.
  void evict_oldest() {
    auto oldest = plans_.begin();
    for (auto it = plans_.begin(); it != plans_.end(); ++it)
      if (it->second.last_use < oldest->second.last_use) oldest = it;
    plans_.erase(oldest);
    ++evictions_;
  }

  size_t capacity_;
  uint64_t clock_ = 0, hits_ = 0, misses_ = 0, evictions_ = 0;
  std::unordered_map<Key, Entry, Hash> plans_;
};

}  // namespace shardlm::cuda
