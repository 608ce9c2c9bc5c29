// Causal flash attention on the CPU: online softmax over 64x64 query/key tiles, grouped-query
// heads and document masks (seg_start). One kernel serves a block of queries against a block of
// keys anywhere in the full row (ring attention); full attention is the block at offsets 0.
// Memory is O(T): per-thread tile scratch plus, for the backward, D = rowsum(dO * O) [B, Hq, Tq];
// never a [T, T] buffer. Tile products run on a small register-blocked f32 GEMM (GCC/Clang
// vector extensions, f32 accumulation); no BLAS calls and no allocation. The backward is
// race-free and bit-identical for any thread count.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string_view>

#include "kernels/cpu/attention_tile.h"
#include "kernels/cpu/kernel_checks.h"
#include "kernels/cpu/ops.h"

namespace shardlm::cpu {
namespace {

using namespace tile;  // NOLINT: the tile helpers are this file's vocabulary

constexpr int64_t kTileQ = 64;  // queries per tile
constexpr int64_t kTileK = 64;  // keys per tile
constexpr size_t kScratchAlign = 64;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.693147180559945309f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// ---- shapes, masks, scratch -------------------------------------------------------------------

// Tiles are cut from each block's own start; masks compare full-row indices (local index plus
// the block's offset), so a block behaves exactly like its slice of the full attention.
struct AttnDims {
  int64_t B, Tq, Tk, Hq, Hkv, Dh;
  int64_t q_offset;  // full-row index of query 0
  int64_t k_offset;  // full-row index of key 0
  int64_t group() const { return Hq / Hkv; }
  int64_t q_row() const { return Hq * Dh; }    // floats between tokens of q, out, dout, dq
  int64_t kv_row() const { return Hkv * Dh; }  // floats between tokens of k, v, dk, dv
  int64_t q_tiles() const { return (Tq + kTileQ - 1) / kTileQ; }
  int64_t k_tiles() const { return (Tk + kTileK - 1) / kTileK; }
};

enum class TileMask { kNone, kPartial, kFull };

// Which (query, key) pairs of queries [q0, q0+nq) and keys [k0, k0+nk) are visible, all full-row
// indices; seg [nq] are the queries' document starts. Query t sees key s iff seg[t] <= s <= t.
TileMask classify_tile(const int32_t* seg, int64_t q0, int64_t nq, int64_t k0, int64_t nk) {
  const int64_t k_last = k0 + nk - 1;
  bool any = false;
  bool all = true;
  for (int64_t i = 0; i < nq; ++i) {
    const int64_t lo = std::max<int64_t>(seg[i], k0);
    const int64_t hi = std::min(q0 + i, k_last);
    any = any || lo <= hi;
    all = all && seg[i] <= k0 && k_last <= q0 + i;
  }
  return !any ? TileMask::kNone : all ? TileMask::kFull : TileMask::kPartial;
}

// Key tiles of the block that can hold keys visible to queries [q0, q0+nq) (full-row indices):
// from the earliest document start to the last query, clipped to the block; may be empty.
void key_tile_range(const AttnDims& d, const int32_t* seg, int64_t q0, int64_t nq,
                    int64_t* kt_begin, int64_t* kt_end) {
  int64_t first = q0;
  for (int64_t i = 0; i < nq; ++i) first = std::min<int64_t>(first, seg[i]);
  const int64_t lo = std::max<int64_t>(first - d.k_offset, 0);
  const int64_t hi = std::min(q0 + nq - 1 - d.k_offset, d.Tk - 1);
  *kt_begin = lo > hi ? 0 : lo / kTileK;
  *kt_end = lo > hi ? 0 : hi / kTileK + 1;
}

// The first query tile of the block that can see key k0 (full-row index): queries before a key
// never see it.
int64_t first_query_tile(const AttnDims& d, int64_t k0) {
  return std::max<int64_t>(k0 - d.q_offset, 0) / kTileQ;
}

// Hands out 64-byte aligned float arrays from a thread's slot; with a null base it only counts,
// so the workspace query and the kernels share one layout.
class ScratchCarver {
 public:
  explicit ScratchCarver(std::byte* base) : base_(base) {}
  float* floats(int64_t n) { return static_cast<float*>(take(n * sizeof(float))); }
  int32_t* ints(int64_t n) { return static_cast<int32_t*>(take(n * sizeof(int32_t))); }
  size_t used() const { return used_; }

 private:
  void* take(int64_t bytes) {
    const size_t offset = used_;
    used_ += (static_cast<size_t>(bytes) + kScratchAlign - 1) / kScratchAlign * kScratchAlign;
    return base_ == nullptr ? nullptr : base_ + offset;
  }

