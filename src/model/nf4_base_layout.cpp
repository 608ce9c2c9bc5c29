// The NF4 base's size table (model/nf4_base.h): per unit, the dense and the quantized ranges of
// the parameter arena and where each lives in the store's three arrays.
#include <algorithm>

#include "shardlm/core/check.h"
#include "shardlm/model/nf4_base.h"
#include "shardlm/quant/nf4.h"

namespace shardlm {

bool Nf4BaseLayout::quantized(int u) const {
  return std::any_of(units[u].begin(), units[u].end(),
                     [](const Nf4Segment& s) { return s.quantized; });
}

Nf4BaseLayout make_nf4_base_layout(const ParamLayout& L) {
  Nf4BaseLayout N;
  N.units.resize(L.units.size());
  auto dense = [&](int u, int64_t begin, int64_t end) {
    if (end <= begin) return;
    N.units[u].push_back({.begin = begin, .n = end - begin, .dense_at = N.dense_elems});
    N.dense_elems += end - begin;
  };
  for (int u = 0; u < int(L.units.size()); ++u) {
    const bool layer = u >= 1 && u <= int(L.layers.size());
    if (!layer || L.unit_size(u) == 0) {
      dense(u, L.units[u].begin, L.units[u].end);
      continue;
    }
    const LayerParamOffsets& o = L.layers[u - 1];
    std::vector<std::pair<int64_t, int64_t>> matrices;  // [begin, end) of the seven matrices
    for (const ParamEntry& e : L.entries)
      if (e.layer == u - 1 && e.decay) matrices.emplace_back(e.offset, e.offset + e.shape.numel());
    std::sort(matrices.begin(), matrices.end());
    int64_t at = o.begin;
    for (const auto& [begin, end] : matrices) {
      dense(u, at, begin);
      const int64_t n = end - begin;
      N.units[u].push_back({.begin = begin,
                            .n = n,
                            .quantized = true,
                            .code_at = N.code_bytes,
                            .absmax_at = N.absmax_values});
      N.code_bytes += nf4::packed_bytes(n);
      N.absmax_values += nf4::num_blocks(n);
      at = end;
    }
    dense(u, at, o.end);
    N.workspace_elems = std::max(N.workspace_elems, L.unit_size(u));
  }
  return N;
}

// The layout appends a unit's segments in order, so each of its three ranges is contiguous.
Nf4HostPart nf4_layer_part(const ParamLayout& L, const Nf4BaseLayout& N, int u) {
  Nf4HostPart p{.unit = u, .begin = L.units[u].begin, .end = L.units[u].end};
  bool first_dense = true, first_code = true;
  for (const Nf4Segment& s : N.units[u]) {
    if (!s.quantized) {
      if (first_dense) p.dense_at = s.dense_at;
      first_dense = false;
      p.dense_n += s.n;
      continue;
    }
    if (first_code) {
      p.code_at = s.code_at;
      p.absmax_at = s.absmax_at;
    }
    first_code = false;
    p.code_n += nf4::packed_bytes(s.n);
    p.absmax_n += nf4::num_blocks(s.n);
  }
  return p;
}

Nf4ShardLayout make_nf4_shard_layout(const ParamLayout& L, const Nf4BaseLayout& N, int64_t world) {
  Nf4ShardLayout S;
  for (int u = 0; u < int(L.units.size()); ++u) {
    S.chunk_at.push_back(S.shard_bytes);
    if (!N.quantized(u)) {
      S.chunk_bytes.push_back(0);
      continue;
    }
    const Nf4HostPart p = nf4_layer_part(L, N, u);
    const int64_t bytes = p.absmax_n * 4 + p.code_n;
    const int64_t chunk = ((bytes + world - 1) / world + 3) / 4 * 4;
    S.chunk_bytes.push_back(chunk);
    S.shard_bytes += chunk;
    S.max_chunk = std::max(S.max_chunk, chunk);
  }
  return S;
}

Nf4HostLayout make_nf4_host_layout(const ParamLayout& L, const Nf4BaseLayout& N,
                                   int64_t param_bytes, bool split_tables,
                                   const Nf4ShardLayout* shards) {
  Nf4HostLayout H;
  int64_t layer_bytes = 0;
  for (int u = 0; u < int(L.units.size()); ++u)
    if (N.quantized(u))
      layer_bytes = std::max(layer_bytes, nf4_layer_part(L, N, u).bytes(param_bytes));
  // Table pieces no larger than a staged layer (whole tables when there is no layer to match).
  const int64_t most = layer_bytes > 0 ? layer_bytes / param_bytes : L.max_unit;
  for (int u = 0; u < int(L.units.size()); ++u) {
    H.unit_part.push_back(int(H.parts.size()));
    if (N.quantized(u)) {
      H.piece_rows.push_back(0);
      Nf4HostPart p = nf4_layer_part(L, N, u);
      if (shards != nullptr) {  // this rank's chunk of [absmax | codes] in the absmax range
        p.absmax_at = shards->chunk_at[u] / 4;
        p.absmax_n = shards->chunk_bytes[u] / 4;
        p.code_at = p.code_n = 0;
      }
      H.parts.push_back(p);
      continue;
    }
    const int64_t rows = split_tables ? table_piece_rows(L, u, most) : 0;
    H.piece_rows.push_back(rows);
    // A dense unit is one segment (or none, when empty).
    const int64_t dense_at = N.units[u].empty() ? 0 : N.units[u].front().dense_at;
    for (const UnitPiece& piece : unit_pieces(L, u, rows))
      H.parts.push_back({.unit = u,
                         .begin = piece.begin,
                         .end = piece.end,
                         .dense_at = dense_at + (piece.begin - L.units[u].begin),
                         .dense_n = piece.end - piece.begin});
  }
  for (const Nf4HostPart& p : H.parts) H.slot_bytes = std::max(H.slot_bytes, p.bytes(param_bytes));
  return H;
}

void check_nf4_tp_blocks(const ModelConfig& full, int64_t tp) {
  if (tp == 1) return;
  const ParamLayout whole = make_param_layout(full);
  const ParamLayout shard = make_param_layout(tp_shard_config(full, tp));
  for (size_t e = 0; e < whole.entries.size(); ++e) {
    const ParamEntry& w = whole.entries[e];
    if (w.layer < 0 || !w.decay) continue;  // the decoder projections (make_nf4_base_layout's)
    const Shape& s = shard.entries[e].shape;
    const bool by_rows = s[0] != w.shape[0];
    // A shard's run of elements that must be whole blocks: its rows, or each row's columns.
    const int64_t run = by_rows ? s.numel() : s[1];
    if (run % nf4::kBlock == 0) continue;
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "lora.base_dtype = nf4 with parallel.tp = {}: {} [{}, {}] splits by {} into "
                 "shards of {} {}, not a multiple of NF4's blocks of {}, so a rank's blocks "
                 "would not be the whole model's; pick a parallel.tp that leaves whole blocks, "
                 "or lora.base_dtype = auto",
                 tp, w.name, w.shape[0], w.shape[1], by_rows ? "output rows" : "input columns", run,
                 by_rows ? "elements" : "columns a row", nf4::kBlock);
  }
}

