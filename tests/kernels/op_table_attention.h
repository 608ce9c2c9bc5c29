// The op table's attention and loss cases (op_table.h), against op_table_refs.h: causal
// document-masked attention with GQA and sliding windows, its context-parallel block form and
// merge, decoding against a KV cache, the fused LM head + cross-entropy and the vocabulary-parallel
// slices.
#pragma once

namespace shardlm::test::ops::cases {

// The longest f32 chains of attention over shape a: the scores (Dh), the softmax's sum and the
// weighted values (Tk each), and each element's exp; backward also sums a key's gradient over
// every query of its group (Tq * Hq / Hkv). In bf16 a flash kernel rounds the probabilities
// before the weighted sum (forward: 2 roundings with the output), and backward the probabilities,
// their gradients and the output (kAttentionBackwardRoundings).
constexpr int kAttentionForwardRoundings = 2, kAttentionBackwardRoundings = 4;
inline int64_t attention_forward_chain(const AttnShape& a) {
  return a.Dh + 2 * a.Tk + kElementChain;
}
inline int64_t attention_backward_chain(const AttnShape& a) {
  return attention_forward_chain(a) + a.Dh + a.Tk + a.Tq * (a.Hq / a.Hkv);
}

// seg_start [B, T] of rows made of documents that start at the given offsets.
inline std::vector<int32_t> segments(int64_t B, int64_t T, std::vector<int64_t> starts) {
  std::vector<int32_t> seg(static_cast<size_t>(B * T));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      int64_t s = 0;
      for (int64_t x : starts)
        if (x <= t) s = x;
      seg[b * T + t] = int32_t(b == 0 ? s : 0);  // row 0 packed documents, row 1 one document
    }
  return seg;
}

// Whole-row attention of shape a with document starts seg [B, T], or none (seg empty: one
// document per row, seg_start passed empty; on CUDA in bf16 the form cuDNN takes), under a
// sliding window of `window` keys (0: none; query t sees key s iff also t - s < window).
inline void attention_whole_row_cases(std::vector<OpCase>& c, const AttnShape a,
                                      const std::vector<int32_t>& seg, const std::string& label,
                                      int64_t window = 0) {
  auto visible = [a, seg, window](int64_t b, int64_t t, int64_t s) {
    return (seg.empty() ? 0 : seg[b * a.Tq + t]) <= s && s <= t && (window == 0 || t - s < window);
  };
  auto seg_start = [a, seg](OpRun& r) {
    return seg.empty() ? Tensor() : r.ids(seg).view({a.B, a.Tq});
  };
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back({"attention_forward", label, dt,
                 tol_of(dt, attention_forward_chain(a), kAttentionForwardRoundings), true,
                 [=](OpRun& r) {
                   Values q = OpRun::randn(a.B * a.Tq * a.Hq * a.Dh, 50),
                          k = OpRun::randn(a.B * a.Tk * a.Hkv * a.Dh, 51),
                          v = OpRun::randn(a.B * a.Tk * a.Hkv * a.Dh, 52);
                   const Tensor tq = r.in(q, {a.B, a.Tq, a.Hq, a.Dh}),
                                tk = r.in(k, {a.B, a.Tk, a.Hkv, a.Dh}),
                                tv = r.in(v, {a.B, a.Tk, a.Hkv, a.Dh}),
                                out = r.out({a.B, a.Tq, a.Hq, a.Dh}),
                                lse = r.out({a.B, a.Hq, a.Tq}, DType::kF32);
                   Values want, want_lse;
                   attention_ref(a, q, k, v, visible, want, want_lse);
                   r.be.attention_forward(
                       tq, tk, tv, seg_start(r), out, lse,
                       r.ws(r.be.attention_workspace_bytes(a.B, a.Tq, a.Hq, a.Hkv, a.Dh)), {},
                       window, float(a.softcap));
                   r.check(out, want, "out");
                   r.check(lse, want_lse, "lse");
                 }});
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back(
        {"attention_backward", label, dt,
         tol_of(dt, attention_backward_chain(a), kAttentionBackwardRoundings), true, [=](OpRun& r) {
           Values q = OpRun::randn(a.B * a.Tq * a.Hq * a.Dh, 53),
                  k = OpRun::randn(a.B * a.Tk * a.Hkv * a.Dh, 54),
                  v = OpRun::randn(a.B * a.Tk * a.Hkv * a.Dh, 55),
                  dout = OpRun::randn(a.B * a.Tq * a.Hq * a.Dh, 56);
           Values out, lse, dq, dk, dv;
           // out and lse from the reference, rounded as the backend holds them
           const Tensor tq = r.in(q, {a.B, a.Tq, a.Hq, a.Dh}),
                        tk = r.in(k, {a.B, a.Tk, a.Hkv, a.Dh}),
                        tv = r.in(v, {a.B, a.Tk, a.Hkv, a.Dh});
           attention_ref(a, q, k, v, visible, out, lse);
           const Tensor tout = r.in(out, {a.B, a.Tq, a.Hq, a.Dh}),
                        tlse = r.in(lse, {a.B, a.Hq, a.Tq}, DType::kF32),
                        tdo = r.in(dout, {a.B, a.Tq, a.Hq, a.Dh}),
                        tdq = r.out({a.B, a.Tq, a.Hq, a.Dh}), tdk = r.out({a.B, a.Tk, a.Hkv, a.Dh}),
                        tdv = r.out({a.B, a.Tk, a.Hkv, a.Dh});
           attention_backward_ref(a, q, k, v, visible, out, lse, dout, dq, dk, dv);
           r.be.attention_backward(
               tq, tk, tv, seg_start(r), tout, tlse, tdo, tdq, tdk, tdv,
               r.ws(r.be.attention_workspace_bytes(a.B, a.Tq, a.Hq, a.Hkv, a.Dh)), {}, window,
               float(a.softcap));
           r.check(tdq, dq, "dq");
           r.check(tdk, dk, "dk");
           r.check(tdv, dv, "dv");
         }});
}