  std::byte* base_;
  size_t used_ = 0;
};

// Per-query arrays are kTileQ long and rows of score tiles are kTileQ or kTileK floats apart, so
// the softmax loops run whole 8-lane vectors past nq / nk; the extra lanes are never read back.

struct ForwardScratch {
  float* q_t;    // [Dh, kTileQ] query tile, transposed, pre-scaled by scale * log2(e)
  float* s_t;    // [kTileK, kTileQ] scores, then probabilities, keys as rows
  float* k;      // [kTileK, Dh] key tile, packed
  float* v;      // [kTileK, Dh] value tile, packed
  float* o;      // [kTileQ, Dh] unnormalised output accumulator
  float* m;      // [kTileQ] running max (log2 units)
  float* l;      // [kTileQ] running sum of 2^(s - m)
  int32_t* seg;  // [kTileQ] the queries' document starts, padded with INT32_MAX
  explicit ForwardScratch(ScratchCarver& c, int64_t Dh)
      : q_t(c.floats(Dh * kTileQ)),
        s_t(c.floats(kTileK * kTileQ)),
        k(c.floats(kTileK * Dh)),
        v(c.floats(kTileK * Dh)),
        o(c.floats(kTileQ * Dh)),
        m(c.floats(kTileQ)),
        l(c.floats(kTileQ)),
        seg(c.ints(kTileQ)) {}
};

// Pass 1 of the backward: one key tile against every query tile that sees it.
struct KeyTileScratch {
  float* k;     // [kTileK, Dh] packed
  float* k_t;   // [Dh, kTileK]
  float* v_t;   // [Dh, kTileK]
  float* q;     // [kTileQ, Dh] packed
  float* dout;  // [kTileQ, Dh] packed
  float* p;     // [kTileQ, kTileK] probabilities
  float* ds;    // [kTileQ, kTileK] dP, then dS (scaled)
  float* dk;    // [kTileK, Dh]
  float* dv;    // [kTileK, Dh]
  explicit KeyTileScratch(ScratchCarver& c, int64_t Dh)
      : k(c.floats(kTileK * Dh)),
        k_t(c.floats(Dh * kTileK)),
        v_t(c.floats(Dh * kTileK)),
        q(c.floats(kTileQ * Dh)),
        dout(c.floats(kTileQ * Dh)),
        p(c.floats(kTileQ * kTileK)),
        ds(c.floats(kTileQ * kTileK)),
        dk(c.floats(kTileK * Dh)),
        dv(c.floats(kTileK * Dh)) {}
};

// Pass 2 of the backward: one query tile against every key tile it sees (dQ only).
struct QueryTileScratch {
  float* q_t;       // [Dh, kTileQ]
  float* do_t;      // [Dh, kTileQ]
  float* k;         // [kTileK, Dh] packed
  float* v;         // [kTileK, Dh] packed
  float* p_t;       // [kTileK, kTileQ]
  float* ds_t;      // [kTileK, kTileQ] dP^T, then dS^T (scaled)
  float* dq;        // [kTileQ, Dh]
  float* neg_lse2;  // [kTileQ] -lse in log2 units
  float* row_dot;   // [kTileQ] D
  int32_t* seg;     // [kTileQ] padded with INT32_MAX
  explicit QueryTileScratch(ScratchCarver& c, int64_t Dh)
      : q_t(c.floats(Dh * kTileQ)),
        do_t(c.floats(Dh * kTileQ)),
        k(c.floats(kTileK * Dh)),
        v(c.floats(kTileK * Dh)),
        p_t(c.floats(kTileK * kTileQ)),
        ds_t(c.floats(kTileK * kTileQ)),
        dq(c.floats(kTileQ * Dh)),
        neg_lse2(c.floats(kTileQ)),
        row_dot(c.floats(kTileQ)),
        seg(c.ints(kTileQ)) {}
};

// Copies `rows` rows of Dh floats, `stride` apart, into a dense [rows, Dh] tile. Tile products
// read operands from dense tiles: rows Hq * Dh floats apart (a power of two, often 2-8 KiB)
// would fall into a few L1 sets and evict each other.
void pack_rows(const float* src, int64_t stride, int64_t rows, int64_t Dh, float* dst) {
  for (int64_t r = 0; r < rows; ++r) std::copy_n(src + r * stride, Dh, dst + r * Dh);
}

// Document starts of queries [q0, q0 + nq), padded so that the extra lanes see no key.
void pad_seg(const int32_t* seg, int64_t nq, int32_t* padded) {
  std::copy_n(seg, nq, padded);
  std::fill(padded + nq, padded + kTileQ, std::numeric_limits<int32_t>::max());
}

template <typename Scratch>
size_t scratch_bytes(int64_t Dh) {
  ScratchCarver counter(nullptr);
  Scratch s(counter, Dh);
  return counter.used();
}

size_t forward_slot_bytes(int64_t Dh) { return scratch_bytes<ForwardScratch>(Dh); }
size_t backward_slot_bytes(int64_t Dh) {
  return std::max(scratch_bytes<KeyTileScratch>(Dh), scratch_bytes<QueryTileScratch>(Dh));
}
// D = rowsum(dO * O) [B, Hq, Tq], at the start of the backward's workspace.
size_t row_dot_bytes(const AttnDims& d) {
  return (static_cast<size_t>(d.B * d.Hq * d.Tq) * sizeof(float) + kScratchAlign - 1) /
         kScratchAlign * kScratchAlign;
}

size_t forward_workspace_bytes(const AttnDims& d, int threads) {
  return static_cast<size_t>(threads) * forward_slot_bytes(d.Dh);
}
size_t backward_workspace_bytes(const AttnDims& d, int threads) {
  return row_dot_bytes(d) + static_cast<size_t>(threads) * backward_slot_bytes(d.Dh);
}

// q [B, Tq, Hq, Dh]; k, v [B, Tk, Hkv, Dh]; seg_start [B, Tq] i32; out [B, Tq, Hq, Dh];
// lse [B, Hq, Tq]. The full-row ops pass offsets 0 and then require Tk == Tq.
AttnDims check_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                         int64_t q_offset, int64_t k_offset, const Tensor& out, const Tensor& lse,
                         std::string_view op) {
  check_tensor(q, DType::kF32, 4, op, "q [B, Tq, Hq, Dh]");
  check_tensor(k, DType::kF32, 4, op, "k [B, Tk, Hkv, Dh]");
  check_tensor(v, DType::kF32, 4, op, "v [B, Tk, Hkv, Dh]");
  check_same_shape(v, k, op, "v", "k");
  check_tensor(out, DType::kF32, 4, op, "out [B, Tq, Hq, Dh]");
  check_same_shape(out, q, op, "out", "q");
  check_tensor(lse, DType::kF32, 3, op, "lse [B, Hq, Tq]");
  check_tensor(seg_start, DType::kI32, 2, op, "seg_start [B, Tq]");
  const AttnDims d{q.dim(0), q.dim(1), k.dim(1), q.dim(2), k.dim(2), q.dim(3), q_offset, k_offset};
  SHARDLM_CHECK(k.dim(0) == d.B && k.dim(3) == d.Dh,
                "{}: k is {} but q is {}; k must be [B, Tk, Hkv, Dh] with q's B and Dh", op,
                k.shape().str(), q.shape().str());
  SHARDLM_CHECK(d.Hkv > 0 && d.Hq % d.Hkv == 0,
                "{}: Hq = {} must be a multiple of Hkv = {} (grouped-query attention)", op, d.Hq,
                d.Hkv);
  SHARDLM_CHECK(d.Dh > 0, "{}: head dim Dh must be positive, got {}", op, d.Dh);
  SHARDLM_CHECK(q_offset >= 0 && k_offset >= 0,
                "{}: q_offset = {} and k_offset = {} must be >= 0 (full-row indices of the blocks' "
                "first tokens)",
                op, q_offset, k_offset);
  // Lanes past a tile's end compute indices up to one vector beyond the block.
  constexpr int64_t kMaxIndex = std::numeric_limits<int32_t>::max() - 8;
  SHARDLM_CHECK(q_offset <= kMaxIndex - d.Tq && k_offset <= kMaxIndex - d.Tk,
                "{}: query block [{}, {}) or key block [{}, {}) does not fit the i32 positions of "
                "seg_start",
                op, q_offset, q_offset + d.Tq, k_offset, k_offset + d.Tk);
  SHARDLM_CHECK(lse.dim(0) == d.B && lse.dim(1) == d.Hq && lse.dim(2) == d.Tq,
                "{}: lse is {} but must be [B, Hq, Tq] = [{}, {}, {}]", op, lse.shape().str(), d.B,
                d.Hq, d.Tq);
  SHARDLM_CHECK(seg_start.dim(0) == d.B && seg_start.dim(1) == d.Tq,
                "{}: seg_start is {} but must be [B, Tq] = [{}, {}]", op, seg_start.shape().str(),
                d.B, d.Tq);
  const int32_t* seg = seg_start.numel() == 0 ? nullptr : seg_start.i32();
  for (int64_t b = 0; b < d.B; ++b) {
    for (int64_t t = 0; t < d.Tq; ++t) {
      const int32_t s = seg[b * d.Tq + t];
      SHARDLM_CHECK(s >= 0 && s <= q_offset + t,
                    "{}: seg_start[{}, {}] = {} must lie in [0, {}] (a token's document "
                    "starts at or before it; full-row indices)",
                    op, b, t, s, q_offset + t);
    }
  }
  return d;
}

// The full-row ops: keys and queries are the same tokens.
void check_full_row(const AttnDims& d, const Tensor& q, const Tensor& k, std::string_view op) {
  SHARDLM_CHECK(d.Tk == d.Tq,
                "{}: k is {} but q is {}; k must be [B, T, Hkv, Dh] with q's T (a block of keys "
                "goes to attention_block_*)",
                op, k.shape().str(), q.shape().str());
}

// Gradients of the backward: dq like q, dk and dv like k.
void check_gradients(const Tensor& q, const Tensor& k, const Tensor& dout, const Tensor& dq,
                     const Tensor& dk, const Tensor& dv, std::string_view op) {
  check_tensor(dout, DType::kF32, 4, op, "dout [B, Tq, Hq, Dh]");
  check_same_shape(dout, q, op, "dout", "q");
  check_tensor(dq, DType::kF32, 4, op, "dq [B, Tq, Hq, Dh]");
  check_same_shape(dq, q, op, "dq", "q");
  check_tensor(dk, DType::kF32, 4, op, "dk [B, Tk, Hkv, Dh]");
  check_same_shape(dk, k, op, "dk", "k");
  check_tensor(dv, DType::kF32, 4, op, "dv [B, Tk, Hkv, Dh]");
  check_same_shape(dv, k, op, "dv", "k");
}

// ---- forward -----------------------------------------------------------------------------------

// One (batch row, query head, query tile): out rows and lse entries of that tile. q0 and k0 are
// block-local, qf0 and kf0 the same tokens' full-row indices.
void forward_query_tile(const AttnDims& d, const float* q, const float* k, const float* v,
                        const int32_t* seg_start, float* out, float* lse, int64_t b, int64_t h,
                        int64_t qt, const ForwardScratch& s) {
  const int64_t Dh = d.Dh;
  const int64_t q0 = qt * kTileQ;
  const int64_t qf0 = d.q_offset + q0;
  const int64_t nq = std::min(kTileQ, d.Tq - q0);
  const int64_t nq_vecs = (nq + 7) / 8;
  const int32_t* seg = seg_start + b * d.Tq + q0;  // [nq]
  const float* q_tile = q + (b * d.Tq + q0) * d.q_row() + h * Dh;
  const int64_t kv_offset = b * d.Tk * d.kv_row() + (h / d.group()) * Dh;
  const float score_scale = kLog2e / std::sqrt(static_cast<float>(Dh));

  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t e = 0; e < Dh; ++e) {
      s.q_t[e * kTileQ + i] = q_tile[i * d.q_row() + e] * score_scale;
    }
  }
  pad_seg(seg, nq, s.seg);
  std::fill_n(s.o, nq * Dh, 0.0f);
  std::fill_n(s.m, kTileQ, kNegInf);
  std::fill_n(s.l, kTileQ, 0.0f);

  int64_t kt_begin, kt_end;
  key_tile_range(d, seg, qf0, nq, &kt_begin, &kt_end);
  for (int64_t kt = kt_begin; kt < kt_end; ++kt) {
    const int64_t k0 = kt * kTileK;
    const int64_t kf0 = d.k_offset + k0;
    const int64_t nk = std::min(kTileK, d.Tk - k0);
    const TileMask mask = classify_tile(seg, qf0, nq, kf0, nk);
    if (mask == TileMask::kNone) continue;
    pack_rows(k + kv_offset + k0 * d.kv_row(), d.kv_row(), nk, Dh, s.k);
    pack_rows(v + kv_offset + k0 * d.kv_row(), d.kv_row(), nk, Dh, s.v);

    // S^T [nk, nq] = K Q^T, in log2 units; keys as rows so every softmax step below is a
    // vector operation across queries.
    gemm(nk, nq, Dh, s.k, Dh, 1, s.q_t, kTileQ, s.s_t, kTileQ, false);
    // Online softmax, 8 queries at a time down their columns of S^T. Masked scores become
    // -inf. alpha = 2^(m_old - m_new) rescales what was summed so far; a query that has seen no
    // visible key yet keeps m = -inf, and subtracting 0 instead keeps its p = 0.
    for (int64_t w = 0; w < nq_vecs; ++w) {
      const Vec8i query = splat_i(static_cast<int32_t>(qf0 + 8 * w)) + kLane;
      const Vec8i seg_w = load8i(s.seg + 8 * w);
      const Vec8 m_old = load8(s.m + 8 * w);
      Vec8 m_new = m_old;
      for (int64_t j = 0; j < nk; ++j) {
        float* x = s.s_t + j * kTileQ + 8 * w;
        if (mask == TileMask::kPartial) {
          const Vec8i key = splat_i(static_cast<int32_t>(kf0 + j));
          store8(x, ((seg_w <= key) & (key <= query)) ? load8(x) : splat(kNegInf));
        }
        m_new = max8(m_new, load8(x));
      }
      const Vec8 m_safe = m_new == splat(kNegInf) ? splat(0.0f) : m_new;
      const Vec8 alpha = exp2_softmax(m_old - m_safe);
      Vec8 l = load8(s.l + 8 * w) * alpha;
      for (int64_t j = 0; j < nk; ++j) {
        float* x = s.s_t + j * kTileQ + 8 * w;
        const Vec8 p = exp2_softmax(load8(x) - m_safe);
        store8(x, p);
        l += p;
      }
      store8(s.m + 8 * w, m_new);
      store8(s.l + 8 * w, l);
      for (int64_t i = 8 * w; i < std::min(nq, 8 * w + 8); ++i) {
        for (int64_t e = 0; e < Dh; ++e) s.o[i * Dh + e] *= alpha[i - 8 * w];
      }
    }
    // O [nq, Dh] += P V, P read through P^T's strides.
    gemm(nq, Dh, nk, s.s_t, 1, kTileQ, s.v, Dh, s.o, Dh, true);
  }

  // A query that saw no key of the block has l = 0 and o = 0: out 0, lse -inf.
  float* out_tile = out + (b * d.Tq + q0) * d.q_row() + h * Dh;
  float* lse_row = lse + (b * d.Hq + h) * d.Tq + q0;
  for (int64_t i = 0; i < nq; ++i) {
    const bool seen = s.l[i] > 0.0f;
    const float inv_l = seen ? 1.0f / s.l[i] : 0.0f;
    for (int64_t e = 0; e < Dh; ++e) out_tile[i * d.q_row() + e] = s.o[i * Dh + e] * inv_l;
    lse_row[i] = seen ? (s.m[i] + std::log2(s.l[i])) * kLn2 : kNegInf;
  }
}

