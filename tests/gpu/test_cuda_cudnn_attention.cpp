// cuDNN's fused attention in the CUDA backend (train.attention = "cudnn") against the CPU
// backend, in bf16 on bf16-rounded inputs with outputs poisoned with NaN first: causal rows,
// GQA and MQA, odd lengths, head dims 64 and 128, the context-parallel blocks cuDNN takes (the
// diagonal, a block wholly in the past), packed documents given as spans (cuDNN's ragged
// sequences: one-token documents, GQA, odd lengths, several rows), lse against the own kernel's;
// and the calls it must leave to the own kernel (document starts without spans, f32, a block cut
// by the diagonal), which must still be right; sliding windows on each form. Every test checks
// whether cuDNN ran, so a silent fallback fails it, and that every call found its graph built by
// the workspace query (a step builds none); packed documents at the 1B and 8B head shapes with
// 2048-token rows. Label gpu: needs an NVIDIA GPU (make test-gpu) and a build with cuDNN (else
// it skips).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cuda/cuda_backend.h"
#include "shardlm/core/buffer.h"

namespace shardlm::test {
namespace {

constexpr double kTolBF16 = 1e-2, kTolF32 = 1e-5, kTolLse = 1e-4;

// ||a - b||_inf / ||b||_inf; a NaN or inf where the other has none is infinitely wrong.
double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i]) || std::isinf(a[i]) != std::isinf(b[i]))
      return std::numeric_limits<double>::infinity();
    if (std::isinf(b[i])) {
      if (a[i] != b[i]) return std::numeric_limits<double>::infinity();
      continue;
    }
    num = std::max(num, std::fabs(double(a[i]) - double(b[i])));
    den = std::max(den, std::fabs(double(b[i])));
  }
  return den > 0 ? num / den : num;
}

std::vector<float> randn_as(DType t, size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, 1.f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  if (t == DType::kBF16)
    for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
  return v;
}

struct Case {
  int64_t B, Tq, Tk, Hq, Hkv, Dh;
  int64_t q_off = 0, k_off = 0;  // block form when either is set or Tq != Tk
  int64_t window = 0;            // sliding window, given to both backends (0: none)
  float softcap = 0;             // Gemma 2's score cap, given to both backends (0: none)
  std::string name() const {
    return fmt::format("B{} Tq{} Tk{} Hq{} Hkv{} Dh{} q_off{} k_off{} window{} softcap{}", B, Tq,
                       Tk, Hq, Hkv, Dh, q_off, k_off, window, std::to_string(softcap));
  }
  bool block() const { return q_off != 0 || k_off != 0 || Tq != Tk; }
};

// Both backends' out, lse, dq, dk, dv of one case.
struct Result {
  std::vector<float> out, lse, dq, dk, dv;
};

class CudnnAttention : public ::testing::Test {
 protected:
  void SetUp() override {
    gpu = std::make_unique<cuda::CudaBackend>(0);
    try {
      gpu->select_attention("cudnn");
    } catch (const Error& e) {
      GTEST_SKIP() << e.what();
    }
  }
  void TearDown() override {
    // Every call found its graph built by the workspace query: a step builds nothing.
    if (gpu) {
      EXPECT_EQ(gpu->cudnn_attention_unbuilt_calls(), 0);
    }
    keep.clear();
    gpu.reset();
  }

