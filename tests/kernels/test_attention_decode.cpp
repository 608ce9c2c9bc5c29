// Tests of the CPU KV-cache attention (src/kernels/cpu/attention_decode.cpp): against an f64
// reference over the visible cache rows (GQA, single-token steps and prefill chunks, odd sizes),
// against the training kernel attention_forward on the whole sequence (its last rows), that
// cache rows past cache_len + Tq are never read, thread-count independence, bf16 storage against
// f32, and bad arguments.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/bf16_check.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/ops.h"
#include "test_util.h"

namespace shardlm::test {
namespace {

// f32 dot products over Dh and f32 sums over <= Tmax keys against f64.
constexpr double kAtol = 2e-6, kRtol = 2e-5;

struct DecodeCase {
  int64_t B, Tq, cache_len, Tmax, Hq, Hkv, Dh;
};

std::string case_name(const DecodeCase& c) {
  return "B" + std::to_string(c.B) + "_Tq" + std::to_string(c.Tq) + "_len" +
         std::to_string(c.cache_len) + "_Tmax" + std::to_string(c.Tmax) + "_Hq" +
         std::to_string(c.Hq) + "_Hkv" + std::to_string(c.Hkv) + "_Dh" + std::to_string(c.Dh);
}

struct Problem {
  DecodeCase c;
  std::vector<float> q;                 // [B, Tq, Hq, Dh]
  std::vector<float> k_cache, v_cache;  // [B, Tmax, Hkv, Dh], NaN past cache_len + Tq
};

Problem make_problem(const DecodeCase& c, uint64_t seed) {
  const size_t n_cache = c.B * c.Tmax * c.Hkv * c.Dh;
  Problem p{c, random_vec(c.B * c.Tq * c.Hq * c.Dh, seed, -2.f, 2.f),
            random_vec(n_cache, seed + 1, -2.f, 2.f), random_vec(n_cache, seed + 2)};
  // Rows the queries may not see hold NaN: reading one would poison the output.
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t s = c.cache_len + c.Tq; s < c.Tmax; ++s) {
      for (int64_t e = 0; e < c.Hkv * c.Dh; ++e) {
        p.k_cache[(b * c.Tmax + s) * c.Hkv * c.Dh + e] = NAN;
        p.v_cache[(b * c.Tmax + s) * c.Hkv * c.Dh + e] = NAN;
      }
    }
  }
  return p;
}

// out [B, Tq, Hq, Dh]: query i of (b, h) against cache rows [0, cache_len + i].
std::vector<double> ref_decode(const Problem& p) {
  const DecodeCase& c = p.c;
  const double scale = 1.0 / std::sqrt(double(c.Dh));
  std::vector<double> out(p.q.size(), 0.0);
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t i = 0; i < c.Tq; ++i) {
      for (int64_t h = 0; h < c.Hq; ++h) {
        const int64_t kvh = h / (c.Hq / c.Hkv);
        const size_t qi = ((b * c.Tq + i) * c.Hq + h) * c.Dh;
        const int64_t keys = c.cache_len + i + 1;
        std::vector<double> s(keys);
        double m = -INFINITY;
        for (int64_t j = 0; j < keys; ++j) {
          const size_t ki = ((b * c.Tmax + j) * c.Hkv + kvh) * c.Dh;
          double dot = 0;
          for (int64_t e = 0; e < c.Dh; ++e) dot += double(p.q[qi + e]) * double(p.k_cache[ki + e]);
          s[j] = dot * scale;
          m = std::max(m, s[j]);
        }
        double sum = 0;
        for (double& x : s) sum += (x = std::exp(x - m));
        for (int64_t j = 0; j < keys; ++j) {
          const size_t vi = ((b * c.Tmax + j) * c.Hkv + kvh) * c.Dh;
          for (int64_t e = 0; e < c.Dh; ++e) out[qi + e] += s[j] / sum * double(p.v_cache[vi + e]);
        }
      }
    }
  }
  return out;
}

std::vector<float> run_decode(Problem& p) {
  const DecodeCase& c = p.c;
  std::vector<float> out(p.q.size(), NAN);
  std::vector<std::byte> ws(cpu::attention_decode_workspace_bytes(c.B, c.Tq, c.Tmax, c.Hq, c.Dh));
  cpu::attention_decode(view(p.q, {c.B, c.Tq, c.Hq, c.Dh}),
                        view(p.k_cache, {c.B, c.Tmax, c.Hkv, c.Dh}),
                        view(p.v_cache, {c.B, c.Tmax, c.Hkv, c.Dh}), c.cache_len,
                        view(out, {c.B, c.Tq, c.Hq, c.Dh}), Workspace{ws.data(), ws.size()});
  return out;
}