// ---- backward ----------------------------------------------------------------------------------

struct BackwardArgs {
  AttnDims d;
  const float* q;        // [B, Tq, Hq, Dh]
  const float* k;        // [B, Tk, Hkv, Dh]
  const float* v;        // [B, Tk, Hkv, Dh]
  const int32_t* seg;    // [B, Tq]
  const float* lse;      // [B, Hq, Tq]
  const float* dout;     // [B, Tq, Hq, Dh]
  const float* row_dot;  // [B, Hq, Tq] D = rowsum(dO * O)
  float* dq;             // [B, Tq, Hq, Dh]
  float* dk;             // [B, Tk, Hkv, Dh]
  float* dv;             // [B, Tk, Hkv, Dh]
  float score_scale;     // scale * log2(e)
  float scale;           // 1 / sqrt(Dh)
};

// Pass 1: dK, dV of key tile kt of kv head kvh, summed over every query head of its group and
// every query tile that sees it. With accumulate_dq (one thread owns the whole (b, kvh) group),
// dq += dS K as well, in the same order pass 2 would sum it. P and dS are computed with the
// same lane arithmetic as pass 2, so either way gives the same bits.
void backward_key_tile(const BackwardArgs& a, int64_t b, int64_t kvh, int64_t kt,
                       bool accumulate_dq, const KeyTileScratch& s) {
  const AttnDims& d = a.d;
  const int64_t Dh = d.Dh;
  const int64_t k0 = kt * kTileK;
  const int64_t kf0 = d.k_offset + k0;
  const int64_t nk = std::min(kTileK, d.Tk - k0);
  const int64_t nk_vecs = (nk + 7) / 8;
  const int64_t kv_tile_offset = (b * d.Tk + k0) * d.kv_row() + kvh * Dh;
  pack_rows(a.k + kv_tile_offset, d.kv_row(), nk, Dh, s.k);
  for (int64_t j = 0; j < nk; ++j) {
    for (int64_t e = 0; e < Dh; ++e) {
      s.k_t[e * kTileK + j] = s.k[j * Dh + e];
      s.v_t[e * kTileK + j] = a.v[kv_tile_offset + j * d.kv_row() + e];
    }
  }
  std::fill_n(s.dk, nk * Dh, 0.0f);
  std::fill_n(s.dv, nk * Dh, 0.0f);
  const Vec8 score_scale = splat(a.score_scale);
  const Vec8 scale = splat(a.scale);

  for (int64_t h = kvh * d.group(); h < (kvh + 1) * d.group(); ++h) {
    for (int64_t qt = first_query_tile(d, kf0); qt < d.q_tiles(); ++qt) {
      const int64_t q0 = qt * kTileQ;
      const int64_t qf0 = d.q_offset + q0;
      const int64_t nq = std::min(kTileQ, d.Tq - q0);
      const int32_t* seg = a.seg + b * d.Tq + q0;  // [nq]
      const TileMask mask = classify_tile(seg, qf0, nq, kf0, nk);
      if (mask == TileMask::kNone) continue;
      const int64_t q_tile_offset = (b * d.Tq + q0) * d.q_row() + h * Dh;
      const float* lse_row = a.lse + (b * d.Hq + h) * d.Tq + q0;
      const float* dot_row = a.row_dot + (b * d.Hq + h) * d.Tq + q0;
      pack_rows(a.q + q_tile_offset, d.q_row(), nq, Dh, s.q);
      pack_rows(a.dout + q_tile_offset, d.q_row(), nq, Dh, s.dout);

      // P [nq, nk] recomputed from lse.
      gemm(nq, nk, Dh, s.q, Dh, 1, s.k_t, kTileK, s.p, kTileK, false);
      for (int64_t i = 0; i < nq; ++i) {
        float* row = s.p + i * kTileK;
        const Vec8 neg_lse2 = splat(-(lse_row[i] * kLog2e));
        const Vec8i seg_i = splat_i(seg[i]);
        const Vec8i query = splat_i(static_cast<int32_t>(qf0 + i));
        for (int64_t w = 0; w < nk_vecs; ++w) {
          Vec8 p = exp2_softmax(fma8(load8(row + 8 * w), score_scale, neg_lse2));
          if (mask == TileMask::kPartial) {
            const Vec8i key = splat_i(static_cast<int32_t>(kf0 + 8 * w)) + kLane;
            p = ((seg_i <= key) & (key <= query)) ? p : splat(0.0f);
          }
          store8(row + 8 * w, p);
        }
      }
      // dV [nk, Dh] += P^T dO
      gemm(nk, Dh, nq, s.p, 1, kTileK, s.dout, Dh, s.dv, Dh, true);
      // dP [nq, nk] = dO V^T;  dS = scale * P (dP - D)
      gemm(nq, nk, Dh, s.dout, Dh, 1, s.v_t, kTileK, s.ds, kTileK, false);
      for (int64_t i = 0; i < nq; ++i) {
        const Vec8 dot = splat(dot_row[i]);
        for (int64_t w = 0; w < nk_vecs; ++w) {
          float* ds = s.ds + i * kTileK + 8 * w;
          store8(ds, load8(s.p + i * kTileK + 8 * w) * (load8(ds) - dot) * scale);
        }
      }
      // dK [nk, Dh] += dS^T Q
      gemm(nk, Dh, nq, s.ds, 1, kTileK, s.q, Dh, s.dk, Dh, true);
      if (accumulate_dq) {
        gemm(nq, Dh, nk, s.ds, kTileK, 1, s.k, Dh, a.dq + q_tile_offset, d.q_row(), true);
      }
    }
  }
  for (int64_t j = 0; j < nk; ++j) {
    std::copy_n(s.dk + j * Dh, Dh, a.dk + kv_tile_offset + j * d.kv_row());
    std::copy_n(s.dv + j * Dh, Dh, a.dv + kv_tile_offset + j * d.kv_row());
  }
}