  Tensor alloc(Shape s, DType dt) {
    keep.emplace_back(*gpu, ledger, MemCategory::kActivations, MemPool::kDevice,
                      std::max<size_t>(64, size_t(s.numel()) * dtype_size(dt)));
    return keep.back().view(dt, s);
  }
  Tensor up(std::vector<float> v, Shape s, DType dt) {
    Tensor t = alloc(s, dt);
    gpu->convert(Tensor(v.data(), DType::kF32, s, MemPool::kHost), t);
    return t;
  }
  Tensor up_i32(std::vector<int32_t> v, Shape s) {
    Tensor t = alloc(s, DType::kI32);
    gpu->copy(Tensor(v.data(), DType::kI32, s, MemPool::kHost), t);
    return t;
  }
  Tensor poisoned(Shape s, DType dt) {
    return up(std::vector<float>(s.numel(), std::numeric_limits<float>::quiet_NaN()), s, dt);
  }
  std::vector<float> down(const Tensor& t) {
    std::vector<float> h(t.numel());
    gpu->convert(t, Tensor(h.data(), DType::kF32, t.shape(), MemPool::kHost));
    return h;
  }
  Workspace gpu_ws(size_t bytes) {
    keep.emplace_back(*gpu, ledger, MemCategory::kWorkspace, MemPool::kDevice,
                      std::max<size_t>(bytes, 64));
    return {keep.back().data(), keep.back().bytes()};
  }
  Workspace cpu_ws(size_t bytes) {
    host_ws.emplace_back(bytes + 128);
    auto p = reinterpret_cast<uintptr_t>(host_ws.back().data());
    return {reinterpret_cast<std::byte*>((p + 63) & ~uintptr_t(63)), bytes};
  }

  // Forward then backward of `c` on the GPU (the selected implementation) and on the CPU, which
  // takes the GPU's out for its backward; seg empty: one document per row. spans: the documents
  // of seg also as DocumentSpans (both backends get them; the CPU checks them against seg).
  void run(const Case& c, DType t, const std::vector<int32_t>& seg, Result& g, Result& ref,
           bool spans = false);

  cpu::CpuBackend cpu;
  std::unique_ptr<cuda::CudaBackend> gpu;
  MemoryLedger ledger;
  std::vector<Buffer> keep;
  std::vector<std::vector<std::byte>> host_ws;
};

// The documents of rows seg [B * T] as spans: starts of the tokens whose seg is their own index.
std::vector<int32_t> span_starts(const std::vector<int32_t>& seg, int64_t T, int64_t& longest) {
  std::vector<int32_t> starts;
  for (int64_t i = 0; i < int64_t(seg.size()); ++i)
    if (seg[i] == i % T) starts.push_back(int32_t(i));
  starts.push_back(int32_t(seg.size()));
  longest = 0;
  for (size_t d = 0; d + 1 < starts.size(); ++d)
    longest = std::max<int64_t>(longest, starts[d + 1] - starts[d]);
  return starts;
}

// Document starts seg [rows * T] of documents of these lengths, in order (none crosses a row).
std::vector<int32_t> seg_of(const std::vector<int64_t>& lengths, int64_t T) {
  std::vector<int32_t> seg;
  for (int64_t len : lengths) {
    const int32_t start = int32_t(int64_t(seg.size()) % T);
    for (int64_t i = 0; i < len; ++i) seg.push_back(start);
  }
  return seg;
}

