// Bucket and shard arithmetic of ZeRO (zero_layout.h).
#include "shardlm/plan/zero_layout.h"

#include <algorithm>

#include "shardlm/core/check.h"

namespace shardlm {

namespace {

void add_part(ZeroLayout& z, const ZeroPart& part, bool alone, int64_t bucket_elems) {
  // A pipeline stage's layout has empty units (the other stages'): they join whatever bucket
  // is at hand, and a bucket holding only empty parts takes the next part too, so that every
  // bucket has elements.
  const int64_t n = part.end - part.begin;
  if (!z.buckets.empty() && !alone &&
      (n == 0 || z.buckets.back().size() == 0 || z.buckets.back().size() + n <= bucket_elems)) {
    z.buckets.back().last_part = int(z.parts.size());
    z.buckets.back().end = part.end;
  } else {
    ZeroBucket b;
    b.first_part = b.last_part = int(z.parts.size());
    b.begin = part.begin;
    b.end = part.end;
    z.buckets.push_back(b);
  }
  if (n > 0) ++z.buckets.back().live_parts;
  z.part_bucket.push_back(int(z.buckets.size()) - 1);
  z.parts.push_back(part);
}

}  // namespace

ZeroLayout make_zero_layout(const ParamLayout& layout, int world, int64_t bucket_elems,
                            bool split_tables) {
  SHARDLM_CHECK(world >= 1 && bucket_elems >= 1, "zero layout: world {} and bucket {} must be >= 1",
                world, bucket_elems);
  ZeroLayout z;
  z.world = world;
  const int n_units = int(layout.units.size());
  const bool tied = layout.lm_head_unit == 0;
  for (int u = 0; u < n_units; ++u) {
    const bool alone = tied && (u == 0 || u == 1);  // unit 0 neither joins nor is joined
    const int64_t rows =
        split_tables ? table_piece_rows(layout, u, zero_table_piece_elems(layout, bucket_elems))
                     : 0;
    z.piece_rows.push_back(rows);
    z.unit_part.push_back(int(z.parts.size()));
    int piece = 0;
    for (const UnitPiece& p : unit_pieces(layout, u, rows))
      add_part(z, {u, piece++, p.begin, p.end}, alone, bucket_elems);
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

int ZeroLayout::part_of(int unit, int piece) const {
  const int p = unit_part[unit] + piece;
  SHARDLM_CHECK(piece >= 0 && p < int(parts.size()) && parts[p].unit == unit,
                "zero: unit {} has no piece {}", unit, piece);
  return p;
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