// Pass 2: dQ of one query tile of query head h, summed over key tiles in increasing order.
void backward_query_tile(const BackwardArgs& a, int64_t b, int64_t h, int64_t qt,
                         const QueryTileScratch& s) {
  const AttnDims& d = a.d;
  const int64_t Dh = d.Dh;
  const int64_t q0 = qt * kTileQ;
  const int64_t qf0 = d.q_offset + q0;
  const int64_t nq = std::min(kTileQ, d.Tq - q0);
  const int64_t nq_vecs = (nq + 7) / 8;
  const int32_t* seg = a.seg + b * d.Tq + q0;  // [nq]
  const int64_t q_tile_offset = (b * d.Tq + q0) * d.q_row() + h * Dh;
  const float* q_tile = a.q + q_tile_offset;
  const float* do_tile = a.dout + q_tile_offset;
  const float* lse_row = a.lse + (b * d.Hq + h) * d.Tq + q0;
  const float* dot_row = a.row_dot + (b * d.Hq + h) * d.Tq + q0;
  const int64_t kv_offset = b * d.Tk * d.kv_row() + (h / d.group()) * Dh;
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t e = 0; e < Dh; ++e) {
      s.q_t[e * kTileQ + i] = q_tile[i * d.q_row() + e];
      s.do_t[e * kTileQ + i] = do_tile[i * d.q_row() + e];
    }
  }
  for (int64_t i = 0; i < kTileQ; ++i) {
    s.neg_lse2[i] = i < nq ? -(lse_row[i] * kLog2e) : 0.0f;
    s.row_dot[i] = i < nq ? dot_row[i] : 0.0f;
  }
  pad_seg(seg, nq, s.seg);
  std::fill_n(s.dq, nq * Dh, 0.0f);
  const Vec8 score_scale = splat(a.score_scale);
  const Vec8 scale = splat(a.scale);

  int64_t kt_begin, kt_end;
  key_tile_range(d, seg, qf0, nq, &kt_begin, &kt_end);
  for (int64_t kt = kt_begin; kt < kt_end; ++kt) {
    const int64_t k0 = kt * kTileK;
    const int64_t kf0 = d.k_offset + k0;
    const int64_t nk = std::min(kTileK, d.Tk - k0);
    const TileMask mask = classify_tile(seg, qf0, nq, kf0, nk);
    if (mask == TileMask::kNone) continue;
    pack_rows(a.k + kv_offset + k0 * d.kv_row(), d.kv_row(), nk, Dh, s.k);
    pack_rows(a.v + kv_offset + k0 * d.kv_row(), d.kv_row(), nk, Dh, s.v);

    // P^T [nk, nq]: pass 1's P, transposed.
    gemm(nk, nq, Dh, s.k, Dh, 1, s.q_t, kTileQ, s.p_t, kTileQ, false);
    for (int64_t j = 0; j < nk; ++j) {
      float* row = s.p_t + j * kTileQ;
      const Vec8i key = splat_i(static_cast<int32_t>(kf0 + j));
      for (int64_t w = 0; w < nq_vecs; ++w) {
        Vec8 p = exp2_softmax(fma8(load8(row + 8 * w), score_scale, load8(s.neg_lse2 + 8 * w)));
        if (mask == TileMask::kPartial) {
          const Vec8i query = splat_i(static_cast<int32_t>(qf0 + 8 * w)) + kLane;
          p = ((load8i(s.seg + 8 * w) <= key) & (key <= query)) ? p : splat(0.0f);
        }
        store8(row + 8 * w, p);
      }
    }
    // dP^T [nk, nq] = V dO^T;  dS^T = scale * P^T (dP^T - D)
    gemm(nk, nq, Dh, s.v, Dh, 1, s.do_t, kTileQ, s.ds_t, kTileQ, false);
    for (int64_t j = 0; j < nk; ++j) {
      for (int64_t w = 0; w < nq_vecs; ++w) {
        float* ds = s.ds_t + j * kTileQ + 8 * w;
        store8(ds,
               load8(s.p_t + j * kTileQ + 8 * w) * (load8(ds) - load8(s.row_dot + 8 * w)) * scale);
      }
    }
    // dQ [nq, Dh] += dS K
    gemm(nq, Dh, nk, s.ds_t, 1, kTileQ, s.k, Dh, s.dq, Dh, true);
  }
  for (int64_t i = 0; i < nq; ++i) {
    std::copy_n(s.dq + i * Dh, Dh, a.dq + q_tile_offset + i * d.q_row());
  }
}

