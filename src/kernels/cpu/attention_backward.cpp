// Causal flash attention backward on the CPU, for the blocks attention_forward.cpp computes:
// P is recomputed from lse and D = rowsum(dO * O) [B, Hq, Tq] sits at the workspace's start; no
// [T, T] buffer, no BLAS calls, no allocation. Either one pass per (b, kv head) or a dK/dV pass
// and a dQ pass, whichever the thread count favours; both give the same bits, so the backward
// is race-free and bit-identical for any thread count. Tensors other than lse are f32 or bf16;
// every gradient is summed in f32 tile scratch and rounded once, when stored.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <string_view>
#include <type_traits>

#include "kernels/cpu/attention_common.h"
#include "kernels/cpu/attention_tile.h"
#include "kernels/cpu/ops.h"

namespace shardlm::cpu {
namespace {

using namespace attn;  // NOLINT: the attention helpers are this file's vocabulary
using namespace tile;  // NOLINT: the tile helpers are this file's vocabulary

// Pass 1 of the backward: one key tile against every query tile that sees it.
struct KeyTileScratch {
  float* k;      // [kTileK, Dh] packed
  float* k_t;    // [Dh, kTileK]
  float* v_t;    // [Dh, kTileK]
  float* q;      // [kTileQ, Dh] packed
  float* dout;   // [kTileQ, Dh] packed
  float* p;      // [kTileQ, kTileK] probabilities
  float* ds;     // [kTileQ, kTileK] dP, then dS (scaled)
  float* slope;  // [kTileQ, kTileK] d(capped score) / d(score), under a soft cap
  float* dk;     // [kTileK, Dh]
  float* dv;     // [kTileK, Dh]
  explicit KeyTileScratch(ScratchCarver& c, int64_t Dh)
      : k(c.floats(kTileK * Dh)),
        k_t(c.floats(Dh * kTileK)),
        v_t(c.floats(Dh * kTileK)),
        q(c.floats(kTileQ * Dh)),
        dout(c.floats(kTileQ * Dh)),
        p(c.floats(kTileQ * kTileK)),
        ds(c.floats(kTileQ * kTileK)),
        slope(c.floats(kTileQ * kTileK)),
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
  float* slope_t;   // [kTileK, kTileQ] d(capped score) / d(score), under a soft cap
  float* dq;        // [kTileQ, Dh]
  float* neg_lse2;  // [kTileQ] -lse in log2 units
  float* row_dot;   // [kTileQ] D
  int32_t* seg;     // [kTileQ] first visible keys, padded with INT32_MAX
  explicit QueryTileScratch(ScratchCarver& c, int64_t Dh)
      : q_t(c.floats(Dh * kTileQ)),
        do_t(c.floats(Dh * kTileQ)),
        k(c.floats(kTileK * Dh)),
        v(c.floats(kTileK * Dh)),
        p_t(c.floats(kTileK * kTileQ)),
        ds_t(c.floats(kTileK * kTileQ)),
        slope_t(c.floats(kTileK * kTileQ)),
        dq(c.floats(kTileQ * Dh)),
        neg_lse2(c.floats(kTileQ)),
        row_dot(c.floats(kTileQ)),
        seg(c.ints(kTileQ)) {}
};

size_t backward_slot_bytes(int64_t Dh) {
  return std::max(scratch_bytes<KeyTileScratch>(Dh), scratch_bytes<QueryTileScratch>(Dh));
}
// D = rowsum(dO * O) [B, Hq, Tq], at the start of the backward's workspace.
size_t row_dot_bytes(const AttnDims& d) {
  return (static_cast<size_t>(d.B * d.Hq * d.Tq) * sizeof(float) + kScratchAlign - 1) /
         kScratchAlign * kScratchAlign;
}

// T: the storage of q, k, v, dout and the gradients (f32 or bf16); lse and D are f32.
template <typename T>
struct BackwardArgs {
  AttnDims d;
  const T* q;            // [B, Tq, Hq, Dh]
  const T* k;            // [B, Tk, Hkv, Dh]
  const T* v;            // [B, Tk, Hkv, Dh]
  const int32_t* seg;    // [B, Tq], nullptr: one document per row
  const float* lse;      // [B, Hq, Tq]
  const T* dout;         // [B, Tq, Hq, Dh]
  const float* row_dot;  // [B, Hq, Tq] D = rowsum(dO * O)
  T* dq;                 // [B, Tq, Hq, Dh]
  T* dk;                 // [B, Tk, Hkv, Dh]
  T* dv;                 // [B, Tk, Hkv, Dh]
  float score_scale;     // scale * log2(e)
  float scale;           // 1 / sqrt(Dh)
};

// Soft-capped scores in log2 units from raw products q . k (8 lanes at raw): scaled, capped, and
// the cap's slope stored at slope, by the same arithmetic in both passes.
inline Vec8 capped_score(const float* raw, Vec8 scale, float softcap, float* slope) {
  Vec8 derivative;
  const Vec8 capped = softcap_log2(load8(raw) * scale, softcap, kLog2e, &derivative);
  store8(slope, derivative);
  return capped;
}

// Pass 1: dK, dV of key tile kt of kv head kvh, summed over every query head of its group and
// every query tile that sees it. With accumulate_dq (one thread owns the whole (b, kvh) group),
// dq += dS K as well, in the same order pass 2 would sum it. P and dS are computed with the
// same lane arithmetic as pass 2, so either way gives the same bits. dq is summed in place
// across key tiles, so only f32 storage takes accumulate_dq.
template <typename T>
void backward_key_tile(const BackwardArgs<T>& a, int64_t b, int64_t kvh, int64_t kt,
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
      s.v_t[e * kTileK + j] = load(a.v + kv_tile_offset + j * d.kv_row() + e);
    }
  }
  std::fill_n(s.dk, nk * Dh, 0.0f);
  std::fill_n(s.dv, nk * Dh, 0.0f);
  const Vec8 score_scale = splat(a.score_scale);
  const Vec8 scale = splat(a.scale);
  const bool capped = d.softcap > 0.0f;

