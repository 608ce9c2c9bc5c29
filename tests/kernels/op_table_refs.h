// f64 references of the op table's larger families (op_table.h): attention (whole, block,
// merge, decode) and the losses (fused LM head, vocabulary-parallel slices). Plain loops over
// the contracts of include/shardlm/backend/backend.h, written for clarity, not speed.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace shardlm::test::ops {

// Attention of query rows against key rows with an arbitrary visibility rule. Layouts:
// q [B, Tq, Hq, Dh], k, v [B, Tk, Hkv, Dh], out [B, Tq, Hq, Dh], lse [B, Hq, Tq].
struct AttnShape {
  int64_t B, Tq, Tk, Hq, Hkv, Dh;
  double softcap = 0;  // scaled scores become softcap * tanh(score / softcap) (0: none)
  // The scaled score after the soft cap, and in slope its derivative (1 without a cap).
  double capped(double score, double* slope) const {
    if (softcap <= 0) {
      *slope = 1.0;
      return score;
    }
    const double t = std::tanh(score / softcap);
    *slope = 1.0 - t * t;
    return softcap * t;
  }
  int64_t qi(int64_t b, int64_t t, int64_t h) const { return ((b * Tq + t) * Hq + h) * Dh; }
  int64_t ki(int64_t b, int64_t s, int64_t h) const { return ((b * Tk + s) * Hkv + h) * Dh; }
  int64_t li(int64_t b, int64_t h, int64_t t) const { return (b * Hq + h) * Tq + t; }
  int64_t kv_head(int64_t h) const { return h / (Hq / Hkv); }
};

// The (query, key) pairs a row sees: visible(b, t, s).
template <class Visible>
void attention_ref(const AttnShape& a, const std::vector<double>& q, const std::vector<double>& k,
                   const std::vector<double>& v, Visible visible, std::vector<double>& out,
                   std::vector<double>& lse) {
  const double scale = 1.0 / std::sqrt(double(a.Dh));
  out.assign(static_cast<size_t>(a.B * a.Tq * a.Hq * a.Dh), 0.0);
  lse.assign(static_cast<size_t>(a.B * a.Hq * a.Tq), -std::numeric_limits<double>::infinity());
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.Hq; ++h)
      for (int64_t t = 0; t < a.Tq; ++t) {
        std::vector<double> s(static_cast<size_t>(a.Tk), -std::numeric_limits<double>::infinity());
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < a.Tk; ++j) {
          if (!visible(b, t, j)) continue;
          double dot = 0;
          for (int64_t d = 0; d < a.Dh; ++d)
            dot += q[a.qi(b, t, h) + d] * k[a.ki(b, j, a.kv_head(h)) + d];
          double slope;
          s[j] = a.capped(dot * scale, &slope);
          mx = std::max(mx, s[j]);
        }
        if (std::isinf(mx)) continue;  // sees nothing: out 0, lse -inf
        double sum = 0;
        for (int64_t j = 0; j < a.Tk; ++j) sum += std::isinf(s[j]) ? 0 : std::exp(s[j] - mx);
        lse[a.li(b, h, t)] = mx + std::log(sum);
        for (int64_t j = 0; j < a.Tk; ++j) {
          if (std::isinf(s[j])) continue;
          const double p = std::exp(s[j] - lse[a.li(b, h, t)]);
          for (int64_t d = 0; d < a.Dh; ++d)
            out[a.qi(b, t, h) + d] += p * v[a.ki(b, j, a.kv_head(h)) + d];
        }
      }
}

// Gradients given the final out and lse of the queries: dq [as q], dk, dv [as k] overwritten.
template <class Visible>
void attention_backward_ref(const AttnShape& a, const std::vector<double>& q,
                            const std::vector<double>& k, const std::vector<double>& v,
                            Visible visible, const std::vector<double>& out,
                            const std::vector<double>& lse, const std::vector<double>& dout,
                            std::vector<double>& dq, std::vector<double>& dk,
                            std::vector<double>& dv) {
  const double scale = 1.0 / std::sqrt(double(a.Dh));
  dq.assign(q.size(), 0.0);
  dk.assign(k.size(), 0.0);
  dv.assign(v.size(), 0.0);
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t h = 0; h < a.Hq; ++h)
      for (int64_t t = 0; t < a.Tq; ++t) {
        const int64_t qo = a.qi(b, t, h);
        double delta = 0;  // sum(dout * out) of the row
        for (int64_t d = 0; d < a.Dh; ++d) delta += dout[qo + d] * out[qo + d];
        for (int64_t j = 0; j < a.Tk; ++j) {
          if (!visible(b, t, j)) continue;
          const int64_t ko = a.ki(b, j, a.kv_head(h));
          double dot = 0, dp = 0;
          for (int64_t d = 0; d < a.Dh; ++d) {
            dot += q[qo + d] * k[ko + d];
            dp += dout[qo + d] * v[ko + d];
          }
          double slope;
          const double p = std::exp(a.capped(dot * scale, &slope) - lse[a.li(b, h, t)]);
          const double ds = p * (dp - delta) * slope * scale;
          for (int64_t d = 0; d < a.Dh; ++d) {
            dq[qo + d] += ds * k[ko + d];
            dk[ko + d] += ds * q[qo + d];
            dv[ko + d] += p * dout[qo + d];
          }
        }
      }
}

// Cross-entropy of logits rows [n, V] against targets (-1: ignored): the loss sum and, with
// grad, grad_scale * (softmax - onehot) per row (zeros on ignored rows).
inline double xent_ref(const std::vector<double>& logits, const std::vector<int32_t>& targets,
                       int64_t V, double grad_scale, std::vector<double>* grad, int64_t* n_valid) {
  const int64_t n = int64_t(targets.size());
  double loss = 0;
  *n_valid = 0;
  if (grad) grad->assign(static_cast<size_t>(n * V), 0.0);
  for (int64_t r = 0; r < n; ++r) {
    if (targets[r] < 0) continue;
    double mx = -std::numeric_limits<double>::infinity(), sum = 0;
    for (int64_t j = 0; j < V; ++j) mx = std::max(mx, logits[r * V + j]);
    for (int64_t j = 0; j < V; ++j) sum += std::exp(logits[r * V + j] - mx);
    loss += std::log(sum) + mx - logits[r * V + targets[r]];
    ++*n_valid;
    if (!grad) continue;
    for (int64_t j = 0; j < V; ++j)
      (*grad)[r * V + j] =
          grad_scale * (std::exp(logits[r * V + j] - mx) / sum - (j == targets[r] ? 1.0 : 0.0));
  }
  return loss;
}

// y [N, out] = x [N, in] W^T [in, out]
inline std::vector<double> matmul_nt(const std::vector<double>& x, const std::vector<double>& w,
                                     int64_t N, int64_t in, int64_t out) {
  std::vector<double> y(static_cast<size_t>(N * out), 0.0);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double s = 0;
      for (int64_t i = 0; i < in; ++i) s += x[r * in + i] * w[o * in + i];
      y[r * out + o] = s;
    }
  return y;
}

}  // namespace shardlm::test::ops