// Every check is done; `sizing` names the workspace query for the error message.
void run_forward(const AttnDims& d, const Tensor& q, const Tensor& k, const Tensor& v,
                 const Tensor& seg_start, const Tensor& out, const Tensor& lse, Workspace ws,
                 std::string_view op, std::string_view sizing) {
  const int threads = omp_get_max_threads();
  const size_t slot_bytes = forward_slot_bytes(d.Dh);
  SHARDLM_CHECK(ws.bytes >= forward_workspace_bytes(d, threads),
                "{}: workspace has {} bytes but {} threads need {}; size it with {}() after "
                "fixing the OpenMP thread count",
                op, ws.bytes, threads, forward_workspace_bytes(d, threads), sizing);
  if (q.numel() == 0) return;
  const float* qp = q.f32();
  const float* kp = k.numel() == 0 ? nullptr : k.f32();
  const float* vp = v.numel() == 0 ? nullptr : v.f32();
  const int32_t* seg = seg_start.i32();
  float* outp = out.f32();
  float* lsep = lse.f32();
  const int64_t q_tiles = d.q_tiles();
  const int64_t items = d.B * d.Hq * q_tiles;

#pragma omp parallel num_threads(threads)
  {
    ScratchCarver carver(ws.data + static_cast<size_t>(omp_get_thread_num()) * slot_bytes);
    const ForwardScratch scratch(carver, d.Dh);
    // Largest query tiles (most keys) first, so the dynamic schedule ends evenly.
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t qt = q_tiles - 1 - item / (d.B * d.Hq);
      const int64_t bh = item % (d.B * d.Hq);
      forward_query_tile(d, qp, kp, vp, seg, outp, lsep, bh / d.Hq, bh % d.Hq, qt, scratch);
    }
  }
}