inline void attention_whole_cases(std::vector<OpCase>& c) {
  // Row 0 holds documents starting at 0, 11 and 30, row 1 one document.
  const AttnShape docs{2, 37, 37, 4, 2, 16};
  attention_whole_row_cases(c, docs, segments(docs.B, docs.Tq, {0, 11, 30}),
                            "B2 T37 Hq4 Hkv2 Dh16, documents");
  attention_whole_row_cases(c, AttnShape{2, 37, 37, 4, 2, 64}, {},
                            "B2 T37 Hq4 Hkv2 Dh64, one document per row");
  // Sliding windows shorter than the documents, as long as the first (11) and longer than the
  // rows; the longer row spans three 64-key tiles, so a window of 20 skips whole tiles.
  attention_whole_row_cases(c, docs, segments(docs.B, docs.Tq, {0, 11, 30}),
                            "B2 T37 Hq4 Hkv2 Dh16, documents, window 4", 4);
  attention_whole_row_cases(c, docs, segments(docs.B, docs.Tq, {0, 11, 30}),
                            "B2 T37 Hq4 Hkv2 Dh16, documents, window 11", 11);
  attention_whole_row_cases(c, AttnShape{2, 37, 37, 4, 2, 64}, {},
                            "B2 T37 Hq4 Hkv2 Dh64, one document per row, window 40", 40);
  const AttnShape long_rows{2, 150, 150, 2, 1, 8};
  attention_whole_row_cases(c, long_rows, segments(long_rows.B, long_rows.Tq, {0, 70}),
                            "B2 T150 Hq2 Hkv1 Dh8, documents, window 20", 20);
  attention_whole_row_cases(c, long_rows, {},
                            "B2 T150 Hq2 Hkv1 Dh8, one document per row, window 33", 33);
  // Gemma 2's soft cap on the scaled scores (caps inside their range, so tanh bends them),
  // with documents, with a window, and on the long rows.
  const AttnShape capped{2, 37, 37, 4, 2, 16, 1.0};
  attention_whole_row_cases(c, capped, segments(capped.B, capped.Tq, {0, 11, 30}),
                            "B2 T37 Hq4 Hkv2 Dh16, documents, softcap 1");
  attention_whole_row_cases(c, capped, {}, "B2 T37 Hq4 Hkv2 Dh16, one document per row, softcap 1");
  attention_whole_row_cases(c, AttnShape{2, 150, 150, 2, 1, 8, 0.5}, {},
                            "B2 T150 Hq2 Hkv1 Dh8, one document per row, window 20, softcap 0.5",
                            20);
}

