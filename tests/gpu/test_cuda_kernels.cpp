// Every CUDA kernel against the CPU backend (itself checked against f64 references and finite
// differences in tests/kernels) on fresh random data: outputs are poisoned with NaN first, odd
// sizes and long sequences included. f32 paths must agree within 1e-5 (normwise relative error),
// bf16 paths within 1e-2, the CPU side then computing on the same bf16-rounded inputs.
// Label gpu: needs an NVIDIA GPU (make test-gpu). The attention kernels: test_cuda_attention.cpp.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu/cuda_kernels_fixture.h"
#include "tolerance.h"

namespace shardlm::test {
namespace {

TEST_F(CudaKernels, ElementwiseOps) {
  for (int64_t n : {1, 1000, 1 << 20 | 7}) {
    auto a = randn(n, 1), b = randn(n, 2);
    for (DType t : kTypes) {
      const auto ar = round_to(t, a), br = round_to(t, b);
      Tensor da = up(a, {n}, t), db = up(b, {n}, t), out = poisoned({n}, t);
      gpu->add(da, db, out);
      std::vector<float> want(n);
      for (int64_t i = 0; i < n; ++i) want[i] = ar[i] + br[i];
      EXPECT_LE(rel_err(down(out), round_to(t, want)), t == DType::kBF16 ? 4e-3 : 0) << n;
      gpu->scale(da, 0.5f);
      for (int64_t i = 0; i < n; ++i) want[i] = ar[i] * 0.5f;
      EXPECT_EQ(rel_err(down(da), want), 0.0);
      double ss = 0;
      for (int64_t i = 0; i < n; ++i) ss += double(br[i]) * br[i];
      EXPECT_NEAR(gpu->sum_squares(db), ss, 1e-12 * ss);
      gpu->zero(db);
      EXPECT_EQ(rel_err(down(db), std::vector<float>(n, 0.f)), 0.0);
    }
    // f32 -> bf16 on the device rounds exactly as the host does.
    Tensor f = up(a, {n}), h16 = poisoned({n}, DType::kBF16);
    gpu->convert(f, h16);
    std::vector<uint16_t> bits(n);
    gpu->copy(h16, Tensor(bits.data(), DType::kBF16, {n}, MemPool::kHost));
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(bits[i], f32_to_bf16(a[i])) << i;
  }
}

// LoRA's input dropout: the same counter-based mask and scaling as the CPU kernel, bit for bit,
// for any offset of the element counter, in place or not.
TEST_F(CudaKernels, DropoutEqualsTheCpuMaskBitForBit) {
  for (int64_t n : {1, 1000, 1 << 20 | 7}) {
    auto x = randn(n, 11);
    for (float p : {0.f, 0.1f, 0.5f, 0.9f}) {
      for (int64_t first : {int64_t(0), int64_t(12345678901)}) {
        const uint64_t seed = 0x5eed + uint64_t(n) + uint64_t(p * 100);
        std::vector<float> want(n, std::numeric_limits<float>::quiet_NaN());
        cpu.dropout(host(x, {n}), host(want, {n}), p, seed, first);
        Tensor dx = up(x, {n}), out = poisoned({n});
        gpu->dropout(dx, out, p, seed, first);
        const auto got = down(out);
        for (int64_t i = 0; i < n; ++i)
          ASSERT_EQ(std::memcmp(&got[i], &want[i], sizeof(float)), 0)
              << "n " << n << " p " << p << " first " << first << " element " << i;
        gpu->dropout(dx, dx, p, seed, first);  // in place
        EXPECT_EQ(rel_err(down(dx), want), 0.0);
      }
    }
  }
  // A block of 24 columns of a [37, 96] matrix masked with the whole one's row stride.
  const int64_t rows = 37, w = 24, stride = 96, first = 3 * stride + 48;
  auto x = randn(rows * w, 12);
  std::vector<float> want(size_t(rows * w), std::numeric_limits<float>::quiet_NaN());
  cpu.dropout(host(x, {rows, w}), host(want, {rows, w}), 0.3f, 77, first, stride);
  Tensor dx = up(x, {rows, w}), out = poisoned({rows, w});
  gpu->dropout(dx, out, 0.3f, 77, first, stride);
  EXPECT_EQ(rel_err(down(out), want), 0.0);
}

TEST_F(CudaKernels, CopiesBetweenPools) {
  const int64_t n = 3 << 20;  // more than one staging chunk
  auto a = randn(n, 3);
  Buffer pinned(*gpu, ledger, MemCategory::kHostOffload, MemPool::kHost, n * 4);
  Tensor hp = pinned.view(DType::kF32, {n});
  Tensor d = up(a, {n});
  gpu->copy(d, hp);
  EXPECT_EQ(0, std::memcmp(hp.data(), a.data(), n * 4));
  Tensor bf = poisoned({n}, DType::kBF16);
  gpu->convert(hp, bf);  // pinned host f32 -> device bf16
  EXPECT_LE(rel_err(down(bf), a), 4e-3);
}

// copy_async runs on the copy stream after the compute work issued before it, and compute work
// issued after wait_fence sees what it copied; the host waits only in synchronize().
TEST_F(CudaKernels, AsyncCopiesAreOrderedByFences) {
  const int64_t n = 3 << 20;
  auto a = randn(n, 4), b = randn(n, 5);
  Buffer pinned(*gpu, ledger, MemCategory::kHostOffload, MemPool::kHost, 2 * n * 4);
  Tensor out = pinned.view(DType::kF32, {n}), in = pinned.view(DType::kF32, {n}, n * 4);
  std::memcpy(in.data(), b.data(), n * 4);
  Tensor d = up(a, {n}), e = poisoned({n});
  gpu->scale(d, 2.f);                           // queued on the compute stream
  const uint64_t f1 = gpu->copy_async(d, out);  // device -> host after the scale
  const uint64_t f2 = gpu->copy_async(in, e);   // host -> device
  EXPECT_GT(f2, f1);
  gpu->wait_fence(f2);
  gpu->scale(e, 3.f);  // after the copy into e
  gpu->synchronize();
  for (int64_t i = 0; i < n; i += 997) ASSERT_EQ(out.f32()[i], 2.f * a[i]) << i;
  const auto got = down(e);
  for (int64_t i = 0; i < n; i += 997) ASSERT_EQ(got[i], 3.f * b[i]) << i;
  // The CPU backend copies at once; its fences are passed.
  std::vector<float> x = {1, 2, 3}, y(3, 0.f);
  cpu.wait_fence(cpu.copy_async(host(x, {3}), host(y, {3})));
  EXPECT_EQ(x, y);
}

// A device allocation is zeroed on the compute stream, so the first op to use it comes after
// the zeroing: a copy into the end of a fresh 4 GiB buffer (zeroed last, some milliseconds
// in) and an accumulation into its start keep their values once the whole device is idle. A
// zeroing queued on the legacy default stream runs beside the backend's non-blocking streams
// and would overwrite them.
TEST_F(CudaKernels, FreshAllocationsAreZeroedBeforeTheirFirstUse) {
  const size_t bytes = size_t(4) << 30;
  const int64_t n = 1 << 20;
  Buffer pinned(*gpu, ledger, MemCategory::kHostOffload, MemPool::kHost, n * 4);
  Tensor ones = pinned.view(DType::kF32, {n});
  std::fill_n(ones.f32(), n, 1.f);
  const Tensor d_ones = up(std::vector<float>(n, 1.f), {n});
  for (int trial = 0; trial < 4; ++trial) {
    Buffer fresh(*gpu, ledger, MemCategory::kActivations, MemPool::kDevice, bytes);
    const Tensor head = fresh.view(DType::kF32, {n});
    const Tensor tail = fresh.view(DType::kF32, {n}, bytes - size_t(n) * 4);
    gpu->copy(ones, tail);
    gpu->add(head, d_ones, head);  // 0 + 1, where the zeroing came first
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto got_tail = down(tail), got_head = down(head);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(got_tail[size_t(i)], 1.f) << "trial " << trial << ", tail element " << i;
      ASSERT_EQ(got_head[size_t(i)], 1.f) << "trial " << trial << ", head element " << i;
    }
  }
}

// Marks time the compute stream without synchronising: a stretch of GEMMs measures about what
// the host measures around it with synchronisations, an empty stretch about nothing, and a
// mark reused since is refused.
TEST_F(CudaKernels, MarksTimeTheStreamAsItRuns) {
  const int64_t n = 2048;
  const Tensor a = up(randn(size_t(n * n), 3), {n, n}, DType::kBF16);
  const Tensor c = alloc({n, n}, DType::kBF16);
  gpu->linear_forward(a, a, Tensor(), c);  // plans and loads the GEMM
  gpu->synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  const uint64_t begin = gpu->mark();
  for (int i = 0; i < 50; ++i) gpu->linear_forward(a, a, Tensor(), c);
  const uint64_t end = gpu->mark(), idle = gpu->mark();
  const double device_s = gpu->seconds_between(begin, end);  // waits for `end`
  const double host_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_GT(device_s, 0.0);
  EXPECT_LE(device_s, host_s * 1.01);
  EXPECT_GT(device_s, host_s * 0.5) << "50 GEMMs of 2048^3: the stretch is the GEMMs";
  EXPECT_LT(gpu->seconds_between(end, idle), 1e-3);
  for (uint64_t i = 0; i < Backend::kMarksKept; ++i) gpu->mark();
  EXPECT_THROW(gpu->seconds_between(begin, end), Error);
}

TEST_F(CudaKernels, Linear) {
  struct C {
    int64_t N, in, out;
    bool bias;
  };
  for (C c :
       {C{1, 1, 1, true}, C{37, 53, 29, true}, C{256, 512, 384, false}, C{1000, 96, 1, true}}) {
    for (DType t : kTypes) {
      auto x = round_to(t, randn(c.N * c.in, 4)), w = round_to(t, randn(c.out * c.in, 5, 0.1f));
      auto b = round_to(t, randn(c.out, 6)), dy = round_to(t, randn(c.N * c.out, 7));
      auto dw0 = randn(c.out * c.in, 8), db0 = randn(c.out, 9);
      std::vector<float> y(c.N * c.out), dx(c.N * c.in), dw = dw0, db = db0;
      Tensor hb = c.bias ? host(b, {c.out}) : Tensor();
      cpu.linear_forward(host(x, {c.N, c.in}), host(w, {c.out, c.in}), hb, host(y, {c.N, c.out}));
      cpu.linear_backward(host(x, {c.N, c.in}), host(w, {c.out, c.in}), host(dy, {c.N, c.out}),
                          host(dx, {c.N, c.in}), host(dw, {c.out, c.in}),
                          c.bias ? host(db, {c.out}) : Tensor());
      Tensor gx = up(x, {c.N, c.in}, t), gw = up(w, {c.out, c.in}, t);
      Tensor gb = c.bias ? up(b, {c.out}, t) : Tensor();
      Tensor gy = poisoned({c.N, c.out}, t), gdx = poisoned({c.N, c.in}, t);
      Tensor gdw = up(dw0, {c.out, c.in}), gdb = up(db0, {c.out});
      gpu->linear_forward(gx, gw, gb, gy);
      gpu->linear_backward(gx, gw, up(dy, {c.N, c.out}, t), gdx, gdw, c.bias ? gdb : Tensor());
      const std::string what = std::to_string(c.N) + "x" + std::to_string(c.in) + "x" +
                               std::to_string(c.out) + " " + std::string(dtype_name(t));
      EXPECT_LE(rel_err(down(gy), y), tol(t)) << what;
      EXPECT_LE(rel_err(down(gdx), dx), tol(t)) << what;
      EXPECT_LE(rel_err(down(gdw), dw), tol(t)) << what;
      if (c.bias) {
        EXPECT_LE(rel_err(down(gdb), db), tol(t)) << what;
      }
    }
  }
}

// One backend, one shape, calls that share the cached cuBLASLt plan or must not: a second
// bias (the cached descriptor takes each call's pointer), the residual form (C apart from D),
// and operands that start one row into their buffers (2-byte aligned in bf16 with odd
// extents: a plan of their own, told the alignment), each against the CPU.
TEST_F(CudaKernels, LinearPlansAcrossBiasesResidualsAndAlignments) {
  const int64_t N = 37, in = 53, out = 29;
  for (DType t : kTypes) {
    auto x = round_to(t, randn((N + 1) * in, 41)), w = round_to(t, randn((out + 1) * in, 42, 0.1f));
    auto b1 = round_to(t, randn(out, 43)), b2 = round_to(t, randn(out, 44));
    auto res = round_to(t, randn((N + 1) * out, 45, 3.f));
    const Tensor gx_all = up(x, {N + 1, in}, t), gw_all = up(w, {out + 1, in}, t);
    const Tensor gres_all = up(res, {N + 1, out}, t), gy_all = poisoned({N + 1, out}, t);
    const Tensor gb1 = up(b1, {out}, t), gb2 = up(b2, {out}, t);
    for (const int64_t row0 : {int64_t(0), int64_t(1), int64_t(0)}) {
      std::vector<float> hx(x.begin() + row0 * in, x.begin() + (row0 + N) * in),
          hw(w.begin() + row0 * in, w.begin() + (row0 + out) * in),
          hres(res.begin() + row0 * out, res.begin() + (row0 + N) * out), hy(N * out);
      const Tensor gx = gx_all.rows(row0, N), gw = gw_all.rows(row0, out),
                   gres = gres_all.rows(row0, N), gy = gy_all.rows(row0, N);
      const std::string what =
          std::string(dtype_name(t)) + ", operands from row " + std::to_string(row0);
      for (auto* hb : {&b1, &b2}) {
        const Tensor gb = hb == &b1 ? gb1 : gb2;
        cpu.linear_forward(host(hx, {N, in}), host(hw, {out, in}), host(*hb, {out}),
                           host(hy, {N, out}));
        gpu->linear_forward(gx, gw, gb, gy);
        EXPECT_LE(rel_err(down(gy), hy), tol(t)) << what << (hb == &b1 ? ", bias 1" : ", bias 2");
        cpu.linear_forward(host(hx, {N, in}), host(hw, {out, in}), host(*hb, {out}),
                           host(hy, {N, out}), OutputMode::kOverwrite, host(hres, {N, out}));
        gpu->linear_forward(gx, gw, gb, gy, OutputMode::kOverwrite, gres);
        EXPECT_LE(rel_err(down(gy), hy), tol(t)) << what << ", residual";
        EXPECT_EQ(down(gres), hres) << what << ": the residual is read only";
      }
    }
  }
}

TEST_F(CudaKernels, Embedding) {
  const int64_t V = 1003, D = 67, N = 4099;
  std::vector<int32_t> tok(N);
  std::mt19937 rng(10);
  for (auto& x : tok) x = int32_t(rng() % 50);  // many repeats: the backward adds them up
  for (DType t : kTypes) {
    auto table = round_to(t, randn(V * D, 11)), dout = round_to(t, randn(N * D, 12));
    auto dt0 = randn(V * D, 13);
    std::vector<float> out(N * D), dt = dt0;
    cpu.embedding_forward(host_i32(tok, {N}), host(table, {V, D}), host(out, {N, D}));
    cpu.embedding_backward(host_i32(tok, {N}), host(dout, {N, D}), host(dt, {V, D}));
    Tensor gtok = up_i32(tok, {N}), gout = poisoned({N, D}, t), gdt = up(dt0, {V, D});
    gpu->embedding_forward(gtok, up(table, {V, D}, t), gout);
    gpu->embedding_backward(gtok, up(dout, {N, D}, t), gdt);
    EXPECT_EQ(rel_err(down(gout), out), 0.0);
    EXPECT_LE(rel_err(down(gdt), dt), kTolF32);
  }
  // Every id from position 77 on is bad, each another value, checked by thousands of threads
  // at once: the op does not wait for the check; it writes zero rows for the bad ids, and the
  // next result the host reads (here a sum) raises the first one's position and its own value.
  for (int64_t i = 77; i < N; ++i) tok[i] = int32_t(V + i - 77);
  const Tensor bad_out = poisoned({N, D}), bad_tok = up_i32(tok, {N});
  const Tensor bad_table = up(randn(V * D, 1), {V, D});
  const int64_t waits = gpu->host_waits();  // the uploads above wait; the op must not
  gpu->embedding_forward(bad_tok, bad_table, bad_out);
  EXPECT_EQ(gpu->host_waits(), waits) << "the id check does not wait";
  try {
    gpu->sum_squares(bad_out.rows(77, N - 77));
    FAIL() << "an id outside the vocabulary must be an error at the next read";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kData);
    EXPECT_NE(std::string(e.what()).find("embedding_forward: token id 1003 at position 77 "),
              std::string::npos)
        << e.what();
  }
  // Raised once: the flags are clear again, and the bad ids' rows were zeros.
  EXPECT_EQ(gpu->sum_squares(bad_out.rows(77, N - 77)), 0.0);
  // The backward flags the same way.
  Tensor gdt = up(std::vector<float>(V * D, 0.f), {V, D});
  gpu->embedding_backward(bad_tok, up(randn(N * D, 14), {N, D}), gdt);
  EXPECT_THROW(gpu->sum_squares(gdt), Error);
  // A copy to host memory is a result read too (the preference objectives' row statistics).
  gpu->embedding_forward(bad_tok, bad_table, bad_out);
  std::vector<float> got(size_t(N * D));
  EXPECT_THROW(gpu->copy(bad_out, host(got, {N, D})), Error);
}