void run_backward(const AttnDims& d, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& seg_start, const Tensor& out, const Tensor& lse, const Tensor& dout,
                  const Tensor& dq, const Tensor& dk, const Tensor& dv, Workspace ws,
                  std::string_view op, std::string_view sizing) {
  const int threads = omp_get_max_threads();
  SHARDLM_CHECK(ws.bytes >= backward_workspace_bytes(d, threads),
                "{}: workspace has {} bytes but {} threads need {}; size it with {}() after "
                "fixing the OpenMP thread count",
                op, ws.bytes, threads, backward_workspace_bytes(d, threads), sizing);
  if (k.numel() == 0 && dq.numel() != 0) std::fill_n(dq.f32(), dq.numel(), 0.0f);
  if (q.numel() == 0 && dk.numel() != 0) {
    std::fill_n(dk.f32(), dk.numel(), 0.0f);
    std::fill_n(dv.f32(), dv.numel(), 0.0f);
  }
  if (q.numel() == 0 || k.numel() == 0) return;

  float* row_dot = reinterpret_cast<float*>(ws.data);  // [B, Hq, Tq]
  std::byte* slots = ws.data + row_dot_bytes(d);
  const size_t slot_bytes = backward_slot_bytes(d.Dh);
  const BackwardArgs a{d,
                       q.f32(),
                       k.f32(),
                       v.f32(),
                       seg_start.i32(),
                       lse.f32(),
                       dout.f32(),
                       row_dot,
                       dq.f32(),
                       dk.f32(),
                       dv.f32(),
                       kLog2e / std::sqrt(static_cast<float>(d.Dh)),
                       1.0f / std::sqrt(static_cast<float>(d.Dh))};
  const float* outp = out.f32();

  // Either one item per (b, kv head) does everything, dq included (5 tile products per tile
  // pair), or dK/dV items per key tile and dQ items per query tile run as two passes (7
  // products, since S and dP are recomputed, but many more items). Pick the shorter estimate.
  const int64_t groups = d.B * d.Hkv;
  const int64_t rounds = (groups + threads - 1) / threads;
  const bool fused = 5 * rounds * threads <= 7 * groups;
  const int64_t k_tiles = d.k_tiles();
  const int64_t q_tiles = d.q_tiles();

#pragma omp parallel num_threads(threads)
  {
    std::byte* slot = slots + static_cast<size_t>(omp_get_thread_num()) * slot_bytes;
#pragma omp for schedule(static)
    for (int64_t row = 0; row < d.B * d.Tq; ++row) {
      const int64_t b = row / d.Tq;
      const int64_t t = row % d.Tq;
      for (int64_t h = 0; h < d.Hq; ++h) {
        const float* o_row = outp + row * d.q_row() + h * d.Dh;
        const float* do_row = a.dout + row * d.q_row() + h * d.Dh;
        double acc = 0.0;
        for (int64_t e = 0; e < d.Dh; ++e) acc += double(o_row[e]) * double(do_row[e]);
        row_dot[(b * d.Hq + h) * d.Tq + t] = static_cast<float>(acc);
      }
      if (fused) std::fill_n(a.dq + row * d.q_row(), d.q_row(), 0.0f);
    }  // implicit barrier: D and the zeroed dq are complete

    ScratchCarver key_carver(slot);
    const KeyTileScratch key_scratch(key_carver, d.Dh);
    if (fused) {
#pragma omp for schedule(dynamic, 1)
      for (int64_t g = 0; g < groups; ++g) {
        for (int64_t kt = 0; kt < k_tiles; ++kt) {
          backward_key_tile(a, g / d.Hkv, g % d.Hkv, kt, true, key_scratch);
        }
      }
    } else {
      // Key tiles near the start see the most queries: they go first.
#pragma omp for schedule(dynamic, 1) nowait
      for (int64_t item = 0; item < groups * k_tiles; ++item) {
        const int64_t g = item % groups;
        backward_key_tile(a, g / d.Hkv, g % d.Hkv, item / groups, false, key_scratch);
      }
      ScratchCarver query_carver(slot);
      const QueryTileScratch query_scratch(query_carver, d.Dh);
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < d.B * d.Hq * q_tiles; ++item) {
        const int64_t qt = q_tiles - 1 - item / (d.B * d.Hq);
        const int64_t bh = item % (d.B * d.Hq);
        backward_query_tile(a, bh / d.Hq, bh % d.Hq, qt, query_scratch);
      }
    }
  }
}

}  // namespace