// Queries at [40, 63) of their rows against keys at [17, 46): partly before, partly on the
// diagonal; row 0's documents start at 0 and 45 (some queries see no key of the block). A
// sliding window (> 0) moves the first visible key up to t - window + 1 (full-row indices).
inline void attention_block_pair_cases(std::vector<OpCase>& c, int64_t window,
                                       const std::string& label, double softcap = 0) {
  const AttnShape a{2, 23, 29, 4, 1, 8, softcap};
  const int64_t qo = 40, ko = 17;
  std::vector<int32_t> seg(static_cast<size_t>(a.B * a.Tq));
  for (int64_t t = 0; t < a.Tq; ++t) {
    seg[t] = qo + t >= 45 ? 45 : 0;
    seg[a.Tq + t] = 0;
  }
  auto visible = [=](int64_t b, int64_t t, int64_t s) {
    return seg[b * a.Tq + t] <= ko + s && ko + s <= qo + t &&
           (window == 0 || qo + t - (ko + s) < window);
  };
  const Shape qs{a.B, a.Tq, a.Hq, a.Dh}, ks{a.B, a.Tk, a.Hkv, a.Dh}, ls{a.B, a.Hq, a.Tq};
  auto ws = [=](OpRun& r) {
    return r.ws(r.be.attention_block_workspace_bytes(a.B, a.Tq, a.Tk, a.Hq, a.Hkv, a.Dh));
  };
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back({"attention_block_forward", label, dt,
                 tol_of(dt, attention_forward_chain(a), kAttentionForwardRoundings), true,
                 [=](OpRun& r) {
                   Values q = OpRun::randn(qs.numel(), 57), k = OpRun::randn(ks.numel(), 58),
                          v = OpRun::randn(ks.numel(), 59), out, lse;
                   const Tensor tq = r.in(q, qs), tk = r.in(k, ks), tv = r.in(v, ks),
                                tout = r.out(qs), tlse = r.out(ls, DType::kF32);
                   attention_ref(a, q, k, v, visible, out, lse);
                   r.be.attention_block_forward(tq, tk, tv, r.ids(seg).view({a.B, a.Tq}), qo, ko,
                                                tout, tlse, ws(r), window, float(a.softcap));
                   r.check(tout, out, "out");
                   r.check(tlse, lse, "lse");
                 }});
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back(
        {"attention_block_backward", label, dt,
         tol_of(dt, attention_backward_chain(a), kAttentionBackwardRoundings), true, [=](OpRun& r) {
           Values q = OpRun::randn(qs.numel(), 60), k = OpRun::randn(ks.numel(), 61),
                  v = OpRun::randn(ks.numel(), 62), dout = OpRun::randn(qs.numel(), 63);
           const Tensor tq = r.in(q, qs), tk = r.in(k, ks), tv = r.in(v, ks);
           Values out, lse, dq, dk, dv;
           attention_ref(a, q, k, v, visible, out, lse);  // the block is the whole set
           const Tensor tout = r.in(out, qs), tlse = r.in(lse, ls, DType::kF32),
                        tdo = r.in(dout, qs), tdq = r.out(qs), tdk = r.out(ks), tdv = r.out(ks);
           attention_backward_ref(a, q, k, v, visible, out, lse, dout, dq, dk, dv);
           r.be.attention_block_backward(tq, tk, tv, r.ids(seg).view({a.B, a.Tq}), qo, ko, tout,
                                         tlse, tdo, tdq, tdk, tdv, ws(r), window, float(a.softcap));
           r.check(tdq, dq, "dq");
           r.check(tdk, dk, "dk");
           r.check(tdv, dv, "dv");
         }});
}

