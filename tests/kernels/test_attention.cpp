// Tests of the CPU flash attention (src/kernels/cpu/attention_*.cpp) against an f64 reference
// written here as plain loops over the full masked softmax: forward out/lse, backward dq/dk/dv
// (vs central finite differences and vs an analytic f64 backward), with and without sliding
// windows (smaller than, equal to and longer than the documents) and Gemma 2's soft cap on the
// scores, document isolation,
// determinism across thread counts, bf16 storage against f32, and O(T) workspace at long
// sequence lengths.
#include <gtest/gtest.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/bf16_check.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/ops.h"
#include "test_util.h"

namespace shardlm::test {
namespace {

// f32 kernel vs f64 reference. Errors come from f32 tile sums over <= T keys and the exp2
// polynomial (~2 ulp); the largest observed errors are ~10x below these.
constexpr double kOutAtol = 5e-6, kOutRtol = 5e-5;    // out [B, T, Hq, Dh]
constexpr double kLseAtol = 3e-6, kLseRtol = 3e-6;    // lse [B, Hq, T]
constexpr double kGradAtol = 1e-5, kGradRtol = 1e-4;  // dq, dk, dv
// The f64 analytic backward vs f64 finite differences (step 1e-6): truncation error only.
constexpr double kRefGradAtol = 1e-7, kRefGradRtol = 1e-6;

struct AttnCase {
  int64_t B, T, Hq, Hkv, Dh;
  bool docs;  // several documents per batch row (different per row), else one causal sequence
  int64_t window = 0;  // sliding window (0: none): query t sees keys s with t - s < window
  double softcap = 0;  // scaled scores become softcap * tanh(score / softcap) (0: none)
};

std::string case_name(const AttnCase& c) {
  return "B" + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_Hq" + std::to_string(c.Hq) +
         "_Hkv" + std::to_string(c.Hkv) + "_Dh" + std::to_string(c.Dh) + (c.docs ? "_docs" : "") +
         (c.window > 0 ? "_window" + std::to_string(c.window) : "") +
         (c.softcap > 0 ? "_cap" + std::to_string(int(c.softcap * 10)) : "");
}

// Document starts [B, T]: random document lengths in [1, T / 3], a different cut per row.
std::vector<int32_t> make_seg_start(int64_t B, int64_t T, bool docs, uint64_t seed) {
  std::vector<int32_t> seg(B * T, 0);
  if (!docs) return seg;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> len(1, std::max<int64_t>(2, T / 3));
  for (int64_t b = 0; b < B; ++b) {
    int64_t start = 0;
    while (start < T) {
      const int64_t end = std::min(T, start + len(rng));
      for (int64_t t = start; t < end; ++t) seg[b * T + t] = static_cast<int32_t>(start);
      start = end;
    }
  }
  return seg;
}

struct Problem {
  AttnCase c;
  std::vector<float> q;      // [B, T, Hq, Dh]
  std::vector<float> k, v;   // [B, T, Hkv, Dh]
  std::vector<int32_t> seg;  // [B, T]
  std::vector<float> dout;   // [B, T, Hq, Dh]
};

Problem make_problem(const AttnCase& c, uint64_t seed) {
  const size_t nq = c.B * c.T * c.Hq * c.Dh;
  const size_t nkv = c.B * c.T * c.Hkv * c.Dh;
  // q, k in [-2, 2] make the softmax clearly non-uniform (scaled scores of std ~1.3).
  return Problem{c,
                 random_vec(nq, seed, -2.f, 2.f),
                 random_vec(nkv, seed + 1, -2.f, 2.f),
                 random_vec(nkv, seed + 2),
                 make_seg_start(c.B, c.T, c.docs, seed + 3),
                 random_vec(nq, seed + 4)};
}

// ---- f64 reference ---------------------------------------------------------------------------

struct RefInputs {
  AttnCase c;
  std::vector<double> q, k, v;  // as in Problem
  const std::vector<int32_t>* seg;
  size_t qi(int64_t b, int64_t t, int64_t h) const { return ((b * c.T + t) * c.Hq + h) * c.Dh; }
  size_t ki(int64_t b, int64_t s, int64_t h) const {
    return ((b * c.T + s) * c.Hkv + h / (c.Hq / c.Hkv)) * c.Dh;  // h: the query head
  }
};

RefInputs ref_inputs(const Problem& p) {
  return RefInputs{p.c, to_f64(p.q), to_f64(p.k), to_f64(p.v), &p.seg};
}

// Softmax of query (b, t, h) over its visible keys [first, t]: from its document's start, or
// under a sliding window from t - window + 1 if that is later; scores soft-capped where set.
struct RefRow {
  int64_t first;
  std::vector<double> p;  // [t - first + 1]
  double lse;
  std::vector<double> slope;  // [t - first + 1] d(capped score) / d(score), 1 without a cap
};

RefRow ref_row(const RefInputs& in, int64_t b, int64_t h, int64_t t) {
  const AttnCase& c = in.c;
  const double scale = 1.0 / std::sqrt(double(c.Dh));
  const int64_t doc = (*in.seg)[b * c.T + t];
  RefRow r{c.window > 0 ? std::max(doc, t - c.window + 1) : doc, {}, 0.0, {}};
  double m = -INFINITY;
  for (int64_t s = r.first; s <= t; ++s) {
    double dot = 0;
    for (int64_t e = 0; e < c.Dh; ++e) dot += in.q[in.qi(b, t, h) + e] * in.k[in.ki(b, s, h) + e];
    double score = dot * scale;
    double slope = 1.0;
    if (c.softcap > 0) {
      const double th = std::tanh(score / c.softcap);
      score = c.softcap * th;
      slope = 1.0 - th * th;
    }
    r.p.push_back(score);
    r.slope.push_back(slope);
    m = std::max(m, score);
  }
  double sum = 0;
  for (double& x : r.p) sum += (x = std::exp(x - m));
  for (double& x : r.p) x /= sum;
  r.lse = m + std::log(sum);
  return r;
}

std::vector<double> ref_out_row(const RefInputs& in, const RefRow& r, int64_t b, int64_t h) {
  std::vector<double> o(in.c.Dh, 0.0);
  for (size_t j = 0; j < r.p.size(); ++j) {
    for (int64_t e = 0; e < in.c.Dh; ++e) o[e] += r.p[j] * in.v[in.ki(b, r.first + j, h) + e];
  }
  return o;
}

// out [B, T, Hq, Dh]; lse [B, Hq, T]
void ref_forward(const RefInputs& in, std::vector<double>* out, std::vector<double>* lse) {
  const AttnCase& c = in.c;
  out->assign(c.B * c.T * c.Hq * c.Dh, 0.0);
  lse->assign(c.B * c.Hq * c.T, 0.0);
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t h = 0; h < c.Hq; ++h) {
      for (int64_t t = 0; t < c.T; ++t) {
        const RefRow r = ref_row(in, b, h, t);
        const std::vector<double> o = ref_out_row(in, r, b, h);
        std::copy(o.begin(), o.end(), out->begin() + in.qi(b, t, h));
        (*lse)[(b * c.Hq + h) * c.T + t] = r.lse;
      }
    }
  }
}