void CudnnAttention::run(const Case& c, DType t, const std::vector<int32_t>& seg, Result& g,
                         Result& ref, bool spans) {
  const Shape sq{c.B, c.Tq, c.Hq, c.Dh}, sk{c.B, c.Tk, c.Hkv, c.Dh}, sl{c.B, c.Hq, c.Tq};
  std::vector<float> q = randn_as(t, sq.numel(), 1), k = randn_as(t, sk.numel(), 2),
                     v = randn_as(t, sk.numel(), 3), dout = randn_as(t, sq.numel(), 4);
  auto host = [](std::vector<float>& x, Shape s) {
    return Tensor(x.data(), DType::kF32, s, MemPool::kHost);
  };
  std::vector<int32_t> seg_h = seg;
  const Tensor cseg =
      seg.empty() ? Tensor() : Tensor(seg_h.data(), DType::kI32, {c.B, c.Tq}, MemPool::kHost);
  const Tensor gseg = seg.empty() ? Tensor() : up_i32(seg, {c.B, c.Tq});
  int64_t longest = 0;
  std::vector<int32_t> starts = spans ? span_starts(seg, c.Tq, longest) : std::vector<int32_t>();
  const int64_t n_docs = int64_t(starts.size()) - 1;
  const DocumentSpans cdocs =
      spans ? DocumentSpans{Tensor(starts.data(), DType::kI32, {n_docs + 1}, MemPool::kHost),
                            n_docs, longest}
            : DocumentSpans{};
  const DocumentSpans gdocs =
      spans ? DocumentSpans{up_i32(starts, {n_docs + 1}), n_docs, longest} : DocumentSpans{};
  ref.out.assign(sq.numel(), 0.f);
  ref.lse.assign(sl.numel(), 0.f);
  ref.dq.assign(sq.numel(), 0.f);
  ref.dk.assign(sk.numel(), 0.f);
  ref.dv.assign(sk.numel(), 0.f);
  const size_t cpu_bytes =
      c.block() ? cpu.attention_block_workspace_bytes(c.B, c.Tq, c.Tk, c.Hq, c.Hkv, c.Dh)
                : cpu.attention_workspace_bytes(c.B, c.Tq, c.Hq, c.Hkv, c.Dh);
  // Planned as a model plans it, with the layer's window: the query builds every graph first.
  const std::vector<int64_t> windows{c.window};
  const size_t gpu_bytes =
      c.block()
          ? gpu->attention_block_plan_workspace_bytes(c.B, c.Tq, c.Tk, c.Hq, c.Hkv, c.Dh, windows)
          : gpu->attention_plan_workspace_bytes(c.B, c.Tq, c.Hq, c.Hkv, c.Dh, windows);
  const Workspace cw = cpu_ws(cpu_bytes), gw = gpu_ws(gpu_bytes);
  const Tensor gq = up(q, sq, t), gk = up(k, sk, t), gv = up(v, sk, t);
  const Tensor gout = poisoned(sq, t), glse = poisoned(sl, DType::kF32);
  if (c.block()) {
    cpu.attention_block_forward(host(q, sq), host(k, sk), host(v, sk), cseg, c.q_off, c.k_off,
                                host(ref.out, sq), host(ref.lse, sl), cw, c.window, c.softcap);
    gpu->attention_block_forward(gq, gk, gv, gseg, c.q_off, c.k_off, gout, glse, gw, c.window,
                                 c.softcap);
  } else {
    cpu.attention_forward(host(q, sq), host(k, sk), host(v, sk), cseg, host(ref.out, sq),
                          host(ref.lse, sl), cw, cdocs, c.window, c.softcap);
    gpu->attention_forward(gq, gk, gv, gseg, gout, glse, gw, gdocs, c.window, c.softcap);
  }
  g.out = down(gout);
  g.lse = down(glse);
  const Tensor gdq = poisoned(sq, t), gdk = poisoned(sk, t), gdv = poisoned(sk, t);
  // Both backwards from the GPU's out and the CPU's lse: the gradients' inputs are the same.
  const Tensor gdo = up(dout, sq, t), glse_ref = up(ref.lse, sl, DType::kF32);
  if (c.block()) {
    cpu.attention_block_backward(host(q, sq), host(k, sk), host(v, sk), cseg, c.q_off, c.k_off,
                                 host(g.out, sq), host(ref.lse, sl), host(dout, sq),
                                 host(ref.dq, sq), host(ref.dk, sk), host(ref.dv, sk), cw, c.window,
                                 c.softcap);
    gpu->attention_block_backward(gq, gk, gv, gseg, c.q_off, c.k_off, gout, glse_ref, gdo, gdq, gdk,
                                  gdv, gw, c.window, c.softcap);
  } else {
    cpu.attention_backward(host(q, sq), host(k, sk), host(v, sk), cseg, host(g.out, sq),
                           host(ref.lse, sl), host(dout, sq), host(ref.dq, sq), host(ref.dk, sk),
                           host(ref.dv, sk), cw, cdocs, c.window, c.softcap);
    gpu->attention_backward(gq, gk, gv, gseg, gout, glse_ref, gdo, gdq, gdk, gdv, gw, gdocs,
                            c.window, c.softcap);
  }
  g.dq = down(gdq);
  g.dk = down(gdk);
  g.dv = down(gdv);
}