// The packed (16-byte) and the one-element paths of dropout, the embedding and the bias
// gradient's column sum at the model shapes (1B: D 2048, 2 x 2048 tokens; 8B: D 4096, 8192
// tokens), each against the CPU backend: dropout and the embedding forward bit for bit, the
// atomically summed gradients within f32 rounding. An output one element off 16-byte alignment
// takes the one-element path on the same data.
TEST_F(CudaKernels, ScalarKernelsAtModelShapesPackedAndNot) {
  for (auto [N, D] : {std::pair<int64_t, int64_t>{4096, 2048}, {8192, 4096}}) {
    for (DType t : kTypes) {
      const std::string what =
          std::to_string(N) + "x" + std::to_string(D) + " " + std::string(dtype_name(t));
      const auto x = round_to(t, randn(N * D, 21));
      // LoRA's input dropout, whole rows and a tensor-parallel half of each row.
      for (int64_t w : {D, D / 2}) {
        const int64_t stride = w == D ? 0 : D, first = 5 * D + (w == D ? 0 : w);
        std::vector<float> xs(x.begin(), x.begin() + N * w), want(size_t(N * w));
        cpu.dropout(host(xs, {N, w}), host(want, {N, w}), 0.1f, 99, first, stride);
        Tensor packed = poisoned({N, w}, t);
        Tensor odd(static_cast<std::byte*>(alloc({N * w + 1}, t).data()) + dtype_size(t), t, {N, w},
                   MemPool::kDevice);
        gpu->convert(packed, odd);  // NaN as well
        const Tensor gx = up(xs, {N, w}, t);
        gpu->dropout(gx, packed, 0.1f, 99, first, stride);
        gpu->dropout(gx, odd, 0.1f, 99, first, stride);
        const auto want_t = round_to(t, want);
        EXPECT_EQ(rel_err(down(packed), want_t), 0.0) << what << " dropout w " << w;
        EXPECT_EQ(rel_err(down(odd), want_t), 0.0) << what << " dropout w " << w << ", unaligned";
      }
      // The embedding over a 16,000-row slice of the vocabulary, ids in and out of it.
      const int64_t V = 16000;
      std::vector<int32_t> tok(N);
      std::mt19937 rng{uint32_t(N)};
      for (auto& id : tok) id = int32_t(rng() % (V + V / 4));  // a fifth another rank's
      auto table = round_to(t, randn(V * D, 22)), dout = round_to(t, x);
      const auto dt0 = randn(V * D, 23, 0.01f);
      std::vector<float> out(N * D), dt = dt0;
      cpu.embedding_forward_slice(host_i32(tok, {N}), host(table, {V, D}), 0, V + V / 4,
                                  host(out, {N, D}));
      cpu.embedding_backward_slice(host_i32(tok, {N}), host(dout, {N, D}), 0, V + V / 4,
                                   host(dt, {V, D}));
      const Tensor gtok = up_i32(tok, {N}), gtable = up(table, {V, D}, t);
      const Tensor gdout = up(dout, {N, D}, t);
      Tensor gout = poisoned({N, D}, t), gdt = up(dt0, {V, D});
      gpu->embedding_forward_slice(gtok, gtable, 0, V + V / 4, gout);
      gpu->embedding_backward_slice(gtok, gdout, 0, V + V / 4, gdt);
      EXPECT_EQ(rel_err(down(gout), out), 0.0) << what << " embedding forward";
      EXPECT_LE(rel_err(down(gdt), dt), kTolF32) << what << " embedding backward";
      // The same through views one element off alignment (the one-element path).
      Tensor odd_out(static_cast<std::byte*>(alloc({N * D + 1}, t).data()) + dtype_size(t), t,
                     {N, D}, MemPool::kDevice);
      Tensor odd_dt(static_cast<float*>(alloc({V * D + 1}, DType::kF32).data()) + 1, DType::kF32,
                    {V, D}, MemPool::kDevice);
      gpu->copy(up(dt0, {V, D}), odd_dt);
      gpu->embedding_forward_slice(gtok, gtable, 0, V + V / 4, odd_out);
      gpu->embedding_backward_slice(gtok, gdout, 0, V + V / 4, odd_dt);
      EXPECT_EQ(rel_err(down(odd_out), out), 0.0) << what << " embedding forward, unaligned";
      EXPECT_LE(rel_err(down(odd_dt), dt), kTolF32) << what << " embedding backward, unaligned";
    }
  }
}

