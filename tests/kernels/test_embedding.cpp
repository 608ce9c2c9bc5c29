// Tests of the CPU embedding kernels (embedding.cpp): the gather is exact, the scatter-add
// backward matches finite differences of an f64 reference and accumulates, repeated tokens give
// bit-identical results for any thread count, and out-of-vocabulary ids are data errors. In
// bf16 the gather copies rows bit for bit and the backward accumulates into the f32 table
// gradient exactly as from f32 rows of the same values.
#include <omp.h>

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/ops.h"
#include "test_util.h"

namespace shardlm {
namespace {

// Backward sums at most N rows into one table row in f32: atol 1e-6 * (N + 1) for values <= 1.
double f32_atol(int64_t n) { return 1e-6 * double(n + 1); }
constexpr double kF32Rtol = 1e-6;

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> t(n);
  for (auto& id : t) id = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return t;
}

struct Dims {
  int64_t n, vocab, d;
};
const std::vector<Dims> kShapes = {{1, 1, 1},  {7, 3, 5},     {33, 10, 64}, {33, 50, 130},
                                   {7, 1, 64}, {130, 17, 33}, {1, 5, 130}};

TEST(EmbeddingForward, GathersRowsExactly) {
  for (Dims s : kShapes) {
    std::vector<int32_t> tok = random_tokens(s.n, s.vocab, 1);
    std::vector<float> table = test::random_vec(s.vocab * s.d, 2);
    std::vector<float> out(s.n * s.d, NAN);
    cpu::embedding_forward(test::view(tok, Shape{s.n}), test::view(table, Shape{s.vocab, s.d}),
                           test::view(out, Shape{s.n, s.d}));
    for (int64_t i = 0; i < s.n; ++i) {
      for (int64_t j = 0; j < s.d; ++j) {
        ASSERT_EQ(out[i * s.d + j], table[tok[i] * s.d + j]) << "token " << i << " col " << j;
      }
    }
  }
}

TEST(EmbeddingBackward, MatchesFiniteDifferencesAndAccumulates) {
  for (Dims s : kShapes) {
    std::vector<int32_t> tok = random_tokens(s.n, s.vocab, 3);
    std::vector<float> table = test::random_vec(s.vocab * s.d, 4);
    std::vector<float> r = test::random_vec(s.n * s.d, 5);  // dout
    // loss = sum(r * table[tok]) in f64, differentiated by central differences.
    auto table64 = test::to_f64(table);
    const auto r64 = test::to_f64(r);
    auto loss = [&] {
      double l = 0;
      for (int64_t i = 0; i < s.n; ++i)
        for (int64_t j = 0; j < s.d; ++j) l += r64[i * s.d + j] * table64[tok[i] * s.d + j];
      return l;
    };
    const auto grad = test::finite_difference(table64, loss);

    std::vector<float> dtable0 = test::random_vec(table.size(), 6), dtable = dtable0;
    for (int call = 1; call <= 2; ++call) {
      cpu::embedding_backward(test::view(tok, Shape{s.n}), test::view(r, Shape{s.n, s.d}),
                              test::view(dtable, Shape{s.vocab, s.d}));
      std::vector<double> want(table.size());
      for (size_t k = 0; k < want.size(); ++k) want[k] = dtable0[k] + call * grad[k];
      EXPECT_CLOSE(dtable, want, f32_atol(2 * s.n), kF32Rtol)
          << "N=" << s.n << " V=" << s.vocab << " D=" << s.d << " call " << call;
    }
  }
}

TEST(EmbeddingBackward, RepeatedTokensAreDeterministicAcrossThreadCounts) {
  const int64_t n = 4096, vocab = 3, d = 130;
  std::vector<int32_t> tok = random_tokens(n, vocab, 7);
  std::vector<float> dout = test::random_vec(n * d, 8);
  std::vector<float> first;
  const int saved = omp_get_max_threads();
  for (int threads : {1, 2, 3, 4}) {
    omp_set_num_threads(threads);
    std::vector<float> dtable(vocab * d, 0.25f);
    cpu::embedding_backward(test::view(tok, Shape{n}), test::view(dout, Shape{n, d}),
                            test::view(dtable, Shape{vocab, d}));
    if (first.empty()) {
      first = dtable;
    } else {
      EXPECT_EQ(dtable, first) << "threads = " << threads;
    }
  }
  omp_set_num_threads(saved);
}

// bf16 table/out and dout, f32 dtable, through the entry points. The gather copies bits; the
// backward sums 4096 rows per id in f32 (a bf16 running sum would drift by ~1e-1 here), giving
// the same bits as the f32 rows of the same values.
TEST(Embedding, Bf16RowsGatherExactlyAndAccumulateInF32) {
  const int64_t n = 4096, vocab = 3, d = 130;
  std::vector<int32_t> tok = random_tokens(n, vocab, 9);
  const std::vector<float> table_f32 = test::random_vec(vocab * d, 10);
  std::vector<uint16_t> table(vocab * d), out(n * d, 0xffffu);
  for (size_t i = 0; i < table.size(); ++i) table[i] = f32_to_bf16(table_f32[i]);
  std::vector<float> dout = test::random_vec(n * d, 11);
  std::vector<uint16_t> dout_bf16(n * d);
  for (size_t i = 0; i < dout.size(); ++i) {
    dout_bf16[i] = f32_to_bf16(dout[i]);
    dout[i] = bf16_to_f32(dout_bf16[i]);  // the same values in f32
  }
  cpu::CpuBackend be;
  be.embedding_forward(test::view(tok, Shape{n}),
                       Tensor(table.data(), DType::kBF16, Shape{vocab, d}),
                       Tensor(out.data(), DType::kBF16, Shape{n, d}));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < d; ++j)
      ASSERT_EQ(out[i * d + j], table[tok[i] * d + j]) << "token " << i << " col " << j;