void expect_close(const Result& g, const Result& ref, double tol, const std::string& what) {
  EXPECT_LE(rel_err(g.out, ref.out), tol) << what << " out";
  EXPECT_LE(rel_err(g.lse, ref.lse), kTolLse) << what << " lse";
  EXPECT_LE(rel_err(g.dq, ref.dq), tol) << what << " dq";
  EXPECT_LE(rel_err(g.dk, ref.dk), tol) << what << " dk";
  EXPECT_LE(rel_err(g.dv, ref.dv), tol) << what << " dv";
}

// Causal rows without documents: cuDNN runs the forward and the backward of every case but the
// single token (cuDNN takes no s_q = s_kv = 1: the own kernel runs it).
TEST_F(CudnnAttention, CausalRowsAgreeWithTheCpu) {
  for (const Case& c :
       {Case{1, 1, 1, 1, 1, 64}, Case{2, 77, 77, 4, 2, 64}, Case{1, 300, 300, 8, 2, 128},
        Case{2, 129, 129, 4, 4, 128}, Case{1, 2048, 2048, 4, 1, 64}, Case{3, 33, 33, 6, 3, 128}}) {
    const int64_t calls = gpu->cudnn_attention_calls();
    Result g, ref;
    run(c, DType::kBF16, {}, g, ref);
    EXPECT_EQ(gpu->cudnn_attention_calls(), calls + (c.Tq == 1 ? 0 : 2))
        << c.name() << ": cuDNN did not run: "
        << gpu->cudnn_attention_declined(c.B, c.Tq, c.Tk, c.Hq, c.Hkv, c.Dh, true);
    expect_close(g, ref, kTolBF16, c.name());
  }
}

// cuDNN's lse (its softmax stats) is the own kernel's: natural log, [B, Hq, T], the layout the
// ring and the merge read.
TEST_F(CudnnAttention, LseAgreesWithTheOwnKernel) {
  const Case c{2, 195, 195, 8, 2, 128};
  Result cudnn, own, ref;
  run(c, DType::kBF16, {}, cudnn, ref);
  gpu->select_attention("own");
  const int64_t calls = gpu->cudnn_attention_calls();
  run(c, DType::kBF16, {}, own, ref);
  EXPECT_EQ(gpu->cudnn_attention_calls(), calls) << "train.attention = own ran cuDNN";
  EXPECT_LE(rel_err(cudnn.lse, own.lse), kTolLse);
  EXPECT_LE(rel_err(cudnn.out, own.out), kTolBF16);
}

// Context parallelism's blocks: the diagonal (causal) and a key block wholly before the
// queries (no mask) go to cuDNN; a block cut by the diagonal to the own kernel.
TEST_F(CudnnAttention, BlocksOnTheDiagonalAndInThePast) {
  struct BlockCase {
    Case c;
    bool cudnn;
  };
  for (const BlockCase& b : {BlockCase{Case{2, 96, 96, 4, 2, 64, 192, 192}, true},
                             BlockCase{Case{1, 77, 64, 4, 1, 128, 200, 100}, true},
                             BlockCase{Case{2, 45, 38, 4, 2, 64, 60, 38}, false}}) {
    const int64_t calls = gpu->cudnn_attention_calls();
    Result g, ref;
    run(b.c, DType::kBF16, {}, g, ref);
    EXPECT_EQ(gpu->cudnn_attention_calls(), calls + (b.cudnn ? 2 : 0))
        << b.c.name() << ": "
        << gpu->cudnn_attention_declined(b.c.B, b.c.Tq, b.c.Tk, b.c.Hq, b.c.Hkv, b.c.Dh,
                                         b.c.q_off == b.c.k_off);
    expect_close(g, ref, kTolBF16, b.c.name());
  }
}