std::vector<Nf4Matrix> nf4_shard_matrices(std::span<const Nf4Matrix> whole,
                                          const ParamLayout& whole_layout,
                                          const std::vector<ShardPiece>& pieces) {
  std::vector<Nf4Matrix> out;
  for (const Nf4Matrix& m : whole) {
    const auto e = std::find_if(whole_layout.entries.begin(), whole_layout.entries.end(),
                                [&](const ParamEntry& x) { return x.offset == m.begin; });
    SHARDLM_CHECK(e != whole_layout.entries.end(), "no tensor begins at NF4 matrix element {}",
                  m.begin);
    const int64_t end = m.begin + e->shape.numel();
    // The pieces are in whole-arena order: the first that ends past the matrix's start.
    auto p = std::partition_point(pieces.begin(), pieces.end(),
                                  [&](const ShardPiece& x) { return x.full + x.count <= m.begin; });
    Nf4Matrix cut;
    for (; p != pieces.end() && p->full < end; ++p) {
      const int64_t at = p->full - m.begin;  // the piece's first element within the matrix
      SHARDLM_CHECK(at >= 0 && p->full + p->count <= end && at % nf4::kBlock == 0 &&
                        (p->count % nf4::kBlock == 0 || p->full + p->count == end),
                    "{}: a shard's piece [{}, {}) of its elements is not whole NF4 blocks", e->name,
                    at, at + p->count);
      if (cut.codes.empty()) cut.begin = p->shard;
      const int64_t blocks = nf4::num_blocks(p->count), first = at / nf4::kBlock;
      cut.codes.insert(cut.codes.end(), m.codes.begin() + at / 2,
                       m.codes.begin() + at / 2 + nf4::packed_bytes(p->count));
      cut.absmax.insert(cut.absmax.end(), m.absmax.begin() + first,
                        m.absmax.begin() + first + blocks);
    }
    if (!cut.codes.empty()) out.push_back(std::move(cut));
  }
  return out;
}

void nf4_round_trip_unit(const ParamLayout& L, const Nf4BaseLayout& N, int u, float* values) {
  std::vector<uint8_t> codes;
  std::vector<float> absmax;
  for (const Nf4Segment& s : N.units[u]) {
    if (!s.quantized) continue;
    float* w = values + (s.begin - L.units[u].begin);
    codes.resize(size_t(nf4::packed_bytes(s.n)));
    absmax.resize(size_t(nf4::num_blocks(s.n)));
    nf4::quantize(w, s.n, codes.data(), absmax.data());
    nf4::dequantize(codes.data(), absmax.data(), 0, s.n, w);
  }
}

}  // namespace shardlm