// The bias gradient (column sums of dy over N rows) at the fused qkv projection's widths of the
// 1B and 8B shapes ((32 + 2 * 8) heads of 64 and of 128) and an odd width (the one-element path).
TEST_F(CudaKernels, BiasGradientAtModelShapes) {
  struct C {
    int64_t N, out;
  };
  for (C c : {C{4096, 3072}, C{8192, 6144}, C{4096, 3071}}) {
    for (DType t : kTypes) {
      const int64_t in = 16;  // the GEMMs are Linear's test: here the column sum counts
      auto x = round_to(t, randn(c.N * in, 31)), w = round_to(t, randn(c.out * in, 32, 0.1f));
      auto dy = round_to(t, randn(c.N * c.out, 33));
      const auto db0 = randn(c.out, 34);
      std::vector<float> dx(c.N * in), dw(c.out * in, 0.f), db = db0;
      cpu.linear_backward(host(x, {c.N, in}), host(w, {c.out, in}), host(dy, {c.N, c.out}),
                          host(dx, {c.N, in}), host(dw, {c.out, in}), host(db, {c.out}));
      Tensor gdb = up(db0, {c.out});
      gpu->linear_backward(up(x, {c.N, in}, t), up(w, {c.out, in}, t), up(dy, {c.N, c.out}, t),
                           poisoned({c.N, in}, t),
                           up(std::vector<float>(c.out * in, 0.f), {c.out, in}), gdb);
      // The same N + 1 terms per column (the rows and the old value) summed in f32 in another
      // order: within 2 gamma_{N+1} of their magnitudes' sum (tolerance.h).
      const auto got = down(gdb);
      for (int64_t j = 0; j < c.out; ++j) {
        double mag = std::fabs(db0[j]);
        for (int64_t r = 0; r < c.N; ++r) mag += std::fabs(dy[r * c.out + j]);
        ASSERT_LE(std::fabs(double(got[j]) - db[j]), 2 * gamma_n(DType::kF32, c.N + 1) * mag)
            << c.N << "x" << c.out << " " << dtype_name(t) << " column " << j;
      }
    }
  }
}