inline void attention_block_cases(std::vector<OpCase>& c) {
  attention_block_pair_cases(c, 0, "Tq23 at 40, Tk29 at 17, Hkv1");
  // Window 10: queries from 55 on see no key of the block; window 30: the keys before 17 would
  // be in reach, the block's own first keys partly.
  attention_block_pair_cases(c, 10, "Tq23 at 40, Tk29 at 17, Hkv1, window 10");
  attention_block_pair_cases(c, 30, "Tq23 at 40, Tk29 at 17, Hkv1, window 30");
  attention_block_pair_cases(c, 0, "Tq23 at 40, Tk29 at 17, Hkv1, softcap 0.8", 0.8);
  attention_block_pair_cases(c, 10, "Tq23 at 40, Tk29 at 17, Hkv1, window 10, softcap 1.5", 1.5);
  const AttnShape a{2, 23, 29, 4, 1, 8};
  const Shape qs{a.B, a.Tq, a.Hq, a.Dh}, ls{a.B, a.Hq, a.Tq};
  // out, out_b of the case's dtype; lse, lse_b f32.
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back({"attention_merge", "B2 T23 Hq4 Dh8, -inf on either side", dt,
                 tol_of(dt, kElementChain), true, [=](OpRun& r) {
                   Values out = OpRun::randn(qs.numel(), 64), out_b = OpRun::randn(qs.numel(), 65),
                          lse = OpRun::randn(ls.numel(), 66), lse_b = OpRun::randn(ls.numel(), 67);
                   const double inf = std::numeric_limits<double>::infinity();
                   lse[3] = -inf;    // the running side saw nothing
                   lse_b[5] = -inf;  // the block saw nothing
                   lse[7] = lse_b[7] = -inf;
                   for (int64_t d = 0; d < a.Dh; ++d) out[a.qi(0, 3, 0) + d] = 0;
                   const Tensor to = r.in(out, qs), tl = r.in(lse, ls, DType::kF32),
                                tob = r.in(out_b, qs), tlb = r.in(lse_b, ls, DType::kF32);
                   Values want = out, want_lse = lse;
                   for (int64_t b = 0; b < a.B; ++b)
                     for (int64_t h = 0; h < a.Hq; ++h)
                       for (int64_t t = 0; t < a.Tq; ++t) {
                         const int64_t li = a.li(b, h, t);
                         const double m = std::max(lse[li], lse_b[li]);
                         if (std::isinf(m)) continue;  // both empty: unchanged
                         const double wa = std::exp(lse[li] - m), wb = std::exp(lse_b[li] - m);
                         want_lse[li] = m + std::log(wa + wb);
                         for (int64_t d = 0; d < a.Dh; ++d) {
                           const int64_t i = a.qi(b, t, h) + d;
                           want[i] = (out[i] * wa + out_b[i] * wb) / (wa + wb);
                         }
                       }
                   r.be.attention_merge(to, tl, tob, tlb);
                   r.check(to, want, "out");
                   r.check(tl, want_lse, "lse");
                 }});
}

inline void attention_decode_cases(std::vector<OpCase>& c) {
  // 3 new queries after 45 cached positions of a 64-row cache (rows past 48 are garbage), without
  // and with a soft cap on the scores.
  const int64_t B = 1, Tq = 3, Tmax = 64, Hq = 6, Hkv = 2, Dh = 12, len = 45;
  for (const double softcap : {0.0, 0.7})
    for (const DType dt : {DType::kF32, DType::kBF16})
      c.push_back({"attention_decode",
                   softcap > 0 ? "Tq3 after 45 of 64, Hq6 Hkv2, softcap 0.7"
                               : "Tq3 after 45 of 64, Hq6 Hkv2",
                   dt, tol_of(dt, Dh + 2 * len + kElementChain, kAttentionForwardRoundings), true,
                   [=](OpRun& r) {
                     Values q = OpRun::randn(B * Tq * Hq * Dh, 68),
                            k = OpRun::randn(B * Tmax * Hkv * Dh, 69),
                            v = OpRun::randn(B * Tmax * Hkv * Dh, 70);
                     for (int64_t i = (len + Tq) * Hkv * Dh; i < Tmax * Hkv * Dh; ++i)
                       k[i] = v[i] = 1e30;  // never read
                     const Tensor tq = r.in(q, {B, Tq, Hq, Dh}), tk = r.in(k, {B, Tmax, Hkv, Dh}),
                                  tv = r.in(v, {B, Tmax, Hkv, Dh}), out = r.out({B, Tq, Hq, Dh});
                     const AttnShape a{B, Tq, Tmax, Hq, Hkv, Dh, softcap};
                     Values want, lse;
                     attention_ref(
                         a, q, k, v, [=](int64_t, int64_t t, int64_t s) { return s <= len + t; },
                         want, lse);
                     r.be.attention_decode(
                         tq, tk, tv, len, out,
                         r.ws(r.be.attention_decode_workspace_bytes(B, Tq, Tmax, Hq, Dh)),
                         float(softcap));
                     r.check(out, want, "out");
                   }});
}

