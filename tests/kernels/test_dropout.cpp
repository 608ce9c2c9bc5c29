// Tests of the counter-based dropout kernel (dropout.cpp): kept values are exactly x / (1 - p)
// and dropped ones 0; the keep rate is 1 - p within a binomial bound; the mask is a function of
// (seed, element index) only: a slice computed with its offset equals the slice of the whole,
// in place equals out of place, and any thread count gives the same bits; seeds differ; a
// block of columns masked with the whole matrix's row stride (Backend::dropout's row_stride,
// a tensor-parallel shard's input) equals those columns of the whole matrix's mask.
#include <omp.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/ops.h"
#include "test_util.h"

namespace shardlm {
namespace {

std::vector<float> run(const std::vector<float>& x, float p, uint64_t seed, int64_t first) {
  std::vector<float> in = x, out(x.size(), -1.f);
  cpu::dropout(test::view(in, Shape{int64_t(in.size())}),
               test::view(out, Shape{int64_t(out.size())}), p, seed, first);
  return out;
}

TEST(Dropout, KeptValuesScaledDroppedZeroAtTheRate) {
  const int64_t n = 200003;
  const std::vector<float> x = test::random_vec(n, 3, 0.5f, 2.f);  // never 0
  for (const float p : {0.f, 0.1f, 0.5f, 0.9f}) {
    const std::vector<float> y = run(x, p, 17, 0);
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (y[i] == 0.f) continue;
      ++kept;
      ASSERT_EQ(y[i], x[i] * (1.f / (1.f - p))) << i;
    }
    const double mean = double(n) * (1 - p), sd = std::sqrt(double(n) * p * (1 - p));
    EXPECT_NEAR(double(kept), mean, 6 * sd + 1) << "p = " << p;
  }
}

TEST(Dropout, TheMaskDependsOnTheElementIndexOnly) {
  const int64_t n = 70001, k = 12345;
  const std::vector<float> x = test::random_vec(n, 5, 0.5f, 2.f);
  const std::vector<float> whole = run(x, 0.3f, 99, 1000);
  const std::vector<float> tail =
      run(std::vector<float>(x.begin() + k, x.end()), 0.3f, 99, 1000 + k);
  EXPECT_EQ(std::memcmp(tail.data(), whole.data() + k, tail.size() * 4), 0);
  std::vector<float> inplace = x;
  const Tensor t = test::view(inplace, Shape{n});
  cpu::dropout(t, t, 0.3f, 99, 1000);
  EXPECT_EQ(std::memcmp(inplace.data(), whole.data(), n * 4), 0);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  const std::vector<float> one_thread = run(x, 0.3f, 99, 1000);
  omp_set_num_threads(threads);
  EXPECT_EQ(std::memcmp(one_thread.data(), whole.data(), n * 4), 0);
  const std::vector<float> other_seed = run(x, 0.3f, 100, 1000);
  int64_t differ = 0;
  for (int64_t i = 0; i < n; ++i) differ += (other_seed[i] == 0.f) != (whole[i] == 0.f);
  EXPECT_GT(differ, n / 5);  // independent masks disagree on 2 p (1 - p) = 42% of elements
}

TEST(Dropout, AColumnBlockDrawsTheWholeMatricesMask) {
  const int64_t rows = 37, cols = 96, tp = 4, w = cols / tp, first = 5 * cols;
  const std::vector<float> x = test::random_vec(rows * cols, 7, 0.5f, 2.f);
  const std::vector<float> whole = run(x, 0.4f, 31, first);
  cpu::CpuBackend cpu_backend;
  Backend* be = &cpu_backend;
  for (int64_t k = 0; k < tp; ++k) {
    std::vector<float> block(size_t(rows * w)), out(block.size(), -1.f);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < w; ++j) block[i * w + j] = x[i * cols + k * w + j];
    be->dropout(test::view(block, Shape{rows, w}), test::view(out, Shape{rows, w}), 0.4f, 31,
                first + k * w, cols);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < w; ++j)
        ASSERT_EQ(out[i * w + j], whole[i * cols + k * w + j]) << "block " << k << " " << i;
  }
  // A row stride narrower than the rows is refused.
  std::vector<float> small(8);
  EXPECT_THROW(
      be->dropout(test::view(small, Shape{2, 4}), test::view(small, Shape{2, 4}), 0.4f, 31, 0, 3),
      Error);
}

}  // namespace
}  // namespace shardlm
