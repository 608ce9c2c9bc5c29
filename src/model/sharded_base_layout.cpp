// The dense sharded LoRA base's size tables (model/sharded_base.h).
#include <algorithm>

#include "shardlm/model/sharded_base.h"

namespace shardlm {
namespace {

// Decoder layer units hold elements on this stage; the embeddings' and the final norm's
// units (first and last) are kept whole.
bool is_layer(const ParamLayout& L, int u) {
  return u > 0 && u < L.head_unit && L.unit_size(u) > 0;
}

}  // namespace

DenseShardLayout make_dense_shard_layout(const ParamLayout& L, int64_t world) {
  DenseShardLayout S;
  S.world = world;
  for (int u = 0; u < int(L.units.size()); ++u) {
    S.whole_at.push_back(S.whole_elems);
    S.chunk_at.push_back(S.shard_elems);
    if (!is_layer(L, u)) {
      S.chunk_elems.push_back(0);
      S.whole_elems += L.unit_size(u);
      continue;
    }
    const int64_t chunk = (L.unit_size(u) + world - 1) / world;
    S.chunk_elems.push_back(chunk);
    S.shard_elems += chunk;
    S.max_chunk = std::max(S.max_chunk, chunk);
  }
  return S;
}

DenseShardHostLayout make_dense_shard_host_layout(const ParamLayout& L, const DenseShardLayout& S,
                                                  bool split_tables) {
  DenseShardHostLayout H;
  for (int u = 0; u < int(L.units.size()); ++u) {
    H.unit_part.push_back(int(H.parts.size()));
    if (S.sharded(u)) {
      H.piece_rows.push_back(0);
      H.parts.push_back({.unit = u, .at = S.chunk_at[u], .n = S.chunk_elems[u], .chunk = true});
      continue;
    }
    const int64_t rows = split_tables ? table_piece_rows(L, u, L.max_layer) : 0;
    H.piece_rows.push_back(rows);
    const std::vector<UnitPiece> pieces = unit_pieces(L, u, rows);
    for (int k = 0; k < int(pieces.size()); ++k)
      H.parts.push_back({.unit = u,
                         .piece = k,
                         .at = S.whole_at[u] + (pieces[k].begin - L.units[u].begin),
                         .n = pieces[k].end - pieces[k].begin});
  }
  for (const DenseShardPart& p : H.parts) H.slot_elems = std::max(H.slot_elems, p.n);
  return H;
}

}  // namespace shardlm