// Analytic backward of one query row: dq row returned; dk, dv accumulate (may be null).
std::vector<double> ref_backward_row(const RefInputs& in, const std::vector<double>& dout,
                                     int64_t b, int64_t h, int64_t t, std::vector<double>* dk,
                                     std::vector<double>* dv) {
  const AttnCase& c = in.c;
  const double scale = 1.0 / std::sqrt(double(c.Dh));
  const RefRow r = ref_row(in, b, h, t);
  const std::vector<double> o = ref_out_row(in, r, b, h);
  const double* g = dout.data() + in.qi(b, t, h);  // dO row
  double row_dot = 0;
  for (int64_t e = 0; e < c.Dh; ++e) row_dot += g[e] * o[e];
  std::vector<double> dq(c.Dh, 0.0);
  for (size_t j = 0; j < r.p.size(); ++j) {
    const size_t kv = in.ki(b, r.first + j, h);
    double dp = 0;
    for (int64_t e = 0; e < c.Dh; ++e) dp += g[e] * in.v[kv + e];
    const double ds = r.p[j] * (dp - row_dot) * r.slope[j] * scale;
    for (int64_t e = 0; e < c.Dh; ++e) {
      dq[e] += ds * in.k[kv + e];
      if (dk) (*dk)[kv + e] += ds * in.q[in.qi(b, t, h) + e];
      if (dv) (*dv)[kv + e] += r.p[j] * g[e];
    }
  }
  return dq;
}