inline void attention_cases(std::vector<OpCase>& c) {
  attention_whole_cases(c);
  attention_block_cases(c);
  attention_decode_cases(c);
}

// ---- losses ----------------------------------------------------------------------------------

// Gemma 2's final soft cap on reference logits [n]: capped in place, their slopes 1 - tanh^2
// returned (all ones without a cap).
inline Values softcap_ref(Values& logits, double cap) {
  Values slope(logits.size(), 1.0);
  if (cap <= 0) return slope;
  for (size_t i = 0; i < logits.size(); ++i) {
    const double t = std::tanh(logits[i] / cap);
    logits[i] = cap * t;
    slope[i] = 1.0 - t * t;
  }
  return slope;
}

inline std::string cap_label(double cap) {
  return cap > 0 ? ", softcap " + std::to_string(int(cap)) : "";
}

inline void lm_head_loss_cases(std::vector<OpCase>& c, double cap) {
  // dw f32 or w's dtype; the logits chunk is f32 in the workspace whatever the dtype
  for (const auto& [dt, dw_dt] :
       {std::pair{DType::kF32, DType::kF32}, std::pair{DType::kBF16, DType::kF32},
        std::pair{DType::kBF16, DType::kBF16}})
    c.push_back({"lm_head_loss",
                 std::string("N23 D17 V101, chunks of 5, ignored rows, grads") +
                     (dt == DType::kF32      ? ""
                      : dw_dt == DType::kF32 ? ", f32 dw"
                                             : ", bf16 dw") +
                     cap_label(cap),
                 // the logits' gradient a bf16 operand of the two products, then their outputs
                 dt, tol_of(dt, 17 + 101 + 23 + kElementChain, 2), true, [dw_dt, cap](OpRun& r) {
                   const int64_t N = 23, D = 17, V = 101;
                   Values h = OpRun::randn(N * D, 71), w = OpRun::randn(V * D, 72, 0.5),
                          dw = OpRun::randn(V * D, 73);
                   std::vector<int32_t> tg = token_ids(N, V, 74);
                   tg[2] = tg[9] = kIgnoreIndex;
                   const Tensor th = r.in(h, {N, D}), tw = r.in(w, {V, D}), tdh = r.out({N, D}),
                                tdw = r.in(dw, {V, D}, dw_dt);
                   Values logits = matmul_nt(h, w, N, D, V);
                   const Values slope = softcap_ref(logits, cap);
                   Values g;
                   int64_t valid = 0;
                   const double loss = xent_ref(logits, tg, V, 0.25, &g, &valid);
                   for (size_t i = 0; i < g.size(); ++i) g[i] *= slope[i];
                   Values dh(static_cast<size_t>(N * D), 0.0);
                   for (int64_t n = 0; n < N; ++n)
                     for (int64_t j = 0; j < V; ++j)
                       for (int64_t d = 0; d < D; ++d) {
                         dh[n * D + d] += g[n * V + j] * w[j * D + d];
                         dw[j * D + d] += g[n * V + j] * h[n * D + d];
                       }
                   const LossResult got = r.be.lm_head_loss(
                       th, tw, r.ids(tg), 5, 0.25f, tdh, tdw,
                       r.ws(r.be.lm_head_loss_workspace_bytes(5, V, th.dtype())), float(cap));
                   r.check(Values{got.loss_sum}, Values{loss}, "loss_sum");
                   EXPECT_EQ(got.n_valid, valid);
                   r.check(tdh, dh, "dh");
                   r.check(tdw, dw, "dw");
                 }});
}

