// The NF4 base's projection on the CPU backend: a weight quantized on the host, dequantized by
// Backend::nf4_dequantize into an f32 or bf16 workspace and used by linear_forward and (dx
// only, the base is frozen) linear_backward, against an f64 reference over the dequantized
// weights (quant/nf4.h's values): y = x W^T and dx = dy W. Shapes are odd (a ragged last
// block) and span several GEMM panels.
#include <cmath>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "shardlm/quant/nf4.h"
#include "test_util.h"

namespace shardlm {
namespace {

double rel_error(const std::vector<float>& got, const std::vector<double>& want) {
  double err = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    err += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  return std::sqrt(err / norm);
}

void check_projection(DType ws_dtype, int64_t N, int64_t in, int64_t out) {
  SCOPED_TRACE(::testing::Message()
               << dtype_name(ws_dtype) << " N " << N << " in " << in << " out " << out);
  cpu::CpuBackend be;
  const int64_t n = out * in;
  std::vector<float> w = test::random_vec(size_t(n), 1, -0.05f, 0.05f);
  std::vector<uint8_t> codes(size_t(nf4::packed_bytes(n)));
  std::vector<float> absmax(size_t(nf4::num_blocks(n)));
  std::vector<float> deq(static_cast<size_t>(n));
  nf4::quantize(w.data(), n, codes.data(), absmax.data());
  nf4::dequantize(codes.data(), absmax.data(), 0, n, deq.data());
  // The workspace: the dequantized weight in the dtype the GEMM reads.
  const size_t wb = dtype_size(ws_dtype);
  std::vector<std::byte> ws(size_t(n) * wb);
  const Tensor W(ws.data(), ws_dtype, {out, in}, MemPool::kHost);
  be.nf4_dequantize(Tensor(codes.data(), DType::kU8, {int64_t(codes.size())}, MemPool::kHost),
                    Tensor(absmax.data(), DType::kF32, {int64_t(absmax.size())}, MemPool::kHost),
                    W);
  // The reference sees the workspace's values (bf16: deq rounded).
  std::vector<double> wr(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    wr[i] = ws_dtype == DType::kF32 ? double(deq[i]) : double(bf16_to_f32(f32_to_bf16(deq[i])));

  std::vector<float> x = test::random_vec(size_t(N * in), 2),
                     dy = test::random_vec(size_t(N * out), 3);
  auto as = [&](std::vector<float>& v, Shape s, std::vector<uint16_t>& store) {
    if (ws_dtype == DType::kF32) return Tensor(v.data(), DType::kF32, s, MemPool::kHost);
    store.resize(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      store[i] = f32_to_bf16(v[i]);
      v[i] = bf16_to_f32(store[i]);
    }
    return Tensor(store.data(), DType::kBF16, s, MemPool::kHost);
  };
  std::vector<uint16_t> xs, dys, ys, dxs;
  const Tensor tx = as(x, {N, in}, xs), tdy = as(dy, {N, out}, dys);
  std::vector<float> y(size_t(N * out)), dx(size_t(N * in));
  const Tensor ty = as(y, {N, out}, ys), tdx = as(dx, {N, in}, dxs);
  be.linear_forward(tx, W, Tensor(), ty);
  be.linear_backward(tx, W, tdy, tdx, Tensor(), Tensor());
  auto back = [&](const Tensor& t, std::vector<float>& v, const std::vector<uint16_t>& s) {
    if (t.dtype() == DType::kBF16)
      for (size_t i = 0; i < v.size(); ++i) v[i] = bf16_to_f32(s[i]);
  };
  back(ty, y, ys);
  back(tdx, dx, dxs);

  std::vector<double> want_y(static_cast<size_t>(N * out), 0.0);
  std::vector<double> want_dx(static_cast<size_t>(N * in), 0.0);
  for (int64_t r = 0; r < N; ++r)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t i = 0; i < in; ++i) {
        want_y[r * out + o] += double(x[r * in + i]) * wr[o * in + i];
        want_dx[r * in + i] += double(dy[r * out + o]) * wr[o * in + i];
      }
  const double tol = ws_dtype == DType::kF32 ? 1e-6 : 4e-3;  // bf16: the outputs' rounding
  EXPECT_LT(rel_error(y, want_y), tol) << "y";
  EXPECT_LT(rel_error(dx, want_dx), tol) << "dx";
}

TEST(Nf4Linear, ForwardAndDxMatchTheDequantizedWeightsInF64) {
  for (const DType dt : {DType::kF32, DType::kBF16}) {
    check_projection(dt, 37, 200, 77);   // 15400 weights: a ragged last block of 40
    check_projection(dt, 9, 1040, 300);  // several GEMM panels
  }
}

}  // namespace
}  // namespace shardlm
