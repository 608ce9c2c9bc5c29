// The CUDA attention kernels against the CPU backend on fresh random data (see
// test_cuda_kernels.cpp for the tolerances): whole sequences with and without documents, one
// query block against key blocks before, at and after it with their merge, and decoding.
// Label gpu: needs an NVIDIA GPU (make test-gpu).
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "gpu/cuda_kernels_fixture.h"

namespace shardlm::test {
namespace {

std::vector<int32_t> documents(int64_t B, int64_t T, bool docs, uint64_t seed) {
  std::vector<int32_t> seg(B * T, 0);
  if (!docs) return seg;
  std::mt19937_64 rng(seed);
  for (int64_t b = 0; b < B; ++b) {
    int64_t start = 0;
    while (start < T) {
      const int64_t end = std::min<int64_t>(T, start + 1 + int64_t(rng() % (T / 3 + 1)));
      for (int64_t t = start; t < end; ++t) seg[b * T + t] = int32_t(start);
      start = end;
    }
  }
  return seg;
}

struct AttnCase {
  int64_t B, T, Hq, Hkv, Dh;
  bool docs;
};

TEST_F(CudaKernels, Attention) {
  for (AttnCase c : {AttnCase{1, 1, 1, 1, 8, false}, AttnCase{2, 77, 4, 2, 16, true},
                     AttnCase{1, 300, 6, 2, 64, true}, AttnCase{2, 129, 2, 1, 128, false},
                     AttnCase{1, 70, 2, 2, 256, true}, AttnCase{1, 2048, 2, 1, 64, true}}) {
    for (DType t : kTypes) {
      const int64_t nq = c.B * c.T * c.Hq * c.Dh, nk = c.B * c.T * c.Hkv * c.Dh;
      auto q = round_to(t, randn(nq, 23)), k = round_to(t, randn(nk, 24)),
           v = round_to(t, randn(nk, 25)), dout = round_to(t, randn(nq, 26));
      auto seg = documents(c.B, c.T, c.docs, 27);
      const Shape sq{c.B, c.T, c.Hq, c.Dh}, sk{c.B, c.T, c.Hkv, c.Dh}, sl{c.B, c.Hq, c.T};
      std::vector<float> out(nq), lse(c.B * c.Hq * c.T), dq(nq), dk(nk), dv(nk);
      const Workspace cw = cpu_ws(cpu.attention_workspace_bytes(c.B, c.T, c.Hq, c.Hkv, c.Dh));
      cpu.attention_forward(host(q, sq), host(k, sk), host(v, sk), host_i32(seg, {c.B, c.T}),
                            host(out, sq), host(lse, sl), cw);
      // The CPU reference's backward reads out in f32; give it the GPU's rounding of out too.
      Tensor gq = up(q, sq, t), gk = up(k, sk, t), gv = up(v, sk, t),
             gseg = up_i32(seg, {c.B, c.T});
      Tensor gout = poisoned(sq, t), glse = poisoned(sl);
      const Workspace gw = device_ws(gpu->attention_workspace_bytes(c.B, c.T, c.Hq, c.Hkv, c.Dh));
      gpu->attention_forward(gq, gk, gv, gseg, gout, glse, gw);
      std::vector<float> out_g = down(gout);
      cpu.attention_backward(host(q, sq), host(k, sk), host(v, sk), host_i32(seg, {c.B, c.T}),
                             host(out_g, sq), host(lse, sl), host(dout, sq), host(dq, sq),
                             host(dk, sk), host(dv, sk), cw);
      Tensor gdq = poisoned(sq, t), gdk = poisoned(sk, t), gdv = poisoned(sk, t);
      gpu->attention_backward(gq, gk, gv, gseg, gout, glse, up(dout, sq, t), gdq, gdk, gdv, gw);
      const std::string what = fmt::format("B{} T{} Hq{} Hkv{} Dh{}{}{}", c.B, c.T, c.Hq, c.Hkv,
                                           c.Dh, c.docs ? " docs " : " ", dtype_name(t));
      EXPECT_LE(rel_err(out_g, out), tol(t)) << what;
      EXPECT_LE(rel_err(down(glse), lse), kTolF32) << what;
      EXPECT_LE(rel_err(down(gdq), dq), tol(t)) << what;
      EXPECT_LE(rel_err(down(gdk), dk), tol(t)) << what;
      EXPECT_LE(rel_err(down(gdv), dv), tol(t)) << what;
    }
  }
}

// More rows than the own kernels' grid takes (65535 on its z axis): an error naming the limit,
// not the launch's "invalid configuration argument". f32, so cuDNN never takes the call.
TEST_F(CudaKernels, AttentionRowsBeyondTheGridAreRefusedByName) {
  const int64_t B = 65536, T = 1, H = 1, Dh = 8;
  const Shape s{B, T, H, Dh};
  const Tensor q = up(randn(B * T * H * Dh, 40), s);
  const Tensor seg = up_i32(std::vector<int32_t>(B * T, 0), {B, T});
  const Workspace ws = device_ws(gpu->attention_workspace_bytes(B, T, H, H, Dh));
  try {
    gpu->attention_forward(q, q, q, seg, poisoned(s), poisoned({B, H, T}), ws);
    FAIL() << "65536 rows must be refused";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("65535"), std::string::npos) << e.what();
  }
}

// One query block against key blocks before, at and after it (context parallelism's pieces),
// and their merge.
TEST_F(CudaKernels, AttentionBlocksAndMerge) {
  const int64_t B = 2, Tq = 45, Tk = 38, Hq = 4, Hkv = 2, Dh = 32, q_off = 60;
  const Shape sq{B, Tq, Hq, Dh}, sk{B, Tk, Hkv, Dh}, sl{B, Hq, Tq};
  auto q = randn(B * Tq * Hq * Dh, 30), dout = randn(B * Tq * Hq * Dh, 31);
  std::vector<int32_t> seg(B * Tq);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tq; ++t) seg[b * Tq + t] = int32_t(b == 0 ? 0 : (t < 20 ? 40 : 80));
  const Workspace cw = cpu_ws(cpu.attention_block_workspace_bytes(B, Tq, Tk, Hq, Hkv, Dh));
  const Workspace gw = device_ws(gpu->attention_block_workspace_bytes(B, Tq, Tk, Hq, Hkv, Dh));
  std::vector<float> acc_out(q.size(), 0.f),
      acc_lse(B * Hq * Tq, -std::numeric_limits<float>::infinity());
  Tensor g_acc_out = up(acc_out, sq), g_acc_lse = up(acc_lse, sl);
  for (int64_t k_off : {0, 38, 76, 100}) {
    auto k = randn(B * Tk * Hkv * Dh, 32 + k_off), v = randn(B * Tk * Hkv * Dh, 33 + k_off);
    std::vector<float> out(q.size()), lse(B * Hq * Tq);
    cpu.attention_block_forward(host(q, sq), host(k, sk), host(v, sk), host_i32(seg, {B, Tq}),
                                q_off, k_off, host(out, sq), host(lse, sl), cw);
    Tensor gout = poisoned(sq), glse = poisoned(sl);
    Tensor gq = up(q, sq), gk = up(k, sk), gv = up(v, sk), gseg = up_i32(seg, {B, Tq});
    gpu->attention_block_forward(gq, gk, gv, gseg, q_off, k_off, gout, glse, gw);
    EXPECT_LE(rel_err(down(gout), out), kTolF32) << k_off;
    EXPECT_LE(rel_err(down(glse), lse), kTolF32) << k_off;
    cpu.attention_merge(host(acc_out, sq), host(acc_lse, sl), host(out, sq), host(lse, sl));
    gpu->attention_merge(g_acc_out, g_acc_lse, gout, glse);
    EXPECT_LE(rel_err(down(g_acc_out), acc_out), kTolF32) << k_off;
    EXPECT_LE(rel_err(down(g_acc_lse), acc_lse), kTolF32) << k_off;
  }
  // The backward of each block given the merged (final) out and lse.
  for (int64_t k_off : {0, 38, 76, 100}) {
    auto k = randn(B * Tk * Hkv * Dh, 32 + k_off), v = randn(B * Tk * Hkv * Dh, 33 + k_off);
    std::vector<float> dq(q.size()), dk(k.size()), dv(k.size());
    cpu.attention_block_backward(host(q, sq), host(k, sk), host(v, sk), host_i32(seg, {B, Tq}),
                                 q_off, k_off, host(acc_out, sq), host(acc_lse, sl), host(dout, sq),
                                 host(dq, sq), host(dk, sk), host(dv, sk), cw);
    Tensor gdq = poisoned(sq), gdk = poisoned(sk), gdv = poisoned(sk);
    gpu->attention_block_backward(up(q, sq), up(k, sk), up(v, sk), up_i32(seg, {B, Tq}), q_off,
                                  k_off, up(acc_out, sq), up(acc_lse, sl), up(dout, sq), gdq, gdk,
                                  gdv, gw);
    EXPECT_LE(rel_err(down(gdq), dq), kTolF32) << k_off;
    EXPECT_LE(rel_err(down(gdk), dk), kTolF32) << k_off;
    EXPECT_LE(rel_err(down(gdv), dv), kTolF32) << k_off;
  }
}