  for (int64_t h = kvh * d.group(); h < (kvh + 1) * d.group(); ++h) {
    for (int64_t qt = first_query_tile(d, kf0); qt < end_query_tile(d, kf0, nk); ++qt) {
      const int64_t q0 = qt * kTileQ;
      const int64_t qf0 = d.q_offset + q0;
      const int64_t nq = std::min(kTileQ, d.Tq - q0);
      const int32_t* seg = a.seg ? a.seg + b * d.Tq + q0 : nullptr;  // [nq]
      const TileMask mask = classify_tile(seg, qf0, nq, kf0, nk, d.window);
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
        const Vec8i seg_i =
            splat_i(static_cast<int32_t>(first_visible_key(seg ? seg[i] : 0, qf0 + i, d.window)));
        const Vec8i query = splat_i(static_cast<int32_t>(qf0 + i));
        for (int64_t w = 0; w < nk_vecs; ++w) {
          Vec8 p = capped ? exp2_softmax(capped_score(row + 8 * w, scale, d.softcap,
                                                      s.slope + i * kTileK + 8 * w) +
                                         neg_lse2)
                          : exp2_softmax(fma8(load8(row + 8 * w), score_scale, neg_lse2));
          if (mask == TileMask::kPartial) {
            const Vec8i key = splat_i(static_cast<int32_t>(kf0 + 8 * w)) + kLane;
            p = ((seg_i <= key) & (key <= query)) ? p : splat(0.0f);
          }
          store8(row + 8 * w, p);
        }
      }
      // dV [nk, Dh] += P^T dO
      gemm(nk, Dh, nq, s.p, 1, kTileK, s.dout, Dh, s.dv, Dh, true);
      // dP [nq, nk] = dO V^T;  dS = scale * P (dP - D), times the cap's slope where capped
      gemm(nq, nk, Dh, s.dout, Dh, 1, s.v_t, kTileK, s.ds, kTileK, false);
      for (int64_t i = 0; i < nq; ++i) {
        const Vec8 dot = splat(dot_row[i]);
        for (int64_t w = 0; w < nk_vecs; ++w) {
          float* ds = s.ds + i * kTileK + 8 * w;
          Vec8 g = load8(s.p + i * kTileK + 8 * w) * (load8(ds) - dot);
          if (capped) g *= load8(s.slope + i * kTileK + 8 * w);
          store8(ds, g * scale);
        }
      }
      // dK [nk, Dh] += dS^T Q
      gemm(nk, Dh, nq, s.ds, 1, kTileK, s.q, Dh, s.dk, Dh, true);
      if constexpr (std::is_same_v<T, float>) {
        if (accumulate_dq) {
          gemm(nq, Dh, nk, s.ds, kTileK, 1, s.k, Dh, a.dq + q_tile_offset, d.q_row(), true);
        }
      }
    }
  }
  for (int64_t j = 0; j < nk; ++j) {
    store_row(s.dk + j * Dh, Dh, a.dk + kv_tile_offset + j * d.kv_row());
    store_row(s.dv + j * Dh, Dh, a.dv + kv_tile_offset + j * d.kv_row());
  }
}