void ref_backward(const RefInputs& in, const std::vector<double>& dout, std::vector<double>* dq,
                  std::vector<double>* dk, std::vector<double>* dv) {
  const AttnCase& c = in.c;
  dq->assign(in.q.size(), 0.0);
  dk->assign(in.k.size(), 0.0);
  dv->assign(in.v.size(), 0.0);
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t h = 0; h < c.Hq; ++h) {
      for (int64_t t = 0; t < c.T; ++t) {
        const std::vector<double> row = ref_backward_row(in, dout, b, h, t, dk, dv);
        std::copy(row.begin(), row.end(), dq->begin() + in.qi(b, t, h));
      }
    }
  }
}

// ---- kernel ----------------------------------------------------------------------------------

struct KernelResult {
  std::vector<float> out, lse, dq, dk, dv;
};

// Runs attention_forward and, when backward, attention_backward with dout.
KernelResult run_kernel(Problem& p, bool backward) {
  cpu::CpuBackend be;  // through the entry points, which check the arguments
  const AttnCase& c = p.c;
  const Shape q_shape{c.B, c.T, c.Hq, c.Dh};
  const Shape kv_shape{c.B, c.T, c.Hkv, c.Dh};
  KernelResult r;
  r.out.assign(p.q.size(), NAN);
  r.lse.assign(c.B * c.Hq * c.T, NAN);
  std::vector<std::byte> ws_bytes(cpu::attention_workspace_bytes(c.B, c.T, c.Hq, c.Hkv, c.Dh));
  const Workspace ws{ws_bytes.data(), ws_bytes.size()};
  const Tensor q = view(p.q, q_shape), k = view(p.k, kv_shape), v = view(p.v, kv_shape);
  const Tensor seg = view(p.seg, Shape{c.B, c.T});
  const Tensor out = view(r.out, q_shape), lse = view(r.lse, Shape{c.B, c.Hq, c.T});
  be.attention_forward(q, k, v, seg, out, lse, ws, {}, c.window, float(c.softcap));
  if (backward) {
    r.dq.assign(p.q.size(), NAN);  // overwritten, so garbage must not leak through
    r.dk.assign(p.k.size(), NAN);
    r.dv.assign(p.v.size(), NAN);
    be.attention_backward(q, k, v, seg, out, lse, view(p.dout, q_shape), view(r.dq, q_shape),
                          view(r.dk, kv_shape), view(r.dv, kv_shape), ws, {}, c.window,
                          float(c.softcap));
  }
  return r;
}

// ---- forward and backward vs the f64 reference -----------------------------------------------

class AttentionTest : public ::testing::TestWithParam<AttnCase> {};

TEST_P(AttentionTest, ForwardMatchesReference) {
  Problem p = make_problem(GetParam(), 11);
  const KernelResult r = run_kernel(p, false);
  std::vector<double> out, lse;
  ref_forward(ref_inputs(p), &out, &lse);
  EXPECT_CLOSE(r.out, out, kOutAtol, kOutRtol);
  EXPECT_CLOSE(r.lse, lse, kLseAtol, kLseRtol);
}

TEST_P(AttentionTest, BackwardMatchesAnalyticReference) {
  Problem p = make_problem(GetParam(), 23);
  const KernelResult r = run_kernel(p, true);
  std::vector<double> dq, dk, dv;
  ref_backward(ref_inputs(p), to_f64(p.dout), &dq, &dk, &dv);
  EXPECT_CLOSE(r.dq, dq, kGradAtol, kGradRtol);
  EXPECT_CLOSE(r.dk, dk, kGradAtol, kGradRtol);
  EXPECT_CLOSE(r.dv, dv, kGradAtol, kGradRtol);
}