TEST_F(CudaKernels, RmsNorm) {
  for (auto [N, D] : {std::pair<int64_t, int64_t>{1, 1}, {333, 257}, {4100, 2048}}) {
    for (DType t : kTypes) {
      auto x = round_to(t, randn(N * D, 14)), w = round_to(t, randn(D, 15));
      auto dy = round_to(t, randn(N * D, 16)), dx0 = round_to(t, randn(N * D, 17));
      auto dw0 = randn(D, 18);
      std::vector<float> y(N * D), rstd(N), dx = dx0, dw = dw0;
      cpu.rmsnorm_forward(host(x, {N, D}), host(w, {D}), 1e-5f, host(y, {N, D}), host(rstd, {N}));
      cpu.rmsnorm_backward(host(x, {N, D}), host(w, {D}), host(rstd, {N}), host(dy, {N, D}),
                           host(dx, {N, D}), host(dw, {D}));
      Tensor gx = up(x, {N, D}, t), gw = up(w, {D}, t), gy = poisoned({N, D}, t),
             gr = poisoned({N}), gdx = up(dx0, {N, D}, t), gdw = up(dw0, {D});
      gpu->rmsnorm_forward(gx, gw, 1e-5f, gy, gr);
      gpu->rmsnorm_backward(gx, gw, gr, up(dy, {N, D}, t), gdx, gdw);
      EXPECT_LE(rel_err(down(gy), y), tol(t)) << N << "x" << D;
      EXPECT_LE(rel_err(down(gr), rstd), kTolF32) << N << "x" << D;
      EXPECT_LE(rel_err(down(gdx), dx), tol(t)) << N << "x" << D;
      EXPECT_LE(rel_err(down(gdw), dw), t == DType::kBF16 ? kTolBF16 : 1e-5) << N << "x" << D;
    }
  }
}