class AttentionDecode : public ::testing::TestWithParam<DecodeCase> {};

TEST_P(AttentionDecode, MatchesF64Reference) {
  Problem p = make_problem(GetParam(), 17);
  const std::vector<float> out = run_decode(p);
  EXPECT_CLOSE(out, ref_decode(p), kAtol, kRtol);
}

// The last Tq rows of a full causal attention_forward over cache_len + Tq tokens are what the
// decoder must produce from the cache.
TEST_P(AttentionDecode, MatchesTrainingKernelLastRows) {
  const DecodeCase c = GetParam();
  const int64_t T = c.cache_len + c.Tq;
  std::vector<float> q = random_vec(c.B * T * c.Hq * c.Dh, 31, -2.f, 2.f);   // [B, T, Hq, Dh]
  std::vector<float> k = random_vec(c.B * T * c.Hkv * c.Dh, 32, -2.f, 2.f);  // [B, T, Hkv, Dh]
  std::vector<float> v = random_vec(c.B * T * c.Hkv * c.Dh, 33);             // [B, T, Hkv, Dh]
  std::vector<int32_t> seg(c.B * T, 0);                                      // [B, T]
  std::vector<float> out_full(q.size(), NAN), lse(c.B * c.Hq * T, NAN);
  std::vector<std::byte> ws(cpu::attention_workspace_bytes(c.B, T, c.Hq, c.Hkv, c.Dh));
  cpu::attention_forward(view(q, {c.B, T, c.Hq, c.Dh}), view(k, {c.B, T, c.Hkv, c.Dh}),
                         view(v, {c.B, T, c.Hkv, c.Dh}), view(seg, {c.B, T}),
                         view(out_full, {c.B, T, c.Hq, c.Dh}), view(lse, {c.B, c.Hq, T}),
                         Workspace{ws.data(), ws.size()});

  Problem p = make_problem(c, 0);
  const int64_t q_row = c.Hq * c.Dh, kv_row = c.Hkv * c.Dh;
  std::vector<float> expected(p.q.size());  // [B, Tq, Hq, Dh]
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t s = 0; s < T; ++s) {
      std::copy_n(k.begin() + (b * T + s) * kv_row, kv_row,
                  p.k_cache.begin() + (b * c.Tmax + s) * kv_row);
      std::copy_n(v.begin() + (b * T + s) * kv_row, kv_row,
                  p.v_cache.begin() + (b * c.Tmax + s) * kv_row);
    }
    for (int64_t i = 0; i < c.Tq; ++i) {
      const int64_t t = c.cache_len + i;
      std::copy_n(q.begin() + (b * T + t) * q_row, q_row, p.q.begin() + (b * c.Tq + i) * q_row);
      std::copy_n(out_full.begin() + (b * T + t) * q_row, q_row,
                  expected.begin() + (b * c.Tq + i) * q_row);
    }
  }
  const std::vector<float> out = run_decode(p);
  EXPECT_CLOSE(out, expected, kAtol, kRtol);
}

// Each output row is computed by one thread in a fixed order: same bits for any thread count.
TEST_P(AttentionDecode, SameBitsForAnyThreadCount) {
  Problem p = make_problem(GetParam(), 5);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const std::vector<float> one = run_decode(p);
  omp_set_num_threads(3);
  const std::vector<float> three = run_decode(p);
  omp_set_num_threads(saved);
  ASSERT_EQ(one.size(), three.size());
  for (size_t i = 0; i < one.size(); ++i) ASSERT_EQ(one[i], three[i]) << "element " << i;
}