// T off the 64-tile grid (1, 7, 65, 130, 200), MHA and GQA (groups of 2 and 4), Dh 8/16/64
// (and 12, off the 8-wide vector grid), B 1 and 2. With 2 threads, B * Hkv = 1 takes the
// two-pass backward and B * Hkv >= 2 the fused one.
INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionTest,
    ::testing::Values(AttnCase{1, 1, 2, 2, 8, false}, AttnCase{2, 1, 4, 1, 16, true},
                      AttnCase{1, 7, 4, 2, 16, false}, AttnCase{2, 7, 2, 1, 8, true},
                      AttnCase{1, 65, 4, 1, 64, false}, AttnCase{2, 65, 4, 2, 64, true},
                      AttnCase{1, 130, 4, 4, 16, true}, AttnCase{2, 130, 4, 1, 16, false},
                      AttnCase{1, 200, 4, 1, 8, true}, AttnCase{2, 200, 4, 2, 8, true},
                      AttnCase{1, 200, 4, 4, 64, false}, AttnCase{2, 200, 2, 2, 64, true},
                      AttnCase{1, 70, 2, 1, 12, true},
                      // Sliding windows: shorter than the documents (and than a tile, so whole
                      // key tiles fall outside), as long as the longest ones (T / 3 keys), and
                      // longer than the row (the causal mask alone).
                      AttnCase{1, 130, 4, 1, 16, true, 5}, AttnCase{2, 200, 4, 2, 8, false, 9},
                      AttnCase{2, 200, 4, 2, 8, true, 66}, AttnCase{1, 200, 4, 1, 8, false, 64},
                      AttnCase{2, 130, 4, 4, 16, false, 70}, AttnCase{2, 65, 4, 2, 64, true, 300},
                      AttnCase{1, 7, 4, 2, 16, false, 1},
                      // Soft-capped scores (caps well inside the scores' range, so tanh bends
                      // them), alone, with documents and with a window; both backward schedules.
                      AttnCase{1, 130, 4, 1, 16, true, 0, 1.5},
                      AttnCase{2, 200, 4, 2, 8, false, 0, 0.7},
                      AttnCase{2, 65, 4, 2, 64, true, 9, 2.0},
                      AttnCase{1, 70, 2, 1, 12, true, 66, 1.0}),
    [](const ::testing::TestParamInfo<AttnCase>& info) { return case_name(info.param); });

// loss = sum(dout * out): the kernel's gradients and the analytic f64 backward, both against
// central differences of the f64 forward.
TEST(AttentionGradient, MatchesFiniteDifferences) {
  for (const AttnCase& c :
       {AttnCase{1, 6, 2, 1, 8, false}, AttnCase{2, 9, 4, 2, 8, true},
        AttnCase{1, 10, 2, 2, 16, true}, AttnCase{1, 10, 2, 1, 8, false, 3},
        AttnCase{2, 9, 4, 2, 8, true, 2}, AttnCase{1, 10, 2, 2, 16, true, 20},
        AttnCase{1, 10, 2, 1, 8, false, 0, 0.8}, AttnCase{2, 9, 4, 2, 8, true, 3, 1.5}}) {
    SCOPED_TRACE(case_name(c));
    Problem p = make_problem(c, 5);
    const KernelResult r = run_kernel(p, true);
    RefInputs in = ref_inputs(p);
    const std::vector<double> dout = to_f64(p.dout);
    auto loss = [&] {
      std::vector<double> out, lse;
      ref_forward(in, &out, &lse);
      double sum = 0;
      for (size_t i = 0; i < out.size(); ++i) sum += dout[i] * out[i];
      return sum;
    };
    const std::vector<double> fd_dq = finite_difference(in.q, loss);
    const std::vector<double> fd_dk = finite_difference(in.k, loss);
    const std::vector<double> fd_dv = finite_difference(in.v, loss);
    EXPECT_CLOSE(r.dq, fd_dq, kGradAtol, kGradRtol);
    EXPECT_CLOSE(r.dk, fd_dk, kGradAtol, kGradRtol);
    EXPECT_CLOSE(r.dv, fd_dv, kGradAtol, kGradRtol);
    std::vector<double> dq, dk, dv;
    ref_backward(in, dout, &dq, &dk, &dv);
    EXPECT_CLOSE(dq, fd_dq, kRefGradAtol, kRefGradRtol);
    EXPECT_CLOSE(dk, fd_dk, kRefGradAtol, kRefGradRtol);
    EXPECT_CLOSE(dv, fd_dv, kRefGradAtol, kRefGradRtol);
  }
}

