// Shape: up to kMaxDims extents, row-major. Value type; no allocation.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "shardlm/core/check.h"

namespace shardlm {

class Shape {
 public:
  static constexpr int kMaxDims = 6;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) {
    SHARDLM_CHECK(dims.size() <= kMaxDims, "shape has {} dims; at most {} are supported",
                  dims.size(), kMaxDims);
    for (int64_t d : dims) {
      SHARDLM_CHECK(d >= 0, "negative extent {} in a shape", d);
      dims_[rank_++] = d;
    }
  }

  int rank() const { return rank_; }
  int64_t operator[](int i) const {
    SHARDLM_CHECK(i >= 0 && i < rank_, "dim {} out of range for a rank-{} shape", i, rank_);
    return dims_[i];
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < rank_; ++i) n *= dims_[i];
    return n;
  }
  bool operator==(const Shape& o) const {
    if (rank_ != o.rank_) return false;
    for (int i = 0; i < rank_; ++i)
      if (dims_[i] != o.dims_[i]) return false;
    return true;
  }
  std::string str() const {
    std::string s = "[";
    for (int i = 0; i < rank_; ++i) s += (i ? ", " : "") + std::to_string(dims_[i]);
    return s + "]";
  }

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int rank_ = 0;
};

}  // namespace shardlm