// bf16 changes the storage only: on inputs bf16 holds exactly, the bf16 output is the f32
// kernel's rounded once, bit for bit; an accumulator rounded to bf16 between keys, or an operand
// rounded inside the kernel, would differ. The NaN rows past cache_len + Tq stay NaN in bf16.
TEST_P(AttentionDecode, Bf16EqualsF32RoundedOnce) {
  const DecodeCase& c = GetParam();
  Problem p = make_problem(c, 9);
  for (auto* x : {&p.q, &p.k_cache, &p.v_cache}) round_to_bf16(*x);
  Bf16Vec q16 = to_bf16(p.q), k16 = to_bf16(p.k_cache), v16 = to_bf16(p.v_cache);
  Bf16Vec out16(p.q.size(), kBf16NaN);  // NaN until written
  std::vector<std::byte> ws(cpu::attention_decode_workspace_bytes(c.B, c.Tq, c.Tmax, c.Hq, c.Dh));
  cpu::CpuBackend be;  // through the entry point: the CPU backend takes bf16
  be.attention_decode(view(q16, {c.B, c.Tq, c.Hq, c.Dh}), view(k16, {c.B, c.Tmax, c.Hkv, c.Dh}),
                      view(v16, {c.B, c.Tmax, c.Hkv, c.Dh}), c.cache_len,
                      view(out16, {c.B, c.Tq, c.Hq, c.Dh}), Workspace{ws.data(), ws.size()});
  EXPECT_EQ(out16, to_bf16(run_decode(p)));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, AttentionDecode,
    ::testing::Values(DecodeCase{1, 1, 0, 1, 1, 1, 8},         // first token, full cache
                      DecodeCase{1, 1, 37, 64, 4, 4, 16},      // one step, MHA
                      DecodeCase{2, 1, 100, 130, 8, 2, 32},    // one step, GQA, two rows
                      DecodeCase{1, 1, 200, 201, 6, 1, 64},    // MQA, cache ends at Tmax
                      DecodeCase{1, 16, 0, 16, 4, 2, 64},      // prefill from empty
                      DecodeCase{2, 7, 20, 40, 6, 3, 24},      // prefill chunk after a cache
                      DecodeCase{1, 13, 51, 70, 4, 2, 33},     // odd lengths and head dim
                      DecodeCase{1, 70, 130, 257, 4, 1, 16}),  // chunk longer than a tile
    [](const auto& info) { return case_name(info.param); });

TEST(AttentionDecodeErrors, RejectsQueriesPastTheCache) {
  cpu::CpuBackend be;  // through the entry points, which check the arguments
  const DecodeCase c{1, 4, 10, 12, 2, 1, 8};
  Problem p = make_problem({1, 2, 10, 12, 2, 1, 8}, 1);
  p.q.resize(c.Tq * c.Hq * c.Dh);
  std::vector<float> out(p.q.size());
  std::vector<std::byte> ws(cpu::attention_decode_workspace_bytes(1, 4, 12, 2, 8));
  EXPECT_THROW(be.attention_decode(view(p.q, {1, 4, 2, 8}), view(p.k_cache, {1, 12, 1, 8}),
                                   view(p.v_cache, {1, 12, 1, 8}), 10, view(out, {1, 4, 2, 8}),
                                   Workspace{ws.data(), ws.size()}),
               Error);
}

TEST(AttentionDecodeErrors, RejectsSmallWorkspace) {
  cpu::CpuBackend be;  // through the entry points, which check the arguments
  Problem p = make_problem({1, 1, 10, 12, 2, 1, 8}, 1);
  std::vector<float> out(p.q.size());
  std::vector<std::byte> ws(16);
  EXPECT_THROW(be.attention_decode(view(p.q, {1, 1, 2, 8}), view(p.k_cache, {1, 12, 1, 8}),
                                   view(p.v_cache, {1, 12, 1, 8}), 10, view(out, {1, 1, 2, 8}),
                                   Workspace{ws.data(), ws.size()}),
               Error);
}

TEST(AttentionDecodeErrors, RejectsHqNotAMultipleOfHkv) {
  cpu::CpuBackend be;  // through the entry points, which check the arguments
  Problem p = make_problem({1, 1, 3, 4, 3, 2, 8}, 1);
  std::vector<float> out(p.q.size());
  std::vector<std::byte> ws(cpu::attention_decode_workspace_bytes(1, 1, 4, 3, 8));
  EXPECT_THROW(be.attention_decode(view(p.q, {1, 1, 3, 8}), view(p.k_cache, {1, 4, 2, 8}),
                                   view(p.v_cache, {1, 4, 2, 8}), 3, view(out, {1, 1, 3, 8}),
                                   Workspace{ws.data(), ws.size()}),
               Error);
}

}  // namespace
}  // namespace shardlm::test