// ---- masking, determinism, errors ------------------------------------------------------------

// Rewriting k and v of one document changes nothing, bit for bit, outside it: neither outputs
// of other documents nor of the other batch row, nor their gradients.
TEST(AttentionMask, NoCrossDocumentLeakage) {
  const AttnCase c{2, 200, 4, 2, 16, true};
  Problem p = make_problem(c, 31);
  for (int64_t t = 0; t < c.T; ++t) {  // row 0: documents [0, 50), [50, 120), [120, 200)
    p.seg[t] = t < 50 ? 0 : t < 120 ? 50 : 120;
  }
  const KernelResult before = run_kernel(p, true);
  const std::vector<float> noise = random_vec(p.k.size(), 99, -3.f, 3.f);
  const auto in_doc = [&](size_t kv_index) {  // index into k/v: is it row 0, tokens [50, 120)?
    const int64_t token = kv_index / (c.Hkv * c.Dh);
    return token >= 50 && token < 120;
  };
  for (size_t i = 0; i < p.k.size(); ++i) {
    if (in_doc(i)) {
      p.k[i] = noise[i];
      p.v[i] = -noise[i];
    }
  }
  const KernelResult after = run_kernel(p, true);
  int64_t changed = 0;
  for (size_t i = 0; i < p.q.size(); ++i) {
    const int64_t token = i / (c.Hq * c.Dh);
    if (token >= 50 && token < 120) {
      changed += after.out[i] != before.out[i];
      continue;
    }
    ASSERT_EQ(after.out[i], before.out[i]) << "out element " << i;
    ASSERT_EQ(after.dq[i], before.dq[i]) << "dq element " << i;
  }
  EXPECT_GT(changed, 0) << "the rewritten document's own outputs should change";
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t h = 0; h < c.Hq; ++h) {
      for (int64_t t = 0; t < c.T; ++t) {
        if (b == 0 && t >= 50 && t < 120) continue;
        const size_t i = (b * c.Hq + h) * c.T + t;
        ASSERT_EQ(after.lse[i], before.lse[i]) << "lse " << b << "," << h << "," << t;
      }
    }
  }
  for (size_t i = 0; i < p.k.size(); ++i) {
    if (in_doc(i)) continue;
    ASSERT_EQ(after.dk[i], before.dk[i]) << "dk element " << i;
    ASSERT_EQ(after.dv[i], before.dv[i]) << "dv element " << i;
  }
}

// The backward picks a fused single pass or two passes from the thread count; both sum in
// the same order, so results are identical bit for bit for any number of threads.
TEST(AttentionBackward, BitIdenticalAcrossThreadCounts) {
  const int saved = omp_get_max_threads();
  for (const AttnCase& c : {AttnCase{1, 300, 4, 1, 16, true}, AttnCase{2, 150, 4, 2, 64, false},
                            AttnCase{2, 150, 4, 2, 16, true, 0, 1.5}}) {
    SCOPED_TRACE(case_name(c));
    Problem p = make_problem(c, 41);
    omp_set_num_threads(1);
    const KernelResult one = run_kernel(p, true);
    for (int threads : {2, 3}) {
      omp_set_num_threads(threads);
      const KernelResult many = run_kernel(p, true);
      EXPECT_EQ(many.out, one.out) << threads << " threads";
      EXPECT_EQ(many.lse, one.lse) << threads << " threads";
      EXPECT_EQ(many.dq, one.dq) << threads << " threads";
      EXPECT_EQ(many.dk, one.dk) << threads << " threads";
      EXPECT_EQ(many.dv, one.dv) << threads << " threads";
    }
  }
  omp_set_num_threads(saved);
}

// ---- bf16 storage ------------------------------------------------------------------------------

