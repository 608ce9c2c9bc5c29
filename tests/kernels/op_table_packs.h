// The op table's cases for the vectorised kernels (op_table.h): sizes whose bulk a backend moves
// in packs of 16-byte accesses with a remainder after it (n = 8k + 5, rows of 8k elements longer
// than a block's stride), the same ops on views one element off alignment (a backend's scalar
// path), the two-tensor RoPE and the multi-tensor AdamW. References as op_table_cases.h's.
#pragma once

#include <limits>
#include <string>
#include <utility>
#include <vector>

namespace shardlm::test::ops::cases {

inline std::string at_label(int64_t offset) {
  return offset == 0 ? "aligned" : "view 1 element off alignment";
}

// add, scale, convert and SwiGLU ([rows, 3]) over n = 8 * 512 + 5 elements.
inline void packed_map_cases(std::vector<OpCase>& c) {
  constexpr int64_t n = 4101, rows = n / 3;
  for (const DType dt : {DType::kF32, DType::kBF16})
    for (const int64_t at : {int64_t(0), int64_t(1)}) {
      const std::string label = "n4101, " + at_label(at);
      c.push_back({"add", label, dt, tol_of(dt, 1), true, [at](OpRun& r) {
                     Values a = OpRun::randn(n, 101), b = OpRun::randn(n, 102);
                     const Tensor ta = r.in_at(at, a, {n}), tb = r.in(b, {n}),
                                  out = r.out_at(at, {n});
                     Values want(a.size());
                     for (size_t i = 0; i < a.size(); ++i) want[i] = a[i] + b[i];
                     r.be.add(ta, tb, out);
                     r.check(out, want, "out");
                   }});
      c.push_back({"scale", label, dt, tol_of(dt, 1), true, [at](OpRun& r) {
                     Values x = OpRun::randn(n, 103);
                     const Tensor t = r.in_at(at, x, {n});
                     for (double& v : x) v *= double(1.7f);
                     r.be.scale(t, 1.7f);
                     r.check(t, x, "x");
                   }});
      c.push_back({"swiglu_forward", label, dt, tol_of(dt, kElementChain), true, [at](OpRun& r) {
                     Values g = OpRun::randn(n, 104, 3.0), u = OpRun::randn(n, 105);
                     const Tensor tg = r.in_at(at, g, {rows, 3}), tu = r.in(u, {rows, 3}),
                                  h = r.out_at(at, {rows, 3});
                     Values want(g.size());
                     for (size_t i = 0; i < g.size(); ++i)
                       want[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
                     r.be.swiglu_forward(tg, tu, h);
                     r.check(h, want, "h");
                   }});
      c.push_back({"swiglu_backward", label, dt, tol_of(dt, kElementChain), true, [at](OpRun& r) {
                     Values g = OpRun::randn(n, 106, 3.0), u = OpRun::randn(n, 107),
                            dh = OpRun::randn(n, 108);
                     const Tensor tg = r.in(g, {rows, 3}), tu = r.in(u, {rows, 3}),
                                  tdh = r.in_at(at, dh, {rows, 3}), dg = r.out_at(at, {rows, 3}),
                                  du = r.out({rows, 3});
                     Values want_g(g.size()), want_u(g.size());
                     swiglu_backward_reference(g, u, dh, want_g, want_u);
                     r.be.swiglu_backward(tg, tu, tdh, dg, du);
                     r.check(dg, want_g, "dgate");
                     r.check(du, want_u, "dup");
                   }});
    }
  for (const int64_t at : {int64_t(0), int64_t(1)})
    c.push_back({"convert", "f32 -> bf16 -> f32, n4101, " + at_label(at), DType::kBF16, 0, true,
                 [at](OpRun& r) {
                   Values x = OpRun::randn(n, 109, 3.0);
                   const Tensor f = r.in_at(at, x, {n}, DType::kF32), h = r.out({n}, DType::kBF16),
                                back = r.out_at(at, {n}, DType::kF32);
                   Values want(x.size());
                   for (size_t i = 0; i < x.size(); ++i)
                     want[i] = bf16_to_f32(f32_to_bf16(float(x[i])));
                   r.be.convert(f, h);
                   r.be.convert(h, back);
                   r.check(h, want, "bf16");
                   r.check(back, want, "f32 again");
                 }});
}

// RMSNorm over rows of 8k elements: D = 136 (part of one stride) and D = 2056 (a block's stride
// of 256 threads x 8, and one pack more), aligned or one element off.
inline void packed_norm_cases(std::vector<OpCase>& c) {
  struct NormShape {
    int64_t N, D, at;
  };
  for (const DType dt : {DType::kF32, DType::kBF16})
    for (const NormShape shape :
         {NormShape{13, 136, 0}, NormShape{5, 2056, 0}, NormShape{13, 136, 1}}) {
      const int64_t N = shape.N, D = shape.D, at = shape.at;
      const std::string label = fmt::format("N{} D{}, {}", N, D, at_label(at));
      c.push_back(
          {"rmsnorm_forward", label, dt, tol_of(dt, D + kElementChain), true, [N, D, at](OpRun& r) {
             Values x = OpRun::randn(N * D, 110, 2.0), w = OpRun::randn(D, 111);
             const Tensor tx = r.in_at(at, x, {N, D}), tw = r.in(w, {D}), y = r.out_at(at, {N, D}),
                          rstd = r.out({N}, DType::kF32);
             Values want(x.size()), want_rstd(static_cast<size_t>(N));
             rmsnorm_reference(x, w, N, D, want_rstd, &want);
             r.be.rmsnorm_forward(tx, tw, 1e-5f, y, rstd);
             r.check(y, want, "y");
             r.check(rstd, want_rstd, "rstd");
           }});
      c.push_back({"rmsnorm_backward", label + ", dx and dw accumulate", dt,
                   tol_of(dt, D + N + kElementChain), true, [N, D, at](OpRun& r) {
                     Values x = OpRun::randn(N * D, 112), w = OpRun::randn(D, 113),
                            dy = OpRun::randn(N * D, 114), dx = OpRun::randn(N * D, 115),
                            dw = OpRun::randn(D, 116), rstd(static_cast<size_t>(N));
                     const Tensor tx = r.in(x, {N, D}), tw = r.in(w, {D}),
                                  tdy = r.in_at(at, dy, {N, D}), tdx = r.in_at(at, dx, {N, D}),
                                  tdw = r.in(dw, {D}, DType::kF32);
                     rmsnorm_reference(x, w, N, D, rstd, nullptr);
                     const Tensor tr = r.in(rstd, {N}, DType::kF32);
                     rmsnorm_backward_reference(x, w, dy, rstd, N, D, dx, dw);
                     r.be.rmsnorm_backward(tx, tw, tr, tdy, tdx, tdw);
                     r.check(tdx, dx, "dx");
                     r.check(tdw, dw, "dw");
                   }});
    }
}

// A RoPE shape: q [N, Hq, Dh], k [N, Hk, Dh] (k's view `k_at` elements off its buffer), the
// first R dims of each head rotated (R = 0: all of them), in GLM's interleaved pairs or not.
struct RopeShape {
  int64_t N, Hq, Hk, Dh, k_at, R = 0;
  bool interleaved = false;
  int64_t rotary() const { return R == 0 ? Dh : R; }
  RopePairs pairs() const { return interleaved ? RopePairs::kInterleaved : RopePairs::kHalf; }
  std::string label() const {
    return fmt::format("N{} Hq{} Hk{} Dh{}{}{}{}", N, Hq, Hk, Dh,
                       R == 0 ? "" : fmt::format(" R{}", R), interleaved ? " interleaved" : "",
                       k_at == 0 ? "" : ", k " + at_label(k_at));
  }
};

// rope_qk against the reference, and bit for bit against rope_forward/backward on each tensor.
inline void rope_qk_cases(std::vector<OpCase>& c) {
  // Dh 64: packs; Dh 22: scalar; Dh 528: a second tile of angles; a misaligned k. GLM's heads
  // (Dh 128, the first 64 dims in interleaved pairs: packs of 4 pairs), its pairs over an odd
  // count (R 10 of Dh 22: scalar), a misaligned k, and a partial rotate_half (R 32 of Dh 64).
  const RopeShape shapes[] = {{19, 6, 2, 64, 0},
                              {19, 3, 3, 22, 0},
                              {7, 2, 1, 528, 0},
                              {19, 6, 2, 64, 1},
                              {19, 32, 2, 128, 0, 64, true},
                              {19, 3, 3, 22, 0, 10, true},
                              {19, 6, 2, 128, 1, 64, true},
                              {7, 2, 1, 1040, 0, 520, true},
                              {19, 6, 2, 64, 0, 32, false}};
  for (const DType dt : {DType::kF32, DType::kBF16})
    for (const RopeShape& s : shapes)
      for (const bool forward : {true, false}) {
        const char* method = forward ? "rope_qk_forward" : "rope_qk_backward";
        c.push_back(
            {method, s.label(), dt, tol_of(dt, kElementChain), true, [s, forward](OpRun& r) {
               Values q = OpRun::randn(s.N * s.Hq * s.Dh, 120),
                      k = OpRun::randn(s.N * s.Hk * s.Dh, 121), inv = rope_inv_freq(s.rotary());
               const std::vector<int32_t> pos = token_ids(s.N, 9000, 122);
               const Tensor tq = r.in(q, {s.N, s.Hq, s.Dh}),
                            tk = r.in_at(s.k_at, k, {s.N, s.Hk, s.Dh}),
                            tinv = r.in(inv, {s.rotary() / 2}, DType::kF32), tpos = r.ids(pos);
               rope_ref(q, pos, inv, s.Hq, s.Dh, forward ? 1.0 : -1.0, s.interleaved);
               rope_ref(k, pos, inv, s.Hk, s.Dh, forward ? 1.0 : -1.0, s.interleaved);
               if (forward)
                 r.be.rope_qk_forward(tq, tk, tpos, tinv, s.pairs());
               else
                 r.be.rope_qk_backward(tq, tk, tpos, tinv, s.pairs());
               r.check(tq, q, "q");
               r.check(tk, k, "k");
             }});
      }
  for (const bool interleaved : {false, true})
    for (const DType dt : {DType::kF32, DType::kBF16})
      c.push_back({"rope_qk_forward",
                   fmt::format("N19 Hq6 Hk2 Dh64{} equals rope_forward on each, bit for bit",
                               interleaved ? " R32 interleaved" : ""),
                   dt, 0, true, [interleaved](OpRun& r) {
                     const int64_t N = 19, Hq = 6, Hk = 2, Dh = 64, R = interleaved ? 32 : Dh;
                     const RopePairs pairs =
                         interleaved ? RopePairs::kInterleaved : RopePairs::kHalf;
                     Values q = OpRun::randn(N * Hq * Dh, 123), k = OpRun::randn(N * Hk * Dh, 124),
                            inv = rope_inv_freq(R);
                     const Tensor tinv = r.in(inv, {R / 2}, DType::kF32),
                                  tpos = r.ids(token_ids(N, 9000, 125));
                     const Tensor q2 = r.in(q, {N, Hq, Dh}), k2 = r.in(k, {N, Hk, Dh}),
                                  q1 = r.in(q, {N, Hq, Dh}), k1 = r.in(k, {N, Hk, Dh});
                     r.be.rope_qk_forward(q2, k2, tpos, tinv, pairs);
                     r.be.rope_forward(q1, tpos, tinv, pairs);
                     r.be.rope_forward(k1, tpos, tinv, pairs);
                     r.check(q2, r.get(q1), "q");
                     r.check(k2, r.get(k1), "k");
                   }});
}

// AdamW's f64 reference on one element list (torch.optim.AdamW).
inline void adamw_ref(Values& p, const Values& g, Values& m, Values& v, const AdamWHyper& hp,
                      double weight_decay) {
  const double b1 = hp.beta1, b2 = hp.beta2, lr = hp.lr, t = double(hp.step);
  for (size_t i = 0; i < p.size(); ++i) {
    const double gi = g[i] * double(hp.grad_scale);
    p[i] -= lr * weight_decay * p[i];
    m[i] = b1 * m[i] + (1 - b1) * gi;
    v[i] = b2 * v[i] + (1 - b2) * gi * gi;
    const double mh = m[i] / (1 - std::pow(b1, t)), vh = v[i] / (1 - std::pow(b2, t));
    p[i] -= lr * mh / (std::sqrt(vh) + double(hp.eps));
  }
}

// 70 segments (more than one launch's batch on CUDA) laid end to end in one buffer per tensor:
// lengths 0, multiples of 8 and odd ones, so their starts fall on and off 16-byte alignment; one
// of 5000 elements spans several blocks. Every third segment without weight decay.
inline std::vector<int64_t> adamw_segment_lengths() {
  std::vector<int64_t> n;
  for (int i = 0; i < 70; ++i) n.push_back(i == 3 ? 0 : i == 40 ? 5000 : (i * 37) % 211 + 1);
  n[10] = 64, n[11] = 128;  // whole packs
  return n;
}

inline void adamw_segments_cases(std::vector<OpCase>& c) {
  c.push_back({"adamw_step_segments", "70 segments, lengths 0..5000, decay on two in three",
               DType::kF32, tol_of(DType::kF32, kElementChain), true, [](OpRun& r) {
                 const std::vector<int64_t> len = adamw_segment_lengths();
                 int64_t total = 0;
                 for (int64_t n : len) total += n;
                 Values p = OpRun::randn(total, 130), g = OpRun::randn(total, 131),
                        m = OpRun::randn(total, 132, 0.1), v = OpRun::randn(total, 133, 0.1);
                 for (double& x : v) x = x * x;
                 const Tensor tp = r.in(p, {total}), tg = r.in(g, {total}), tm = r.in(m, {total}),
                              tv = r.in(v, {total});
                 AdamWHyper hp;
                 hp.lr = 1e-2f, hp.weight_decay = 123.f, hp.step = 5, hp.grad_scale = 0.7f;
                 std::vector<AdamWSegment> segments;
                 int64_t at = 0;
                 for (size_t i = 0; i < len.size(); ++i) {
                   const float wd = i % 3 == 2 ? 0.f : 0.1f;  // hp.weight_decay is not read
                   segments.push_back({tp.rows(at, len[i]), tg.rows(at, len[i]),
                                       tm.rows(at, len[i]), tv.rows(at, len[i]), wd});
                   auto part = [&](const Values& x) {
                     return Values(x.begin() + at, x.begin() + at + len[i]);
                   };
                   Values ps = part(p), ms = part(m), vs = part(v);
                   adamw_ref(ps, part(g), ms, vs, hp, double(wd));
                   std::copy(ps.begin(), ps.end(), p.begin() + at);
                   std::copy(ms.begin(), ms.end(), m.begin() + at);
                   std::copy(vs.begin(), vs.end(), v.begin() + at);
                   at += len[i];
                 }
                 r.be.adamw_step_segments(segments, hp);
                 r.check(tp, p, "param");
                 r.check(tm, m, "m");
                 r.check(tv, v, "v");
               }});
  c.push_back({"adamw_step_segments", "equals adamw_step segment by segment, bit for bit",
               DType::kF32, 0, true, [](OpRun& r) {
                 const std::vector<int64_t> len = adamw_segment_lengths();
                 int64_t total = 0;
                 for (int64_t n : len) total += n;
                 Values p = OpRun::randn(total, 134), g = OpRun::randn(total, 135),
                        m = OpRun::randn(total, 136, 0.1), v = OpRun::randn(total, 137, 0.1);
                 for (double& x : v) x = x * x;
                 const Tensor lp = r.in(p, {total}), lm = r.in(m, {total}), lv = r.in(v, {total});
                 const Tensor sp = r.in(p, {total}), sm = r.in(m, {total}), sv = r.in(v, {total});
                 const Tensor tg = r.in(g, {total});
                 AdamWHyper hp;
                 hp.lr = 3e-3f, hp.step = 2, hp.grad_scale = 0.9f;
                 std::vector<AdamWSegment> segments;
                 int64_t at = 0;
                 for (size_t i = 0; i < len.size(); ++i) {
                   hp.weight_decay = i % 3 == 2 ? 0.f : 0.1f;
                   segments.push_back({lp.rows(at, len[i]), tg.rows(at, len[i]),
                                       lm.rows(at, len[i]), lv.rows(at, len[i]), hp.weight_decay});
                   r.be.adamw_step(sp.rows(at, len[i]), tg.rows(at, len[i]), sm.rows(at, len[i]),
                                   sv.rows(at, len[i]), hp);
                   at += len[i];
                 }
                 r.be.adamw_step_segments(segments, hp);
                 r.check(lp, r.get(sp), "param");
                 r.check(lm, r.get(sm), "m");
                 r.check(lv, r.get(sv), "v");
               }});
}

// 700 stretches of one buffer (lengths 0..211, starts on and off alignment): more than one
// read-back's worth on CUDA; each sum against its f64 sum (f64 accumulation: exact inputs in
// either dtype cost no accuracy).
inline void sum_squares_segments_cases(std::vector<OpCase>& c) {
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back({"sum_squares_segments", "700 stretches, lengths 0..211", dt,
                 test::gamma_n(DType::kF64, 211), true, [](OpRun& r) {
                   std::vector<int64_t> len;
                   int64_t total = 0;
                   for (int i = 0; i < 700; ++i) {
                     len.push_back(i % 97 == 5 ? 0 : (i * 37) % 211 + 1);
                     total += len.back();
                   }
                   Values x = OpRun::randn(total, 140);
                   const Tensor t = r.in(x, {total});
                   std::vector<Tensor> xs;
                   Values want;
                   int64_t at = 0;
                   for (int64_t n : len) {
                     xs.push_back(t.rows(at, n));
                     double sum = 0;
                     for (int64_t i = at; i < at + n; ++i) sum += x[i] * x[i];
                     want.push_back(sum);
                     at += n;
                   }
                   Values got(xs.size(), std::numeric_limits<double>::quiet_NaN());
                   r.be.sum_squares_segments(xs, got);
                   r.check(got, want, "sums");
                 }});
}

inline void packed_cases(std::vector<OpCase>& c) {
  packed_map_cases(c);
  sum_squares_segments_cases(c);
  packed_norm_cases(c);
  rope_qk_cases(c);
  adamw_segments_cases(c);
}

}  // namespace shardlm::test::ops::cases