TEST_F(CudaKernels, AttentionDecode) {
  const int64_t B = 2, Tmax = 100, Hq = 6, Hkv = 3, Dh = 64;
  for (auto [cache_len, Tq] : {std::pair<int64_t, int64_t>{0, 17}, {50, 1}, {93, 7}}) {
    auto q = randn(B * Tq * Hq * Dh, 40), kc = randn(B * Tmax * Hkv * Dh, 41),
         vc = randn(B * Tmax * Hkv * Dh, 42);
    const Shape sq{B, Tq, Hq, Dh}, sc{B, Tmax, Hkv, Dh};
    std::vector<float> out(q.size());
    cpu.attention_decode(host(q, sq), host(kc, sc), host(vc, sc), cache_len, host(out, sq),
                         cpu_ws(cpu.attention_decode_workspace_bytes(B, Tq, Tmax, Hq, Dh)));
    Tensor gout = poisoned(sq);
    gpu->attention_decode(up(q, sq), up(kc, sc), up(vc, sc), cache_len, gout,
                          device_ws(gpu->attention_decode_workspace_bytes(B, Tq, Tmax, Hq, Dh)));
    EXPECT_LE(rel_err(down(gout), out), kTolF32) << cache_len << " " << Tq;
  }
}

}  // namespace
}  // namespace shardlm::test