// Pass 2: dQ of one query tile of query head h, summed over key tiles in increasing order.
template <typename T>
void backward_query_tile(const BackwardArgs<T>& a, int64_t b, int64_t h, int64_t qt,
                         const QueryTileScratch& s) {
  const AttnDims& d = a.d;
  const int64_t Dh = d.Dh;
  const int64_t q0 = qt * kTileQ;
  const int64_t qf0 = d.q_offset + q0;
  const int64_t nq = std::min(kTileQ, d.Tq - q0);
  const int64_t nq_vecs = (nq + 7) / 8;
  const int32_t* seg = a.seg ? a.seg + b * d.Tq + q0 : nullptr;  // [nq]
  const int64_t q_tile_offset = (b * d.Tq + q0) * d.q_row() + h * Dh;
  const T* q_tile = a.q + q_tile_offset;
  const T* do_tile = a.dout + q_tile_offset;
  const float* lse_row = a.lse + (b * d.Hq + h) * d.Tq + q0;
  const float* dot_row = a.row_dot + (b * d.Hq + h) * d.Tq + q0;
  const int64_t kv_offset = b * d.Tk * d.kv_row() + (h / d.group()) * Dh;
  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t e = 0; e < Dh; ++e) {
      s.q_t[e * kTileQ + i] = load(q_tile + i * d.q_row() + e);
      s.do_t[e * kTileQ + i] = load(do_tile + i * d.q_row() + e);
    }
  }
  for (int64_t i = 0; i < kTileQ; ++i) {
    s.neg_lse2[i] = i < nq ? -(lse_row[i] * kLog2e) : 0.0f;
    s.row_dot[i] = i < nq ? dot_row[i] : 0.0f;
  }
  pad_seg(seg, qf0, nq, d.window, s.seg);
  std::fill_n(s.dq, nq * Dh, 0.0f);
  const Vec8 score_scale = splat(a.score_scale);
  const Vec8 scale = splat(a.scale);
  const bool capped = d.softcap > 0.0f;

  int64_t kt_begin, kt_end;
  key_tile_range(d, seg, qf0, nq, &kt_begin, &kt_end);
  for (int64_t kt = kt_begin; kt < kt_end; ++kt) {
    const int64_t k0 = kt * kTileK;
    const int64_t kf0 = d.k_offset + k0;
    const int64_t nk = std::min(kTileK, d.Tk - k0);
    const TileMask mask = classify_tile(seg, qf0, nq, kf0, nk, d.window);
    if (mask == TileMask::kNone) continue;
    pack_rows(a.k + kv_offset + k0 * d.kv_row(), d.kv_row(), nk, Dh, s.k);
    pack_rows(a.v + kv_offset + k0 * d.kv_row(), d.kv_row(), nk, Dh, s.v);

    // P^T [nk, nq]: pass 1's P, transposed.
    gemm(nk, nq, Dh, s.k, Dh, 1, s.q_t, kTileQ, s.p_t, kTileQ, false);
    for (int64_t j = 0; j < nk; ++j) {
      float* row = s.p_t + j * kTileQ;
      const Vec8i key = splat_i(static_cast<int32_t>(kf0 + j));
      for (int64_t w = 0; w < nq_vecs; ++w) {
        const Vec8 neg_lse2 = load8(s.neg_lse2 + 8 * w);
        Vec8 p = capped ? exp2_softmax(capped_score(row + 8 * w, scale, d.softcap,
                                                    s.slope_t + j * kTileQ + 8 * w) +
                                       neg_lse2)
                        : exp2_softmax(fma8(load8(row + 8 * w), score_scale, neg_lse2));
        if (mask == TileMask::kPartial) {
          const Vec8i query = splat_i(static_cast<int32_t>(qf0 + 8 * w)) + kLane;
          p = ((load8i(s.seg + 8 * w) <= key) & (key <= query)) ? p : splat(0.0f);
        }
        store8(row + 8 * w, p);
      }
    }
    // dP^T [nk, nq] = V dO^T;  dS^T = scale * P^T (dP^T - D), times the cap's slope where capped
    gemm(nk, nq, Dh, s.v, Dh, 1, s.do_t, kTileQ, s.ds_t, kTileQ, false);
    for (int64_t j = 0; j < nk; ++j) {
      for (int64_t w = 0; w < nq_vecs; ++w) {
        float* ds = s.ds_t + j * kTileQ + 8 * w;
        Vec8 g = load8(s.p_t + j * kTileQ + 8 * w) * (load8(ds) - load8(s.row_dot + 8 * w));
        if (capped) g *= load8(s.slope_t + j * kTileQ + 8 * w);
        store8(ds, g * scale);
      }
    }
    // dQ [nq, Dh] += dS K
    gemm(nq, Dh, nk, s.ds_t, 1, kTileQ, s.k, Dh, s.dq, Dh, true);
  }
  for (int64_t i = 0; i < nq; ++i) {
    store_row(s.dq + i * Dh, Dh, a.dq + q_tile_offset + i * d.q_row());
  }
}