// bf16 changes the storage only: on inputs bf16 holds exactly, the bf16 forward and backward are
// the f32 kernels' results rounded once, bit for bit (lse, f32 in both, the same bits); the f32
// backward is given the bf16 forward's out, as the bf16 one is. A gradient rounded to bf16
// between key or query tiles, or an operand rounded inside the kernel, would differ. With 2
// threads B * Hkv = 4 runs the f32 backward fused and B * Hkv = 1 in two passes; bf16 always
// takes the two passes.
TEST(AttentionBf16, EqualsF32RoundedOnce) {
  const int saved = omp_get_max_threads();
  for (const AttnCase& c : {AttnCase{1, 200, 4, 1, 16, true}, AttnCase{2, 150, 4, 2, 64, false},
                            AttnCase{2, 70, 2, 1, 12, true}}) {
    SCOPED_TRACE(case_name(c));
    Problem p = make_problem(c, 43);
    for (auto* x : {&p.q, &p.k, &p.v, &p.dout}) round_to_bf16(*x);
    Bf16Vec q16 = to_bf16(p.q), k16 = to_bf16(p.k), v16 = to_bf16(p.v), do16 = to_bf16(p.dout);
    const Shape q_shape{c.B, c.T, c.Hq, c.Dh}, kv_shape{c.B, c.T, c.Hkv, c.Dh};
    const Shape lse_shape{c.B, c.Hq, c.T};
    const Tensor seg = view(p.seg, Shape{c.B, c.T});
    cpu::CpuBackend be;
    for (int threads : {1, 2}) {
      SCOPED_TRACE(std::to_string(threads) + " threads");
      omp_set_num_threads(threads);
      // Sized for this thread count: the process may have started with fewer.
      std::vector<std::byte> ws_bytes(cpu::attention_workspace_bytes(c.B, c.T, c.Hq, c.Hkv, c.Dh));
      const Workspace ws{ws_bytes.data(), ws_bytes.size()};
      Bf16Vec out16(p.q.size(), kBf16NaN), dq16(p.q.size(), kBf16NaN);  // NaN until written
      Bf16Vec dk16(p.k.size(), kBf16NaN), dv16(p.v.size(), kBf16NaN);
      std::vector<float> lse16(lse_shape.numel(), NAN);
      be.attention_forward(view(q16, q_shape), view(k16, kv_shape), view(v16, kv_shape), seg,
                           view(out16, q_shape), view(lse16, lse_shape), ws);
      be.attention_backward(view(q16, q_shape), view(k16, kv_shape), view(v16, kv_shape), seg,
                            view(out16, q_shape), view(lse16, lse_shape), view(do16, q_shape),
                            view(dq16, q_shape), view(dk16, kv_shape), view(dv16, kv_shape), ws);

      const KernelResult f32 = run_kernel(p, false);
      EXPECT_EQ(out16, to_bf16(f32.out));
      EXPECT_EQ(lse16, f32.lse);
      std::vector<float> out = from_bf16(out16), lse = lse16;
      std::vector<float> dq(p.q.size()), dk(p.k.size()), dv(p.v.size());
      be.attention_backward(view(p.q, q_shape), view(p.k, kv_shape), view(p.v, kv_shape), seg,
                            view(out, q_shape), view(lse, lse_shape), view(p.dout, q_shape),
                            view(dq, q_shape), view(dk, kv_shape), view(dv, kv_shape), ws);
      EXPECT_EQ(dq16, to_bf16(dq));
      EXPECT_EQ(dk16, to_bf16(dk));
      EXPECT_EQ(dv16, to_bf16(dv));
    }
  }
  omp_set_num_threads(saved);
}

TEST(AttentionErrors, RejectsBadArguments) {
  cpu::CpuBackend be;                      // through the entry points, which check the arguments
  const AttnCase c{1, 8, 3, 2, 8, false};  // Hq not a multiple of Hkv
  Problem p = make_problem(c, 3);
  EXPECT_THROW(run_kernel(p, false), Error);

  Problem ok = make_problem(AttnCase{1, 8, 2, 1, 8, false}, 3);
  std::vector<float> out(ok.q.size()), lse(2 * 8);
  const size_t need = cpu::attention_workspace_bytes(1, 8, 2, 1, 8);
  std::vector<std::byte> ws(need);
  const Shape q_shape{1, 8, 2, 8}, kv_shape{1, 8, 1, 8};
  const auto forward = [&](size_t ws_bytes) {
    be.attention_forward(view(ok.q, q_shape), view(ok.k, kv_shape), view(ok.v, kv_shape),
                         view(ok.seg, Shape{1, 8}), view(out, q_shape), view(lse, Shape{1, 2, 8}),
                         Workspace{ws.data(), ws_bytes});
  };
  EXPECT_NO_THROW(forward(need));
  EXPECT_THROW(forward(0), Error);
  ok.seg[5] = 6;  // a document may not start after its token
  EXPECT_THROW(forward(need), Error);
}