size_t attention_block_workspace_bytes(int64_t B, int64_t Tq, int64_t Tk, int64_t Hq, int64_t Hkv,
                                       int64_t Dh) {
  const AttnDims d{B, Tq, Tk, Hq, Hkv, Dh, 0, 0};
  const int threads = omp_get_max_threads();
  return std::max(forward_workspace_bytes(d, threads), backward_workspace_bytes(d, threads));
}

size_t attention_workspace_bytes(int64_t B, int64_t T, int64_t Hq, int64_t Hkv, int64_t Dh) {
  return attention_block_workspace_bytes(B, T, T, Hq, Hkv, Dh);
}

// q [B, T, Hq, Dh]; k, v [B, T, Hkv, Dh]; seg_start [B, T] i32; out [B, T, Hq, Dh] and
// lse [B, Hq, T] overwritten
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                       const Tensor& out, const Tensor& lse, Workspace ws) {
  const std::string_view op = "attention_forward";
  const AttnDims d = check_attention(q, k, v, seg_start, 0, 0, out, lse, op);
  check_full_row(d, q, k, op);
  run_forward(d, q, k, v, seg_start, out, lse, ws, op, "attention_workspace_bytes");
}

// dout [B, T, Hq, Dh]; dq [B, T, Hq, Dh], dk, dv [B, T, Hkv, Dh] overwritten
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                        const Tensor& out, const Tensor& lse, const Tensor& dout, const Tensor& dq,
                        const Tensor& dk, const Tensor& dv, Workspace ws) {
  const std::string_view op = "attention_backward";
  const AttnDims d = check_attention(q, k, v, seg_start, 0, 0, out, lse, op);
  check_full_row(d, q, k, op);
  check_gradients(q, k, dout, dq, dk, dv, op);
  run_backward(d, q, k, v, seg_start, out, lse, dout, dq, dk, dv, ws, op,
               "attention_workspace_bytes");
}