// D = rowsum(dO * O) [B, Hq, Tq] in f64, from out as stored (rounded, where bf16), and, where
// the fused schedule sums dq in place, dq zeroed. A work-sharing loop of the caller's parallel
// region: its implicit barrier ends it.
template <typename T>
void row_dot_and_zero_dq(const BackwardArgs<T>& a, const T* out, float* row_dot, bool fused) {
  const AttnDims& d = a.d;
#pragma omp for schedule(static)
  for (int64_t row = 0; row < d.B * d.Tq; ++row) {
    const int64_t b = row / d.Tq;
    const int64_t t = row % d.Tq;
    for (int64_t h = 0; h < d.Hq; ++h) {
      const T* o_row = out + row * d.q_row() + h * d.Dh;
      const T* do_row = a.dout + row * d.q_row() + h * d.Dh;
      double acc = 0.0;
      for (int64_t e = 0; e < d.Dh; ++e) acc += double(load(o_row + e)) * double(load(do_row + e));
      row_dot[(b * d.Hq + h) * d.Tq + t] = static_cast<float>(acc);
    }
    if (fused) std::fill_n(a.dq + row * d.q_row(), d.q_row(), T{});
  }
}

// Every check is done: ws holds backward_workspace_bytes(d, threads) at least (the entry point
// checked it against the workspace query). T: the storage of every tensor but lse and seg_start.
template <typename T>
void run_backward(const AttnDims& d, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& seg_start, const Tensor& out, const Tensor& lse, const Tensor& dout,
                  const Tensor& dq, const Tensor& dk, const Tensor& dv, Workspace ws) {
  const int threads = omp_get_max_threads();
  if (k.numel() == 0 && dq.numel() != 0) std::fill_n(elems<T>(dq), dq.numel(), T{});
  if (q.numel() == 0 && dk.numel() != 0) {
    std::fill_n(elems<T>(dk), dk.numel(), T{});
    std::fill_n(elems<T>(dv), dv.numel(), T{});
  }
  if (q.numel() == 0 || k.numel() == 0) return;

  float* row_dot = reinterpret_cast<float*>(ws.data);  // [B, Hq, Tq]
  std::byte* slots = ws.data + row_dot_bytes(d);
  const size_t slot_bytes = backward_slot_bytes(d.Dh);
  const BackwardArgs<T> a{d,
                          elems<T>(q),
                          elems<T>(k),
                          elems<T>(v),
                          seg_start.empty() ? nullptr : seg_start.i32(),
                          lse.f32(),
                          elems<T>(dout),
                          row_dot,
                          elems<T>(dq),
                          elems<T>(dk),
                          elems<T>(dv),
                          kLog2e / std::sqrt(static_cast<float>(d.Dh)),
                          1.0f / std::sqrt(static_cast<float>(d.Dh))};
  const T* outp = elems<T>(out);

  // Either one item per (b, kv head) does everything, dq included (5 tile products per tile
  // pair), or dK/dV items per key tile and dQ items per query tile run as two passes (7
  // products, since S and dP are recomputed, but many more items). Pick the shorter estimate.
  // The fused items sum dq across key tiles in dq itself; bf16 would round it at every tile (or
  // need an f32 dq as large as dq in the workspace), so bf16 always takes the two passes, whose
  // dq tiles stay in f32 scratch until complete.
  const int64_t groups = d.B * d.Hkv;
  const int64_t rounds = (groups + threads - 1) / threads;
  const bool fused = std::is_same_v<T, float> && 5 * rounds * threads <= 7 * groups;
  const int64_t k_tiles = d.k_tiles();
  const int64_t q_tiles = d.q_tiles();

#pragma omp parallel num_threads(threads)
  {
    std::byte* slot = slots + static_cast<size_t>(omp_get_thread_num()) * slot_bytes;
    row_dot_and_zero_dq(a, outp, row_dot, fused);  // ends in a barrier: D and dq are complete

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

size_t attn::backward_workspace_bytes(const AttnDims& d, int threads) {
  return row_dot_bytes(d) + static_cast<size_t>(threads) * backward_slot_bytes(d.Dh);
}

// dout [B, T, Hq, Dh]; dq [B, T, Hq, Dh], dk, dv [B, T, Hkv, Dh] overwritten; every tensor but
// lse (f32) and seg_start (i32) one dtype, f32 or bf16
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                        const Tensor& out, const Tensor& lse, const Tensor& dout, const Tensor& dq,
                        const Tensor& dk, const Tensor& dv, Workspace ws, int64_t window,
                        float softcap) {
  const AttnDims d = check_attention(q, k, seg_start, 0, 0, window, softcap, "attention_backward");
  with_float(q, [&](auto tag) {
    run_backward<decltype(tag)>(d, q, k, v, seg_start, out, lse, dout, dq, dk, dv, ws);
  });
}

// out, lse: the queries' final (merged) results; dout [B, Tq, Hq, Dh]; dq [B, Tq, Hq, Dh],
// dk, dv [B, Tk, Hkv, Dh] overwritten with this block's share; dtypes as attention_backward
void attention_block_backward(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& seg_start, int64_t q_offset, int64_t k_offset,
                              const Tensor& out, const Tensor& lse, const Tensor& dout,
                              const Tensor& dq, const Tensor& dk, const Tensor& dv, Workspace ws,
                              int64_t window, float softcap) {
  const AttnDims d = check_attention(q, k, seg_start, q_offset, k_offset, window, softcap,
                                     "attention_block_backward");
  with_float(q, [&](auto tag) {
    run_backward<decltype(tag)>(d, q, k, v, seg_start, out, lse, dout, dq, dk, dv, ws);
  });
}

}  // namespace shardlm::cpu