// Document starts and f32 are not cuDNN's: the own kernel runs them, right.
TEST_F(CudnnAttention, DocumentsAndF32FallBackToTheOwnKernel) {
  const Case c{2, 100, 100, 4, 2, 64};
  std::vector<int32_t> seg(c.B * c.Tq);
  for (int64_t t = 0; t < c.Tq; ++t) {
    seg[t] = int32_t(t < 37 ? 0 : t < 80 ? 37 : 80);
    seg[c.Tq + t] = 0;
  }
  const int64_t calls = gpu->cudnn_attention_calls();
  Result g, ref;
  run(c, DType::kBF16, seg, g, ref);
  expect_close(g, ref, kTolBF16, c.name() + " documents bf16");
  run(c, DType::kF32, {}, g, ref);
  expect_close(g, ref, kTolF32, c.name() + " f32");
  EXPECT_EQ(gpu->cudnn_attention_calls(), calls);
}

// Gemma 2's soft cap has no cuDNN form here: capped calls cuDNN would otherwise take (whole
// bf16 rows, ragged documents, a diagonal block) run on the own kernel, in agreement with the
// CPU's capped kernels.
TEST_F(CudnnAttention, SoftcappedCallsRunOnTheOwnKernel) {
  const int64_t calls = gpu->cudnn_attention_calls();
  Result g, ref;
  const Case row{2, 100, 100, 4, 2, 64, 0, 0, 0, 1.0f};
  run(row, DType::kBF16, {}, g, ref);
  expect_close(g, ref, kTolBF16, row.name());
  const Case windowed{2, 100, 100, 4, 2, 64, 0, 0, 17, 0.5f};
  run(windowed, DType::kBF16, {}, g, ref);
  expect_close(g, ref, kTolBF16, windowed.name());
  std::vector<int32_t> seg(row.B * row.Tq);
  for (int64_t t = 0; t < row.Tq; ++t) {
    seg[t] = int32_t(t < 37 ? 0 : 37);
    seg[row.Tq + t] = 0;
  }
  run(row, DType::kBF16, seg, g, ref, /*spans=*/true);
  expect_close(g, ref, kTolBF16, row.name() + " ragged documents");
  const Case diagonal{2, 64, 64, 4, 2, 64, 64, 64, 0, 2.0f};
  run(diagonal, DType::kBF16, {}, g, ref);
  expect_close(g, ref, kTolBF16, diagonal.name());
  EXPECT_EQ(gpu->cudnn_attention_calls(), calls) << "cuDNN ran a soft-capped call";
}

// Packed documents given as spans run on cuDNN as ragged sequences, forward and backward, and
// agree with the CPU: documents of one token, several rows, GQA and not, odd lengths, head dims
// 64 and 128, one document per row, a count that needs no empty padding sequence, a row of
// many short documents (several calls of a larger bucket), and a long document beside many
// one-token ones (one document per call).
TEST_F(CudnnAttention, PackedDocumentsRunAsRaggedSequences) {
  struct DocCase {
    Case c;
    std::vector<int64_t> lengths;  // documents of the rows, in order, summing to B * T
  };
  std::vector<int64_t> many(100, 3);
  many.push_back(1);
  std::vector<int64_t> long_and_tiny(113, 1);
  long_and_tiny[0] = 400;
  for (const DocCase& d : {DocCase{Case{2, 100, 100, 4, 2, 64}, {37, 43, 20, 100}},
                           DocCase{Case{1, 301, 301, 8, 2, 128}, {1, 150, 1, 149}},
                           DocCase{Case{3, 64, 64, 6, 3, 128}, {64, 64, 64}},
                           DocCase{Case{2, 64, 64, 4, 4, 64}, {30, 34, 20, 44}},
                           DocCase{Case{1, 301, 301, 4, 1, 64}, many},
                           DocCase{Case{1, 512, 512, 4, 2, 64}, long_and_tiny}}) {
    const std::vector<int32_t> seg = seg_of(d.lengths, d.c.Tq);
    ASSERT_EQ(int64_t(seg.size()), d.c.B * d.c.Tq) << d.c.name();
    const int64_t calls = gpu->cudnn_attention_calls();
    Result g, ref;
    run(d.c, DType::kBF16, seg, g, ref, /*spans=*/true);
    EXPECT_EQ(gpu->cudnn_attention_calls(), calls + 2)
        << d.c.name() << ": cuDNN did not run the packed documents";
    expect_close(g, ref, kTolBF16, d.c.name() + " packed documents");
  }
}

