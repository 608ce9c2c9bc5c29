// Bucket and shard arithmetic of ZeRO (zero_layout.h).
#include "shardlm/plan/zero_layout.h"

#include <algorithm>

#include "shardlm/core/check.h"

namespace shardlm {

ZeroLayout make_zero_layout(const ParamLayout& layout, int world, int64_t bucket_elems) {
  SHARDLM_CHECK(world >= 1 && bucket_elems >= 1, "zero layout: world {} and bucket {} must be >= 1",
                world, bucket_elems);
  ZeroLayout z;
  z.world = world;
  const int n_units = int(layout.units.size());
  const bool tied = layout.lm_head_unit == 0;
  z.unit_bucket.resize(n_units);
  for (int u = 0; u < n_units; ++u) {
    const bool alone = tied && (u == 0 || u == 1);  // unit 0 neither joins nor is joined
    // A pipeline stage's layout has empty units (the other stages'): they join whatever
    // bucket is at hand, and a bucket holding only empty units takes the next unit too, so
    // that every bucket has elements.
    const int64_t n = layout.unit_size(u);
    if (!z.buckets.empty() && !alone &&
        (n == 0 || z.buckets.back().size() == 0 || z.buckets.back().size() + n <= bucket_elems)) {
      z.buckets.back().last_unit = u;
      z.buckets.back().end = layout.units[u].end;
    } else {
      ZeroBucket b;
      b.first_unit = b.last_unit = u;
      b.begin = layout.units[u].begin;
      b.end = layout.units[u].end;
      z.buckets.push_back(b);
    }
    if (n > 0) ++z.buckets.back().live_units;
    z.unit_bucket[u] = int(z.buckets.size()) - 1;
  }
  for (ZeroBucket& b : z.buckets) {
    b.chunk = (b.size() + world - 1) / world;
    b.padded_begin = z.padded_total;
    b.shard_begin = z.shard;
    z.padded_total += b.chunk * world;
    z.shard += b.chunk;
    z.max_bucket = std::max(z.max_bucket, b.chunk * world);
    z.max_chunk = std::max(z.max_chunk, b.chunk);
  }
  return z;
}

int64_t ZeroLayout::padded_offset(int64_t flat) const {
  // Buckets are in flat order: the last one that begins at or before `flat`.
  auto it = std::upper_bound(buckets.begin(), buckets.end(), flat,
                             [](int64_t f, const ZeroBucket& b) { return f < b.begin; });
  SHARDLM_CHECK(it != buckets.begin() && flat < std::prev(it)->end,
                "flat offset {} is outside the arena", flat);
  const ZeroBucket& b = *std::prev(it);
  return b.padded_begin + (flat - b.begin);
}

}  // namespace shardlm