// One rank's slice [30, 71) of a vocabulary of 97; the "reduced" statistics are this slice's
// own (a one-rank group), so the finished loss is the slice's cross-entropy. Under a cap every
// op reads capped logits and the gradient is taken through the cap.
inline void xent_slice_cases(std::vector<OpCase>& c, double cap) {
  const int64_t n = 13, Vs = 41, vb = 30, V = 97;
  auto targets = [=] {
    std::vector<int32_t> t = token_ids(n, V, 75);
    t[1] = kIgnoreIndex;
    t[4] = int32_t(vb + 3);  // one surely inside the slice
    return t;
  };
  // l: the capped logits
  auto stats_ref = [=](const Values& l, const std::vector<int32_t>& t, Values& mx, Values& st) {
    mx.assign(static_cast<size_t>(n), -std::numeric_limits<double>::infinity());
    st.assign(static_cast<size_t>(2 * n), 0.0);
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t j = 0; j < Vs; ++j) mx[i] = std::max(mx[i], l[i * Vs + j]);
      if (t[i] == kIgnoreIndex) continue;
      for (int64_t j = 0; j < Vs; ++j) st[2 * i] += std::exp(l[i * Vs + j] - mx[i]);
      if (t[i] >= vb && t[i] < vb + Vs) st[2 * i + 1] = l[i * Vs + t[i] - vb];
    }
  };
  const float fcap = float(cap);
  // The logits of the case's dtype (the gradient rounded once into them), the statistics f32.
  // The max is exact and the statistics come from exact inputs in f32 and f64: their tolerances
  // hold in bf16 too (capped in f32 against f64: an element's chain for the max as well).
  for (const DType dt : {DType::kF32, DType::kBF16}) {
    c.push_back({"xent_slice_max", "n13 of a slice of 41" + cap_label(cap), dt,
                 cap > 0 ? tol_of(DType::kF32, kElementChain) : 0, true, [=](OpRun& r) {
                   Values l = OpRun::randn(n * Vs, 76, 3.0), mx, st;
                   const Tensor tl = r.in(l, {n, Vs}), tm = r.out({n}, DType::kF32);
                   softcap_ref(l, cap);
                   stats_ref(l, targets(), mx, st);
                   r.be.xent_slice_max(tl, tm, fcap);
                   r.check(tm, mx, "row_max");
                 }});
    c.push_back({"xent_slice_stats", "n13, slice [30, 71) of 97" + cap_label(cap), dt,
                 tol_of(DType::kF32, Vs + kElementChain), true, [=](OpRun& r) {
                   Values l = OpRun::randn(n * Vs, 77, 3.0), mx, st;
                   const std::vector<int32_t> t = targets();
                   const Tensor tl = r.in(l, {n, Vs});
                   softcap_ref(l, cap);
                   stats_ref(l, t, mx, st);
                   const Tensor tm = r.in(mx, {n}, DType::kF32), ts = r.out({n, 2}, DType::kF32);
                   r.be.xent_slice_stats(tl, r.ids(t), vb, V, tm, ts, fcap);
                   r.check(ts, st, "stats");
                 }});
    c.push_back({"xent_slice_finish", "n13, slice [30, 71) of 97, with gradients" + cap_label(cap),
                 dt, tol_of(dt, Vs + kElementChain), true, [=](OpRun& r) {
                   Values l = OpRun::randn(n * Vs, 78, 3.0), mx, st;
                   const std::vector<int32_t> t = targets();
                   const Tensor tl = r.in(l, {n, Vs});
                   const Values l_stored = l;  // as the backend holds them (rounded by in())
                   const Values slope = softcap_ref(l, cap);
                   stats_ref(l, t, mx, st);
                   const Tensor tm = r.in(mx, {n}, DType::kF32), ts = r.in(st, {n, 2}, DType::kF32);
                   double loss = 0;
                   int64_t valid = 0;
                   Values g(static_cast<size_t>(n * Vs), 0.0);
                   for (int64_t i = 0; i < n; ++i) {
                     if (t[i] == kIgnoreIndex) continue;
                     ++valid;
                     loss += std::log(st[2 * i]) + mx[i] - st[2 * i + 1];
                     for (int64_t j = 0; j < Vs; ++j)
                       g[i * Vs + j] = 0.5 *
                                       (std::exp(l[i * Vs + j] - mx[i]) / st[2 * i] -
                                        (t[i] == vb + j ? 1.0 : 0.0)) *
                                       slope[i * Vs + j];
                   }
                   // The accumulator holds an earlier chunk's (1.25, 3): the forward-only
                   // finish and the one with gradients each add the slice's loss to it.
                   const Tensor acc = r.f64s({1.25, 3.0}), tt = r.ids(t);
                   const Workspace ws = r.ws(r.be.xent_slice_workspace_bytes(n));
                   r.be.xent_slice_finish(tl, tt, vb, tm, ts, 0.5f, false, acc, ws, fcap);
                   r.check(tl, l_stored, "logits, untouched without gradients");
                   r.be.xent_slice_finish(tl, tt, vb, tm, ts, 0.5f, true, acc, ws, fcap);
                   const LossResult got = r.be.read_loss(acc);
                   r.check(Values{got.loss_sum}, Values{1.25 + 2 * loss}, "loss_sum");
                   EXPECT_EQ(got.n_valid, 3 + 2 * valid);
                   r.check(tl, g, "logits -> gradient");
                   // No accumulator: nothing added (a piece whose rows another call counted).
                   r.be.xent_slice_finish(tl, tt, vb, tm, ts, 0.5f, false, Tensor(), ws, fcap);
                   const LossResult again = r.be.read_loss(acc);
                   EXPECT_EQ(again.loss_sum, got.loss_sum);
                   EXPECT_EQ(again.n_valid, got.n_valid);
                 }});
  }
}