// Packed documents at the models' real sizes run on cuDNN, forward and backward, and agree with
// the CPU: the Llama-3.2-1B head shape (32/8 heads, Dh 64) and the 8B's (32/8, Dh 128), two rows
// of 2048 tokens with several documents each, the 1B's under a sliding window too. Issue 43:
// these graphs were declined, a formula capping the workspace below what the GQA backward asks
// (with max_total_seq_len_kv set, the frontend adds f32 full-head dK and dV, B T Hq Dh 4 bytes
// each, to the dQ accumulator); the plan now holds what the graphs ask.
TEST_F(CudnnAttention, PackedDocumentsAtRealSizesRunOnCudnn) {
  struct DocCase {
    Case c;
    std::vector<int64_t> lengths;  // documents of the rows, in order, summing to B * T
  };
  for (const DocCase& d :
       {DocCase{Case{2, 2048, 2048, 32, 8, 64}, {517, 1024, 300, 207, 1, 1500, 547}},
        DocCase{Case{2, 2048, 2048, 32, 8, 128}, {1200, 848, 64, 64, 1920}},
        DocCase{Case{2, 2048, 2048, 32, 8, 64, 0, 0, 512}, {700, 1348, 2048}}}) {
    const Case& c = d.c;
    const std::vector<int32_t> seg = seg_of(d.lengths, c.Tq);
    ASSERT_EQ(int64_t(seg.size()), c.B * c.Tq) << c.name();
    const std::vector<int64_t> windows{c.window};
    const size_t planned =
        gpu->attention_plan_workspace_bytes(c.B, c.Tq, c.Hq, c.Hkv, c.Dh, windows);
    EXPECT_GE(planned, size_t(3 * c.B * c.Tq * c.Hq * c.Dh) * sizeof(float)) << c.name();
    const int64_t longest = *std::max_element(d.lengths.begin(), d.lengths.end());
    const int64_t calls = gpu->cudnn_attention_calls();
    Result g, ref;
    run(c, DType::kBF16, seg, g, ref, /*spans=*/true);
    EXPECT_EQ(gpu->cudnn_attention_calls(), calls + 2)
        << c.name() << ": cuDNN did not run the packed documents: "
        << gpu->cudnn_ragged_declined(c.B, c.Tq, c.Hq, c.Hkv, c.Dh, int64_t(d.lengths.size()),
                                      longest, c.window);
    expect_close(g, ref, kTolBF16, c.name() + " packed documents");
  }
}