// The fused residual add and norm at the model shapes (1B: 2 x 2048 tokens of 2048; 8B: 8192 of
// 4096) and an odd width: against the CPU backend's, and bit for bit the GPU's own add then
// norm (the sum rounded as add rounds it, the norm read back from what was stored).
TEST_F(CudaKernels, AddRmsNormAtModelShapes) {
  for (auto [N, D] : {std::pair<int64_t, int64_t>{4096, 2048}, {8192, 4096}, {333, 257}}) {
    for (DType t : kTypes) {
      const auto x = round_to(t, randn(N * D, 61)), res = round_to(t, randn(N * D, 62));
      const auto w = round_to(t, randn(D, 63, 0.3f));
      // The CPU reference: the sum in f32 rounded to the storage type (as the GPU stores it),
      // then the CPU norm of that.
      std::vector<float> sum(N * D), ws = w, y(N * D), rstd(N);
      for (int64_t i = 0; i < N * D; ++i) sum[i] = res[i] + x[i];
      sum = round_to(t, sum);
      cpu.rmsnorm_forward(host(sum, {N, D}), host(ws, {D}), 1e-5f, host(y, {N, D}), host(rstd, {N}),
                          1.f);
      const Tensor gx = up(x, {N, D}, t), gw = up(w, {D}, t);
      Tensor fused_res = up(res, {N, D}, t), gy = poisoned({N, D}, t), gr = poisoned({N});
      gpu->add_rmsnorm_forward(gx, fused_res, gw, 1e-5f, gy, gr, 1.f);
      const std::string what =
          std::to_string(N) + "x" + std::to_string(D) + " " + std::string(dtype_name(t));
      EXPECT_EQ(rel_err(down(fused_res), sum), 0.0) << what << " residual";
      EXPECT_LE(rel_err(down(gy), y), tol(t)) << what << " y";
      EXPECT_LE(rel_err(down(gr), rstd), kTolF32) << what << " rstd";
      // The unfused ops on the GPU: the same bits.
      Tensor split_res = up(res, {N, D}, t), sy = poisoned({N, D}, t), sr = poisoned({N});
      gpu->add(split_res, gx, split_res);
      gpu->rmsnorm_forward(split_res, gw, 1e-5f, sy, sr, 1.f);
      EXPECT_EQ(rel_err(down(fused_res), down(split_res)), 0.0) << what << " residual";
      EXPECT_EQ(rel_err(down(gy), down(sy)), 0.0) << what << " y";
      EXPECT_EQ(rel_err(down(gr), down(sr)), 0.0) << what << " rstd";
    }
  }
}