  std::vector<float> from_bf16(vocab * d, 0.25f), from_f32 = from_bf16;
  be.embedding_backward(test::view(tok, Shape{n}),
                        Tensor(dout_bf16.data(), DType::kBF16, Shape{n, d}),
                        test::view(from_bf16, Shape{vocab, d}));
  be.embedding_backward(test::view(tok, Shape{n}), test::view(dout, Shape{n, d}),
                        test::view(from_f32, Shape{vocab, d}));
  EXPECT_EQ(from_bf16, from_f32);
  std::vector<double> want(vocab * d, 0.25);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < d; ++j) want[tok[i] * d + j] += dout[i * d + j];
  EXPECT_CLOSE(from_bf16, want, f32_atol(n), kF32Rtol);
}

TEST(Embedding, OutOfVocabularyIdIsADataErrorNamingTheId) {
  std::vector<float> table(4 * 3), out(2 * 3), dtable(4 * 3, 0.0f);
  for (int32_t bad : {4, -1, 1000}) {
    std::vector<int32_t> tok = {1, bad};
    try {
      cpu::embedding_forward(test::view(tok, Shape{2}), test::view(table, Shape{4, 3}),
                             test::view(out, Shape{2, 3}));
      ADD_FAILURE() << "id " << bad << " was accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kData);
      EXPECT_NE(std::string(e.what()).find("token id " + std::to_string(bad)), std::string::npos)
          << e.what();
    }
    EXPECT_THROW(cpu::embedding_backward(test::view(tok, Shape{2}), test::view(out, Shape{2, 3}),
                                         test::view(dtable, Shape{4, 3})),
                 Error);
    EXPECT_EQ(dtable, std::vector<float>(12, 0.0f)) << "nothing may be written before the check";
  }
}

TEST(Embedding, RejectsMismatchedShapes) {
  cpu::CpuBackend be;  // through the entry points, which check the arguments
  std::vector<int32_t> tok = {0, 1};
  std::vector<float> table(4 * 3), out(2 * 4), out3(3 * 3);
  EXPECT_THROW(be.embedding_forward(test::view(tok, Shape{2}), test::view(table, Shape{4, 3}),
                                    test::view(out, Shape{2, 4})),
               Error);
  EXPECT_THROW(be.embedding_forward(test::view(tok, Shape{2}), test::view(table, Shape{4, 3}),
                                    test::view(out3, Shape{3, 3})),
               Error);
  EXPECT_THROW(be.embedding_forward(Tensor(table.data(), DType::kF32, Shape{2}),
                                    test::view(table, Shape{4, 3}), test::view(out, Shape{2, 4})),
               Error);
}

}  // namespace
}  // namespace shardlm