// Document spans restate seg_start for variable-length kernels; the CPU backend, which reads
// seg_start, checks that they say the same (so every CPU run of the trainer tests the spans
// its loader writes), and the entry point checks their form.
TEST(AttentionSpans, CpuChecksSpansAgainstSegStart) {
  cpu::CpuBackend be;
  const int64_t B = 2, T = 8;
  Problem p = make_problem(AttnCase{B, T, 2, 1, 8, false}, 5);
  // Row 0: documents [0, 3) and [3, 8); row 1: [0, 1), [1, 8).
  p.seg = {0, 0, 0, 3, 3, 3, 3, 3, 0, 1, 1, 1, 1, 1, 1, 1};
  std::vector<int32_t> starts = {0, 3, 8, 9, 16};
  std::vector<float> out(p.q.size()), lse(B * 2 * T), plain_out(p.q.size()), plain_lse(lse.size());
  std::vector<std::byte> ws(cpu::attention_workspace_bytes(B, T, 2, 1, 8));
  const Shape q_shape{B, T, 2, 8}, kv_shape{B, T, 1, 8};
  const auto forward = [&](std::vector<float>& o, std::vector<float>& l, const DocumentSpans& d) {
    be.attention_forward(view(p.q, q_shape), view(p.k, kv_shape), view(p.v, kv_shape),
                         view(p.seg, Shape{B, T}), view(o, q_shape), view(l, Shape{B, 2, T}),
                         Workspace{ws.data(), ws.size()}, d);
  };
  const auto spans = [&](int64_t count, int64_t longest) {
    return DocumentSpans{view(starts, Shape{int64_t(starts.size())}), count, longest};
  };
  forward(plain_out, plain_lse, {});
  forward(out, lse, spans(4, 7));  // max_len may bound the longest from above
  EXPECT_EQ(out, plain_out);
  EXPECT_EQ(lse, plain_lse);
  const auto rejected = [&](const DocumentSpans& d, const std::string& says) {
    try {
      forward(out, lse, d);
      ADD_FAILURE() << "accepted: " << says;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(says), std::string::npos) << e.what();
    }
  };
  rejected(spans(4, 4), "longer than docs.max_len = 4");
  rejected(spans(3, 8), "must run from 0 to B * T = 16");
  rejected(spans(0, 8), "docs.count = 0 must be in [1, B * T = 16]");
  rejected(spans(4, 9), "docs.max_len = 9 must be in [1, T = 8]");
  starts = {0, 3, 8, 10, 16};  // row 1 by seg_start: [0, 1), [1, 8)
  rejected(spans(4, 7), "token 9 starts its document at 1 by seg_start but at 0 by docs");
  starts = {0, 3, 9, 16, 16};  // a document across rows
  rejected(spans(3, 7), "crosses a row of T = 8");
  be.attention_forward(view(p.q, q_shape), view(p.k, kv_shape), view(p.v, kv_shape), Tensor(),
                       view(out, q_shape), view(lse, Shape{B, 2, T}),
                       Workspace{ws.data(), ws.size()}, {});
  EXPECT_THROW(be.attention_forward(view(p.q, q_shape), view(p.k, kv_shape), view(p.v, kv_shape),
                                    Tensor(), view(out, q_shape), view(lse, Shape{B, 2, T}),
                                    Workspace{ws.data(), ws.size()}, spans(4, 7)),
               Error);  // spans without seg_start
}

// ---- O(T) memory -------------------------------------------------------------------------------