TEST_F(CudaKernels, RopeAndSwiglu) {
  const int64_t N = 1031, H = 5, Dh = 48;
  std::vector<int32_t> pos(N);
  for (int64_t i = 0; i < N; ++i) pos[i] = int32_t(i * 97);  // positions up to ~100K
  std::vector<float> inv(Dh / 2);
  for (int64_t i = 0; i < Dh / 2; ++i) inv[i] = float(std::pow(500000.0, -2.0 * i / Dh));
  for (DType t : kTypes) {
    auto x = round_to(t, randn(N * H * Dh, 19));
    std::vector<float> fwd = x, bwd = x;
    cpu.rope_forward(host(fwd, {N, H, Dh}), host_i32(pos, {N}), host(inv, {Dh / 2}));
    cpu.rope_backward(host(bwd, {N, H, Dh}), host_i32(pos, {N}), host(inv, {Dh / 2}));
    Tensor a = up(x, {N, H, Dh}, t), b = up(x, {N, H, Dh}, t);
    Tensor gp = up_i32(pos, {N}), gi = up(inv, {Dh / 2});
    gpu->rope_forward(a, gp, gi);
    gpu->rope_backward(b, gp, gi);
    EXPECT_LE(rel_err(down(a), fwd), tol(t));
    EXPECT_LE(rel_err(down(b), bwd), tol(t));

    const int64_t rows = 3, F = 1001, n = rows * F;
    const Shape s{rows, F};
    auto g = round_to(t, randn(n, 20, 3.f)), u = round_to(t, randn(n, 21)),
         dh = round_to(t, randn(n, 22));
    std::vector<float> h(n), dg(n), du(n);
    cpu.swiglu_forward(host(g, s), host(u, s), host(h, s));
    cpu.swiglu_backward(host(g, s), host(u, s), host(dh, s), host(dg, s), host(du, s));
    Tensor gg = up(g, s, t), gu = up(u, s, t), gh = poisoned(s, t), gdg = poisoned(s, t),
           gdu = poisoned(s, t);
    gpu->swiglu_forward(gg, gu, gh);
    gpu->swiglu_backward(gg, gu, up(dh, s, t), gdg, gdu);
    EXPECT_LE(rel_err(down(gh), h), tol(t));
    EXPECT_LE(rel_err(down(gdg), dg), tol(t));
    EXPECT_LE(rel_err(down(gdu), du), tol(t));
  }
}