// Sliding windows ride on cuDNN as the diagonal band's left bound: whole rows (a window shorter
// than the row, and one as long, which masks nothing), packed documents as ragged sequences,
// the diagonal block; a past block wholly inside the window runs unmasked on cuDNN, one the
// window's edge cuts runs on the own kernel. All agree with the CPU.
TEST_F(CudnnAttention, SlidingWindowsAgreeWithTheCpu) {
  for (const Case& c :
       {Case{2, 300, 300, 8, 2, 128, 0, 0, 37}, Case{1, 129, 129, 4, 1, 64, 0, 0, 1},
        Case{1, 200, 200, 4, 2, 64, 0, 0, 200}}) {
    const int64_t calls = gpu->cudnn_attention_calls();
    Result g, ref;
    run(c, DType::kBF16, {}, g, ref);
    EXPECT_EQ(gpu->cudnn_attention_calls(), calls + 2) << c.name() << ": cuDNN did not run";
    expect_close(g, ref, kTolBF16, c.name());
  }
  const Case docs{2, 100, 100, 4, 2, 64, 0, 0, 9};
  const std::vector<int32_t> seg = seg_of({37, 43, 20, 100}, docs.Tq);
  int64_t calls = gpu->cudnn_attention_calls();
  Result g, ref;
  run(docs, DType::kBF16, seg, g, ref, /*spans=*/true);
  EXPECT_EQ(gpu->cudnn_attention_calls(), calls + 2) << docs.name() << ": not run as ragged";
  expect_close(g, ref, kTolBF16, docs.name() + " packed documents");
  struct BlockCase {
    Case c;
    bool cudnn;
  };
  for (const BlockCase& b : {BlockCase{Case{2, 96, 96, 4, 2, 64, 192, 192, 40}, true},
                             BlockCase{Case{1, 64, 64, 4, 1, 128, 200, 136, 128}, true},
                             BlockCase{Case{1, 64, 64, 4, 1, 128, 200, 136, 100}, false}}) {
    calls = gpu->cudnn_attention_calls();
    run(b.c, DType::kBF16, {}, g, ref);
    EXPECT_EQ(gpu->cudnn_attention_calls(), calls + (b.cudnn ? 2 : 0)) << b.c.name();
    expect_close(g, ref, kTolBF16, b.c.name());
  }
}

// The planned workspace covers cuDNN's: the query builds the graphs, so a step allocates nothing.
TEST_F(CudnnAttention, WorkspaceQueryCoversCudnn) {
  const int64_t B = 2, T = 1024, Hq = 16, Hkv = 4, Dh = 128;
  const size_t ws = gpu->attention_workspace_bytes(B, T, Hq, Hkv, Dh);
  EXPECT_EQ(gpu->cudnn_attention_declined(B, T, T, Hq, Hkv, Dh, true), "");
  gpu->select_attention("own");
  const size_t own = gpu->attention_workspace_bytes(B, T, Hq, Hkv, Dh);
  EXPECT_GE(ws, own);
  EXPECT_EQ(own, size_t(B * T * Hq) * sizeof(float));  // the own backward's delta rows
}

// Every packed-document bucket of the 1B and 8B head shapes (each length 64 .. T, with and
// without a window) builds: none is left to the own kernel at the sizes the models train at.
TEST_F(CudnnAttention, EveryBucketAtTheModelShapesIsTaken) {
  struct Shape {
    int64_t B, T, Hq, Hkv, Dh;
  };
  for (const Shape& m : {Shape{2, 2048, 32, 8, 64}, Shape{1, 8192, 32, 8, 128}}) {
    const std::vector<int64_t> windows{0, 512};
    const size_t planned =
        gpu->attention_plan_workspace_bytes(m.B, m.T, m.Hq, m.Hkv, m.Dh, windows);
    EXPECT_GE(planned, size_t(3 * m.B * m.T * m.Hq * m.Dh) * sizeof(float));
    for (int64_t len = 64; len <= m.T; len *= 2)
      for (int64_t w : windows)
        EXPECT_EQ(gpu->cudnn_ragged_declined(m.B, m.T, m.Hq, m.Hkv, m.Dh, m.B * m.T / len, len, w),
                  "")
            << "B " << m.B << " T " << m.T << " Dh " << m.Dh << " length " << len << " window "
            << w;
  }
}

TEST(CudnnAttentionSelect, UnknownImplementationIsAConfigError) {
  cuda::CudaBackend gpu(0);
  try {
    gpu.select_attention("flash");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig);
    EXPECT_NE(std::string(e.what()).find("train.attention"), std::string::npos) << e.what();
  }
  EXPECT_NE(gpu.select_attention("own").find("own"), std::string::npos);
}

}  // namespace
}  // namespace shardlm::test