// q [B, Tq, Hq, Dh]; k, v [B, Tk, Hkv, Dh]; seg_start [B, Tq] i32 (full-row indices);
// out [B, Tq, Hq, Dh] and lse [B, Hq, Tq] overwritten
void attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& seg_start, int64_t q_offset, int64_t k_offset,
                             const Tensor& out, const Tensor& lse, Workspace ws) {
  const std::string_view op = "attention_block_forward";
  const AttnDims d = check_attention(q, k, v, seg_start, q_offset, k_offset, out, lse, op);
  run_forward(d, q, k, v, seg_start, out, lse, ws, op, "attention_block_workspace_bytes");
}

// out, lse: the queries' final (merged) results; dout [B, Tq, Hq, Dh]; dq [B, Tq, Hq, Dh],
// dk, dv [B, Tk, Hkv, Dh] overwritten with this block's share
void attention_block_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& seg_start, int64_t q_offset, int64_t k_offset,
                              const Tensor& out, const Tensor& lse, const Tensor& dout,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv, Workspace ws) {
  const std::string_view op = "attention_block_backward";
  const AttnDims d = check_attention(q, k, v, seg_start, q_offset, k_offset, out, lse, op);
  check_gradients(q, k, dout, dq, dk, dv, op);
  run_backward(d, q, k, v, seg_start, out, lse, dout, dq, dk, dv, ws, op,
               "attention_block_workspace_bytes");
}

}  // namespace shardlm::cpu