TEST(AttentionMemory, WorkspaceGrowsLinearly) {
  for (int64_t dh : {16, 64, 128}) {
    const size_t at_8k = cpu::attention_workspace_bytes(1, 8192, 8, 2, dh);
    const size_t at_16k = cpu::attention_workspace_bytes(1, 16384, 8, 2, dh);
    EXPECT_LE(double(at_16k) / double(at_8k), 2.01) << "Dh " << dh;
    EXPECT_LT(at_16k, size_t{16384} * 16384 * 4 / 100) << "Dh " << dh;  // far below [T, T] f32
  }
}

// A real run at T = 16384, one causal sequence (a [T, T] f32 matrix would be 1 GiB). Sampled
// query rows (out, lse, dq) against the f64 reference; sampled key rows (dk, dv) against the f64
// formula over all T queries, taking the softmax normalisers (lse, and D = dO . out) from the
// kernel, which the query rows check.
TEST(AttentionMemory, RunsAtLongSequence) {
  const AttnCase c{1, 16384, 2, 1, 16, false};
  Problem p = make_problem(c, 61);
  const auto start = std::chrono::steady_clock::now();
  const KernelResult r = run_kernel(p, true);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  RecordProperty("forward_backward_seconds", std::to_string(seconds));
  for (const auto* x : {&r.out, &r.lse, &r.dq, &r.dk, &r.dv}) {
    EXPECT_TRUE(std::all_of(x->begin(), x->end(), [](float f) { return std::isfinite(f); }));
  }
  const RefInputs in = ref_inputs(p);
  const std::vector<double> dout = to_f64(p.dout);
  for (int64_t t : {0, 1, 1000, 5000, 9999, 16383}) {
    for (int64_t h = 0; h < c.Hq; ++h) {
      SCOPED_TRACE("query " + std::to_string(t) + " head " + std::to_string(h));
      const RefRow row = ref_row(in, 0, h, t);
      const std::vector<double> o = ref_out_row(in, row, 0, h);
      const std::vector<double> dq = ref_backward_row(in, dout, 0, h, t, nullptr, nullptr);
      const size_t at = in.qi(0, t, h);
      const std::vector<float> got_o(r.out.begin() + at, r.out.begin() + at + c.Dh);
      const std::vector<float> got_dq(r.dq.begin() + at, r.dq.begin() + at + c.Dh);
      EXPECT_CLOSE(got_o, o, kOutAtol, kOutRtol);
      EXPECT_CLOSE(got_dq, dq, kGradAtol, kGradRtol);
      EXPECT_NEAR(r.lse[h * c.T + t], row.lse, kLseAtol + kLseRtol * std::abs(row.lse));
    }
  }
  const double scale = 1.0 / std::sqrt(double(c.Dh));
  for (int64_t s : {0, 7000, 16383}) {
    SCOPED_TRACE("key " + std::to_string(s));
    std::vector<double> dk(c.Dh, 0.0), dv(c.Dh, 0.0);
    const size_t kv = in.ki(0, s, 0);
    for (int64_t h = 0; h < c.Hq; ++h) {
      for (int64_t t = s; t < c.T; ++t) {
        const size_t qi = in.qi(0, t, h);
        double score = 0, dp = 0, row_dot = 0;
        for (int64_t e = 0; e < c.Dh; ++e) {
          score += in.q[qi + e] * in.k[kv + e];
          dp += dout[qi + e] * in.v[kv + e];
          row_dot += dout[qi + e] * r.out[qi + e];
        }
        const double prob = std::exp(score * scale - r.lse[h * c.T + t]);
        for (int64_t e = 0; e < c.Dh; ++e) {
          dk[e] += prob * (dp - row_dot) * scale * in.q[qi + e];
          dv[e] += prob * dout[qi + e];
        }
      }
    }
    const std::vector<float> got_dk(r.dk.begin() + kv, r.dk.begin() + kv + c.Dh);
    const std::vector<float> got_dv(r.dv.begin() + kv, r.dv.begin() + kv + c.Dh);
    EXPECT_CLOSE(got_dk, dk, kGradAtol, kGradRtol);
    EXPECT_CLOSE(got_dv, dv, kGradAtol, kGradRtol);
  }
}

}  // namespace
}  // namespace shardlm::test