TEST_F(CudaKernels, LmHeadLoss) {
  struct C {
    int64_t N, D, V, chunk;
  };
  for (C c : {C{1, 8, 5, 1}, C{301, 64, 1000, 128}, C{1024, 128, 32000, 256}}) {
    for (DType t : kTypes) {
      auto h = round_to(t, randn(c.N * c.D, 50)), w = round_to(t, randn(c.V * c.D, 51, 0.2f));
      std::vector<int32_t> tgt(c.N);
      std::mt19937 rng(52);
      for (auto& x : tgt) x = rng() % 7 == 0 ? kIgnoreIndex : int32_t(rng() % c.V);
      auto dw0 = randn(c.V * c.D, 53);
      std::vector<float> dh(c.N * c.D), dw = dw0;
      const LossResult want =
          cpu.lm_head_loss(host(h, {c.N, c.D}), host(w, {c.V, c.D}), host_i32(tgt, {c.N}), c.chunk,
                           0.37f, host(dh, {c.N, c.D}), host(dw, {c.V, c.D}),
                           cpu_ws(cpu.lm_head_loss_workspace_bytes(c.chunk, c.V, DType::kF32)));
      Tensor gdh = poisoned({c.N, c.D}, t), gdw = up(dw0, {c.V, c.D});
      const LossResult got = gpu->lm_head_loss(
          up(h, {c.N, c.D}, t), up(w, {c.V, c.D}, t), up_i32(tgt, {c.N}), c.chunk, 0.37f, gdh, gdw,
          device_ws(gpu->lm_head_loss_workspace_bytes(c.chunk, c.V, t)));
      const std::string what = std::to_string(c.N) + " " + std::string(dtype_name(t));
      EXPECT_EQ(got.n_valid, want.n_valid) << what;
      EXPECT_NEAR(got.loss_sum, want.loss_sum, tol(t) * std::fabs(want.loss_sum)) << what;
      EXPECT_LE(rel_err(down(gdh), dh), tol(t)) << what;
      EXPECT_LE(rel_err(down(gdw), dw), tol(t)) << what;
    }
  }
  // A target outside the vocabulary is a data error raised at the loss's own read (no wait
  // of its own): the kernel leaves the row out (zero gradient, no loss), never reading past V.
  std::vector<int32_t> tgt = {1, 2, 9};
  Tensor gdh = up(std::vector<float>(3 * 4, 7.f), {3, 4});
  std::vector<float> hv = randn(12, 1), wv = randn(20, 2);
  const Tensor lh = up(hv, {3, 4}), lw = up(wv, {5, 4});
  const Workspace lws = device_ws(gpu->lm_head_loss_workspace_bytes(2, 5, DType::kF32));
  const Tensor bad_tgt = up_i32(tgt, {3});
  const int64_t waits = gpu->host_waits();
  try {
    gpu->lm_head_loss(lh, lw, bad_tgt, 2, 1.f, gdh, Tensor(), lws);
    FAIL() << "a target outside the vocabulary must be an error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kData);
    EXPECT_NE(std::string(e.what()).find("lm_head_loss: target id 9 at position 2 "),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(gpu->host_waits(), waits + 1) << "the check is read with the loss, one wait";
  EXPECT_EQ(rel_err(down(gdh.rows(2, 1)), std::vector<float>(4, 0.f)), 0.0);
  // The same rows with the bad target ignored give the same loss as the CPU's, flags clear.
  tgt[2] = -1;
  std::vector<float> cdh(12);
  const LossResult want = cpu.lm_head_loss(
      host(hv, {3, 4}), host(wv, {5, 4}), host_i32(tgt, {3}), 2, 1.f, host(cdh, {3, 4}), Tensor(),
      cpu_ws(cpu.lm_head_loss_workspace_bytes(2, 5, DType::kF32)));
  const LossResult got = gpu->lm_head_loss(lh, lw, up_i32(tgt, {3}), 2, 1.f, gdh, Tensor(), lws);
  EXPECT_EQ(got.n_valid, want.n_valid);
  EXPECT_NEAR(got.loss_sum, want.loss_sum, kTolF32 * std::fabs(want.loss_sum));
  EXPECT_LE(rel_err(down(gdh), cdh), kTolF32);
}

TEST_F(CudaKernels, VocabularyParallelSlices) {
  // The embedding over a slice of the vocabulary (ids elsewhere: zero rows, skipped backward).
  const int64_t N = 257, V = 96, D = 72, begin = 32, rows = 32;
  std::vector<int32_t> tok(N);
  for (int64_t i = 0; i < N; ++i) tok[i] = int32_t((i * 37 + 5) % V);
  for (DType t : kTypes) {
    auto table = round_to(t, randn(rows * D, 70)), dout = round_to(t, randn(N * D, 71));
    auto dt0 = randn(rows * D, 72);
    std::vector<float> out(N * D), dt = dt0;
    cpu.embedding_forward_slice(host_i32(tok, {N}), host(table, {rows, D}), begin, V,
                                host(out, {N, D}));
    cpu.embedding_backward_slice(host_i32(tok, {N}), host(dout, {N, D}), begin, V,
                                 host(dt, {rows, D}));
    Tensor gout = poisoned({N, D}, t), gdt = up(dt0, {rows, D});
    const Tensor gtok = up_i32(tok, {N});
    gpu->embedding_forward_slice(gtok, up(table, {rows, D}, t), begin, V, gout);
    gpu->embedding_backward_slice(gtok, up(dout, {N, D}, t), begin, V, gdt);
    EXPECT_EQ(rel_err(down(gout), out), 0.0) << dtype_name(t);
    EXPECT_LE(rel_err(down(gdt), dt), kTolF32) << dtype_name(t);
  }
  std::vector<int32_t> bad = {1, int32_t(V)};
  const Tensor bad_out = poisoned({2, D});
  gpu->embedding_forward_slice(up_i32(bad, {2}), up(randn(rows * D, 73), {rows, D}), begin, V,
                               bad_out);
  EXPECT_THROW(gpu->sum_squares(bad_out), Error) << "raised at the next read";

  // The loss over a slice: each op against the CPU's on the same inputs (the reductions over
  // ranks are the caller's; here the statistics are the slice's own).
  struct C {
    int64_t n, Vs, begin, V;
  };
  for (C c : {C{1, 5, 0, 10}, C{301, 1000, 2000, 4000}, C{64, 16000, 16000, 32000}}) {
    auto logits = randn(c.n * c.Vs, 74, 3.f);
    std::vector<int32_t> tgt(c.n);
    std::mt19937 rng(75);
    for (auto& x : tgt) x = rng() % 7 == 0 ? kIgnoreIndex : int32_t(rng() % c.V);
    std::vector<float> mx(c.n), st(2 * c.n), dl = logits;
    std::vector<double> want(2, 0.0);
    cpu.xent_slice_max(host(dl, {c.n, c.Vs}), host(mx, {c.n}));
    cpu.xent_slice_stats(host(dl, {c.n, c.Vs}), host_i32(tgt, {c.n}), c.begin, c.V, host(mx, {c.n}),
                         host(st, {c.n, 2}));
    cpu.xent_slice_finish(host(dl, {c.n, c.Vs}), host_i32(tgt, {c.n}), c.begin, host(mx, {c.n}),
                          host(st, {c.n, 2}), 0.37f, true,
                          Tensor(want.data(), DType::kF64, {2}, MemPool::kHost), cpu_ws(0));
    Tensor gl = up(logits, {c.n, c.Vs}), gmx = poisoned({c.n}), gst = poisoned({c.n, 2});
    const Tensor gtgt = up_i32(tgt, {c.n}), acc = alloc({2}, DType::kF64);
    const Workspace xws = device_ws(gpu->xent_slice_workspace_bytes(c.n));
    gpu->xent_slice_max(gl, gmx);
    EXPECT_EQ(rel_err(down(gmx), mx), 0.0) << c.n;
    gpu->xent_slice_stats(gl, gtgt, c.begin, c.V, gmx, gst);
    EXPECT_LE(rel_err(down(gst), st), kTolF32) << c.n;
    // Twice into one accumulator, the first without gradients (the logits kept): the sum of
    // both; no wait until the read.
    const int64_t waits = gpu->host_waits();
    gpu->zero(acc);
    gpu->xent_slice_finish(gl, gtgt, c.begin, gmx, gst, 0.37f, false, acc, xws);
    gpu->xent_slice_finish(gl, gtgt, c.begin, gmx, gst, 0.37f, true, acc, xws);
    gpu->xent_slice_finish(gl, gtgt, c.begin, gmx, gst, 0.37f, false, Tensor(), xws);  // adds 0
    EXPECT_EQ(gpu->host_waits(), waits) << c.n << ": the finishes do not wait";
    const LossResult got = gpu->read_loss(acc);
    EXPECT_EQ(gpu->host_waits(), waits + 1) << c.n << ": one wait, the read";
    EXPECT_EQ(got.n_valid, 2 * int64_t(want[1])) << c.n;
    EXPECT_NEAR(got.loss_sum, 2 * want[0], kTolF32 * std::fabs(2 * want[0])) << c.n;
    EXPECT_LE(rel_err(down(gl), dl), kTolF32) << c.n;
  }
  // A target outside the whole vocabulary is a data error. The stats, the fold and the finish
  // do not wait for the check: the stats and the fold give the row (0, 0) as an ignored one,
  // the finish leaves it out (zero gradient), and the loss's read (its one wait) raises it.
  const std::vector<int32_t> tgt = {1, 2, 10};
  const Tensor bl = up(randn(12, 76), {3, 4}), btgt = up_i32(tgt, {3});
  const Tensor bmx = up(randn(3, 77), {3}), gst = up(std::vector<float>(6, 7.f), {3, 2});
  const Tensor bacc = alloc({2}, DType::kF64);
  const Workspace xws = device_ws(gpu->xent_slice_workspace_bytes(3));
  for (const bool fold : {false, true}) {
    const std::string op = fold ? "xent_slice_fold" : "xent_slice_stats";
    const int64_t waits = gpu->host_waits();
    if (fold)
      gpu->xent_slice_fold(bl, btgt, 4, 10, bmx, gst, /*first=*/true);
    else
      gpu->xent_slice_stats(bl, btgt, 4, 10, bmx, gst);
    gpu->zero(bacc);
    gpu->xent_slice_finish(bl, btgt, 4, bmx, gst, 1.f, true, bacc, xws);
    EXPECT_EQ(gpu->host_waits(), waits) << op << ": the id check and the finish do not wait";
    try {
      gpu->read_loss(bacc);
      FAIL() << op << ": a target outside the vocabulary must be an error at the loss's read";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kData);
      EXPECT_NE(std::string(e.what()).find(op + ": target id 10 at position 2 "), std::string::npos)
          << e.what();
    }
    EXPECT_EQ(gpu->host_waits(), waits + 1) << op << ": read with the loss";
    const std::vector<float> st = down(gst);
    EXPECT_EQ(st[4], 0.f) << op;
    EXPECT_EQ(st[5], 0.f) << op;
    EXPECT_EQ(rel_err(down(bl.rows(2, 1)), std::vector<float>(4, 0.f)), 0.0) << op;
  }
}

TEST_F(CudaKernels, AdamW) {
  const int64_t n = 100003;
  auto p = randn(n, 60), g = randn(n, 61), m = randn(n, 62, 0.1f), v = randn(n, 63, 0.1f);
  for (float& x : v) x = std::fabs(x);
  Tensor gp = up(p, {n}), gg = up(g, {n}), gm = up(m, {n}), gv = up(v, {n});
  for (int64_t step = 1; step <= 3; ++step) {
    AdamWHyper hy;
    hy.lr = 1e-2f;
    hy.weight_decay = 0.1f;
    hy.step = step;
    hy.grad_scale = 0.5f;
    cpu.adamw_step(host(p, {n}), host(g, {n}), host(m, {n}), host(v, {n}), hy);
    gpu->adamw_step(gp, gg, gm, gv, hy);
  }
  EXPECT_LE(rel_err(down(gp), p), kTolF32);
  EXPECT_LE(rel_err(down(gm), m), kTolF32);
  EXPECT_LE(rel_err(down(gv), v), kTolF32);
}

TEST_F(CudaKernels, OutOfMemoryIsAnError) {
  try {
    Buffer huge(*gpu, ledger, MemCategory::kActivations, MemPool::kDevice, size_t(1) << 50);
    FAIL() << "a 1 PiB allocation cannot succeed";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kOutOfMemory);
    EXPECT_NE(std::string(e.what()).find("GPU"), std::string::npos) << e.what();
  }
  // The backend still works afterwards.
  Tensor a = up(randn(10, 1), {10});
  EXPECT_GT(gpu->sum_squares(a), 0.0);
}

}  // namespace
}  // namespace shardlm::test