inline void loss_cases(std::vector<OpCase>& c) {
  // Without a cap, and with Gemma 2's final soft cap inside the logits' range (std 3 on the
  // slices, ~2 on the head's), so tanh bends them.
  for (const double cap : {0.0, 2.0}) {
    lm_head_loss_cases(c, cap);
    xent_slice_cases(c, cap);
  }
  // read_loss gives back the accumulator's f64 sum bit for bit and its count as an integer
  // (exact: a count is an integer below 2^53), and leaves the accumulator as it was.
  c.push_back(
      {"read_loss", "a loss sum and a count of 2^40 + 1", DType::kF32, 0, true, [](OpRun& r) {
         const double sum = 12345.678901234567, count = 1099511627777.0;
         const Tensor acc = r.f64s({sum, count});
         const LossResult got = r.be.read_loss(acc);
         EXPECT_EQ(got.loss_sum, sum);
         EXPECT_EQ(got.n_valid, int64_t{1099511627777});
         EXPECT_EQ(r.get_f64(acc), (Values{sum, count}));
       }});
  c.push_back({"adamw_step", "n1001, step 7, decay, clip scale", DType::kF32,
               tol_of(DType::kF32, kElementChain), true, [](OpRun& r) {
                 Values p = OpRun::randn(1001, 79), g = OpRun::randn(1001, 80),
                        m = OpRun::randn(1001, 81, 0.1), v = OpRun::randn(1001, 82, 0.1);
                 for (double& x : v) x = x * x;
                 const Tensor tp = r.in(p, {1001}), tg = r.in(g, {1001}), tm = r.in(m, {1001}),
                              tv = r.in(v, {1001});
                 AdamWHyper hp;
                 hp.lr = 1e-2f, hp.weight_decay = 0.1f, hp.step = 7, hp.grad_scale = 0.5f;
                 const double b1 = hp.beta1, b2 = hp.beta2, lr = hp.lr, wd = hp.weight_decay;
                 for (size_t i = 0; i < p.size(); ++i) {
                   const double gi = g[i] * double(hp.grad_scale);
                   p[i] -= lr * wd * p[i];
                   m[i] = b1 * m[i] + (1 - b1) * gi;
                   v[i] = b2 * v[i] + (1 - b2) * gi * gi;
                   const double mh = m[i] / (1 - std::pow(b1, 7.0)),
                                vh = v[i] / (1 - std::pow(b2, 7.0));
                   p[i] -= lr * mh / (std::sqrt(vh) + double(hp.eps));
                 }
                 r.be.adamw_step(tp, tg, tm, tv, hp);
                 r.check(tp, p, "param");
                 r.check(tm, m, "m");
                 r.check(tv, v, "v");
               }});
}

}  // namespace shardlm::test::ops::cases
