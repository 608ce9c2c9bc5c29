// Causal flash attention forward on the CPU: online softmax over 64x64 query/key tiles,
// grouped-query heads and document masks (seg_start), for a block of queries against a block of
// keys anywhere in the full row (ring attention); full attention is the block at offsets 0.
// Memory is per-thread tile scratch, never a [T, T] buffer; tile products run on the f32 GEMM of
// attention_tile.h (f32 accumulation), with no BLAS calls and no allocation. q, k, v and out are
// f32 or bf16: tiles are f32 whatever the storage, and out is rounded once, when stored.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string_view>

#include "kernels/cpu/attention_common.h"
#include "kernels/cpu/attention_tile.h"
#include "kernels/cpu/ops.h"

namespace shardlm::cpu {
namespace {

using namespace attn;  // NOLINT: the attention helpers are this file's vocabulary
using namespace tile;  // NOLINT: the tile helpers are this file's vocabulary

constexpr float kLn2 = 0.693147180559945309f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct ForwardScratch {
  float* q_t;    // [Dh, kTileQ] query tile, transposed, pre-scaled by scale * log2(e) (by scale
                 // alone under a soft cap, which applies to natural-unit scores)
  float* s_t;    // [kTileK, kTileQ] scores, then probabilities, keys as rows
  float* k;      // [kTileK, Dh] key tile, packed
  float* v;      // [kTileK, Dh] value tile, packed
  float* o;      // [kTileQ, Dh] unnormalised output accumulator
  float* m;      // [kTileQ] running max (log2 units)
  float* l;      // [kTileQ] running sum of 2^(s - m)
  int32_t* seg;  // [kTileQ] the queries' first visible keys, padded with INT32_MAX
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

size_t forward_slot_bytes(int64_t Dh) { return scratch_bytes<ForwardScratch>(Dh); }

// One (batch row, query head, query tile): out rows and lse entries of that tile. q0 and k0 are
// block-local, qf0 and kf0 the same tokens' full-row indices. T: the storage of q, k, v, out.
template <typename T>
void forward_query_tile(const AttnDims& d, const T* q, const T* k, const T* v,
                        const int32_t* seg_start, T* out, float* lse, int64_t b, int64_t h,
                        int64_t qt, const ForwardScratch& s) {
  const int64_t Dh = d.Dh;
  const int64_t q0 = qt * kTileQ;
  const int64_t qf0 = d.q_offset + q0;
  const int64_t nq = std::min(kTileQ, d.Tq - q0);
  const int64_t nq_vecs = (nq + 7) / 8;
  const int32_t* seg = seg_start ? seg_start + b * d.Tq + q0 : nullptr;  // [nq]
  const T* q_tile = q + (b * d.Tq + q0) * d.q_row() + h * Dh;
  const int64_t kv_offset = b * d.Tk * d.kv_row() + (h / d.group()) * Dh;
  const bool capped = d.softcap > 0.0f;
  const float score_scale = (capped ? 1.0f : kLog2e) / std::sqrt(static_cast<float>(Dh));

  for (int64_t i = 0; i < nq; ++i) {
    for (int64_t e = 0; e < Dh; ++e) {
      s.q_t[e * kTileQ + i] = load(q_tile + i * d.q_row() + e) * score_scale;
    }
  }
  pad_seg(seg, qf0, nq, d.window, s.seg);
  std::fill_n(s.o, nq * Dh, 0.0f);
  std::fill_n(s.m, kTileQ, kNegInf);
  std::fill_n(s.l, kTileQ, 0.0f);

  int64_t kt_begin, kt_end;
  key_tile_range(d, seg, qf0, nq, &kt_begin, &kt_end);
  for (int64_t kt = kt_begin; kt < kt_end; ++kt) {
    const int64_t k0 = kt * kTileK;
    const int64_t kf0 = d.k_offset + k0;
    const int64_t nk = std::min(kTileK, d.Tk - k0);
    const TileMask mask = classify_tile(seg, qf0, nq, kf0, nk, d.window);
    if (mask == TileMask::kNone) continue;
    pack_rows(k + kv_offset + k0 * d.kv_row(), d.kv_row(), nk, Dh, s.k);
    pack_rows(v + kv_offset + k0 * d.kv_row(), d.kv_row(), nk, Dh, s.v);

    // S^T [nk, nq] = K Q^T, in log2 units (soft-capped first, where capped); keys as rows so
    // every softmax step below is a vector operation across queries.
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
        if (capped) store8(x, softcap_log2(load8(x), d.softcap, kLog2e, nullptr));
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
  T* out_tile = out + (b * d.Tq + q0) * d.q_row() + h * Dh;
  float* lse_row = lse + (b * d.Hq + h) * d.Tq + q0;
  for (int64_t i = 0; i < nq; ++i) {
    const bool seen = s.l[i] > 0.0f;
    const float inv_l = seen ? 1.0f / s.l[i] : 0.0f;
    for (int64_t e = 0; e < Dh; ++e) store(out_tile + i * d.q_row() + e, s.o[i * Dh + e] * inv_l);
    lse_row[i] = seen ? (s.m[i] + std::log2(s.l[i])) * kLn2 : kNegInf;
  }
}

// Every check is done: ws holds forward_workspace_bytes(d, threads) at least (the entry point
// checked it against the workspace query, the larger of the forward's and the backward's need).
// T: the storage of q, k, v and out (one dtype, checked by the entry point).
template <typename T>
void run_forward(const AttnDims& d, const Tensor& q, const Tensor& k, const Tensor& v,
                 const Tensor& seg_start, const Tensor& out, const Tensor& lse, Workspace ws) {
  const int threads = omp_get_max_threads();
  const size_t slot_bytes = forward_slot_bytes(d.Dh);
  if (q.numel() == 0) return;
  const T* qp = elems<T>(q);
  const T* kp = k.numel() == 0 ? nullptr : elems<T>(k);
  const T* vp = v.numel() == 0 ? nullptr : elems<T>(v);
  const int32_t* seg = seg_start.empty() ? nullptr : seg_start.i32();
  T* outp = elems<T>(out);
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

}  // namespace

size_t attn::forward_workspace_bytes(const AttnDims& d, int threads) {
  return static_cast<size_t>(threads) * forward_slot_bytes(d.Dh);
}

// q [B, T, Hq, Dh]; k, v [B, T, Hkv, Dh]; seg_start [B, T] i32; out [B, T, Hq, Dh] and
// lse [B, Hq, T] f32 overwritten; q, k, v, out one dtype, f32 or bf16
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                       const Tensor& out, const Tensor& lse, Workspace ws, int64_t window,
                       float softcap) {
  const AttnDims d = check_attention(q, k, seg_start, 0, 0, window, softcap, "attention_forward");
  with_float(q, [&](auto tag) { run_forward<decltype(tag)>(d, q, k, v, seg_start, out, lse, ws); });
}

// q [B, Tq, Hq, Dh]; k, v [B, Tk, Hkv, Dh]; seg_start [B, Tq] i32 (full-row indices);
// out [B, Tq, Hq, Dh] and lse [B, Hq, Tq] f32 overwritten; q, k, v, out one dtype, f32 or bf16
void attention_block_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& seg_start, int64_t q_offset, int64_t k_offset,
                             const Tensor& out, const Tensor& lse, Workspace ws, int64_t window,
                             float softcap) {
  const AttnDims d = check_attention(q, k, seg_start, q_offset, k_offset, window, softcap,
                                     "attention_block_forward");
  with_float(q, [&](auto tag) { run_forward<decltype(tag)>(d, q, k, v, seg_start, out, lse, ws); });
}

}  // namespace shardlm::cpu
