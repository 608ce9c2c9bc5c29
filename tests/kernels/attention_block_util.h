// The block attention tests' shared inputs (test_attention_block.cpp,
// test_attention_block_split.cpp): a full row of random inputs, blocks cut from it at full-row
// offsets, and thin wrappers around the CPU block kernels, the full-row kernels and
// attention_merge, on f32 and on bf16 storage. No reference and no assertions here; the f64
// reference lives beside the tests that compare against it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "kernels/bf16_check.h"
#include "kernels/cpu/ops.h"
#include "test_util.h"

namespace shardlm::test {

// f32 kernel vs f64 reference (as in test_attention.cpp): f32 tile sums and the exp2 polynomial.
inline constexpr double kOutAtol = 5e-6, kOutRtol = 5e-5;    // out
inline constexpr double kLseAtol = 3e-6, kLseRtol = 3e-6;    // lse
inline constexpr double kGradAtol = 1e-5, kGradRtol = 1e-4;  // dq, dk, dv

// One full row of B batch rows, T tokens; blocks are slices [offset, offset + len) of it.
struct RowCase {
  int64_t B, T, Hq, Hkv, Dh;
  bool docs;           // several packed documents per batch row, else one causal sequence
  int64_t window = 0;  // sliding window (0: none), given to every kernel call
};

struct Span {
  int64_t offset, len;
};

inline std::string case_name(const RowCase& c) {
  // std::string first: GCC 12 wrongly warns (-Wrestrict) on "literal" + std::string&& here.
  return std::string("B") + std::to_string(c.B) + "_T" + std::to_string(c.T) + "_Hq" +
         std::to_string(c.Hq) + "_Hkv" + std::to_string(c.Hkv) + "_Dh" + std::to_string(c.Dh) +
         (c.docs ? "_docs" : "") + (c.window > 0 ? "_window" + std::to_string(c.window) : "");
}

// Document starts [B, T], full-row indices: random lengths in [1, max(2, T / 3)], so that
// boundaries fall anywhere inside and across blocks.
inline std::vector<int32_t> make_seg_start(const RowCase& c, uint64_t seed) {
  std::vector<int32_t> seg(c.B * c.T, 0);
  if (!c.docs) return seg;
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> len(1, std::max<int64_t>(2, c.T / 3));
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t start = 0; start < c.T;) {
      const int64_t end = std::min(c.T, start + len(rng));
      for (int64_t t = start; t < end; ++t) seg[b * c.T + t] = static_cast<int32_t>(start);
      start = end;
    }
  }
  return seg;
}

struct Row {
  RowCase c;
  std::vector<float> q;      // [B, T, Hq, Dh]
  std::vector<float> k, v;   // [B, T, Hkv, Dh]
  std::vector<int32_t> seg;  // [B, T]
  std::vector<float> dout;   // [B, T, Hq, Dh]
};

inline Row make_row(const RowCase& c, uint64_t seed) {
  const size_t nq = c.B * c.T * c.Hq * c.Dh;
  const size_t nkv = c.B * c.T * c.Hkv * c.Dh;
  return Row{c,
             random_vec(nq, seed, -2.f, 2.f),
             random_vec(nkv, seed + 1, -2.f, 2.f),
             random_vec(nkv, seed + 2),
             make_seg_start(c, seed + 3),
             random_vec(nq, seed + 4)};
}

// Tokens [s.offset, s.offset + s.len) of x [B, T, width] -> [B, s.len, width].
template <typename X>
std::vector<X> slice_tokens(const std::vector<X>& x, int64_t B, int64_t T, int64_t width, Span s) {
  std::vector<X> y(B * s.len * width);
  for (int64_t b = 0; b < B; ++b) {
    std::copy_n(x.begin() + (b * T + s.offset) * width, s.len * width,
                y.begin() + b * s.len * width);
  }
  return y;
}

// Adds y [B, s.len, width] into tokens s of x [B, T, width].
template <typename X, typename Y>
void add_tokens(std::vector<X>& x, int64_t B, int64_t T, int64_t width, Span s,
                const std::vector<Y>& y) {
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < s.len * width; ++i) {
      x[(b * T + s.offset) * width + i] += y[b * s.len * width + i];
    }
  }
}

// The inputs of one (query block, key block) pair, cut from a Row.
struct Block {
  RowCase c;
  Span qs, ks;
  std::vector<float> q, k, v, dout;
  std::vector<int32_t> seg;  // [B, Tq]
  Shape q_shape() const { return Shape{c.B, qs.len, c.Hq, c.Dh}; }
  Shape kv_shape() const { return Shape{c.B, ks.len, c.Hkv, c.Dh}; }
  Shape lse_shape() const { return Shape{c.B, c.Hq, qs.len}; }
};

inline Block cut_block(const Row& r, Span qs, Span ks) {
  const RowCase& c = r.c;
  return Block{c,
               qs,
               ks,
               slice_tokens(r.q, c.B, c.T, c.Hq * c.Dh, qs),
               slice_tokens(r.k, c.B, c.T, c.Hkv * c.Dh, ks),
               slice_tokens(r.v, c.B, c.T, c.Hkv * c.Dh, ks),
               slice_tokens(r.dout, c.B, c.T, c.Hq * c.Dh, qs),
               slice_tokens(r.seg, c.B, c.T, 1, qs)};
}

// lse [B, Hq, T] -> [B, Hq, s.len] for query tokens s.
template <typename X>
std::vector<X> slice_lse(const std::vector<X>& lse, const RowCase& c, Span s) {
  return slice_tokens(lse, c.B * c.Hq, c.T, 1, s);
}

struct Fwd {
  std::vector<float> out, lse;
};
struct Grads {
  std::vector<float> dq, dk, dv;
};

inline std::vector<std::byte> block_workspace(const Block& blk) {
  const RowCase& c = blk.c;
  return std::vector<std::byte>(
      cpu::attention_block_workspace_bytes(c.B, blk.qs.len, blk.ks.len, c.Hq, c.Hkv, c.Dh));
}

inline Fwd block_forward(Block& blk) {
  Fwd f{std::vector<float>(blk.q.size(), NAN), std::vector<float>(blk.lse_shape().numel(), NAN)};
  std::vector<std::byte> ws = block_workspace(blk);
  cpu::attention_block_forward(
      view(blk.q, blk.q_shape()), view(blk.k, blk.kv_shape()), view(blk.v, blk.kv_shape()),
      view(blk.seg, Shape{blk.c.B, blk.qs.len}), blk.qs.offset, blk.ks.offset,
      view(f.out, blk.q_shape()), view(f.lse, blk.lse_shape()), Workspace{ws.data(), ws.size()},
      blk.c.window);
  return f;
}

// out, lse: the queries' final results [B, Tq, Hq, Dh], [B, Hq, Tq].
inline Grads block_backward(Block& blk, std::vector<float> out, std::vector<float> lse) {
  Grads g{std::vector<float>(blk.q.size(), NAN), std::vector<float>(blk.k.size(), NAN),
          std::vector<float>(blk.v.size(), NAN)};  // overwritten: NaN must not leak through
  std::vector<std::byte> ws = block_workspace(blk);
  cpu::attention_block_backward(
      view(blk.q, blk.q_shape()), view(blk.k, blk.kv_shape()), view(blk.v, blk.kv_shape()),
      view(blk.seg, Shape{blk.c.B, blk.qs.len}), blk.qs.offset, blk.ks.offset,
      view(out, blk.q_shape()), view(lse, blk.lse_shape()), view(blk.dout, blk.q_shape()),
      view(g.dq, blk.q_shape()), view(g.dk, blk.kv_shape()), view(g.dv, blk.kv_shape()),
      Workspace{ws.data(), ws.size()}, blk.c.window);
  return g;
}

// attention_forward and attention_backward on the whole row.
struct FullResult {
  Fwd f;
  Grads g;
};
inline FullResult full_attention(Row& r) {
  const RowCase& c = r.c;
  const Shape q_shape{c.B, c.T, c.Hq, c.Dh}, kv_shape{c.B, c.T, c.Hkv, c.Dh};
  const Shape lse_shape{c.B, c.Hq, c.T};
  FullResult x{{std::vector<float>(r.q.size()), std::vector<float>(lse_shape.numel())},
               {std::vector<float>(r.q.size()), std::vector<float>(r.k.size()),
                std::vector<float>(r.v.size())}};
  std::vector<std::byte> ws(cpu::attention_workspace_bytes(c.B, c.T, c.Hq, c.Hkv, c.Dh));
  const Workspace w{ws.data(), ws.size()};
  const Tensor q = view(r.q, q_shape), k = view(r.k, kv_shape), v = view(r.v, kv_shape);
  const Tensor seg = view(r.seg, Shape{c.B, c.T});
  const Tensor out = view(x.f.out, q_shape), lse = view(x.f.lse, lse_shape);
  cpu::attention_forward(q, k, v, seg, out, lse, w, c.window);
  cpu::attention_backward(q, k, v, seg, out, lse, view(r.dout, q_shape), view(x.g.dq, q_shape),
                          view(x.g.dk, kv_shape), view(x.g.dv, kv_shape), w, c.window);
  return x;
}

inline void merge(const Block& blk, Fwd& running, Fwd& part) {
  cpu::attention_merge(view(running.out, blk.q_shape()), view(running.lse, blk.lse_shape()),
                       view(part.out, blk.q_shape()), view(part.lse, blk.lse_shape()));
}

// ---- bf16 storage: the same kernels on a row or block whose values bf16 holds exactly ----------

inline void round_to_bf16(Row& r) {
  for (auto* x : {&r.q, &r.k, &r.v, &r.dout}) round_to_bf16(*x);
}

struct Bf16Fwd {
  Bf16Vec out;
  std::vector<float> lse;  // f32 whatever the storage
};
struct Bf16Grads {
  Bf16Vec dq, dk, dv;
};

inline Bf16Fwd block_forward_bf16(const Block& blk) {
  Bf16Vec q = to_bf16(blk.q), k = to_bf16(blk.k), v = to_bf16(blk.v);
  std::vector<int32_t> seg = blk.seg;
  Bf16Fwd f{Bf16Vec(q.size(), kBf16NaN), std::vector<float>(blk.lse_shape().numel(), NAN)};
  std::vector<std::byte> ws = block_workspace(blk);
  cpu::attention_block_forward(view(q, blk.q_shape()), view(k, blk.kv_shape()),
                               view(v, blk.kv_shape()), view(seg, Shape{blk.c.B, blk.qs.len}),
                               blk.qs.offset, blk.ks.offset, view(f.out, blk.q_shape()),
                               view(f.lse, blk.lse_shape()), Workspace{ws.data(), ws.size()});
  return f;
}

// out, lse: the queries' final results [B, Tq, Hq, Dh] (bf16), [B, Hq, Tq] (f32).
inline Bf16Grads block_backward_bf16(const Block& blk, Bf16Vec out, std::vector<float> lse) {
  Bf16Vec q = to_bf16(blk.q), k = to_bf16(blk.k), v = to_bf16(blk.v), dout = to_bf16(blk.dout);
  std::vector<int32_t> seg = blk.seg;
  Bf16Grads g{Bf16Vec(q.size(), kBf16NaN), Bf16Vec(k.size(), kBf16NaN),
              Bf16Vec(v.size(), kBf16NaN)};
  std::vector<std::byte> ws = block_workspace(blk);
  cpu::attention_block_backward(
      view(q, blk.q_shape()), view(k, blk.kv_shape()), view(v, blk.kv_shape()),
      view(seg, Shape{blk.c.B, blk.qs.len}), blk.qs.offset, blk.ks.offset, view(out, blk.q_shape()),
      view(lse, blk.lse_shape()), view(dout, blk.q_shape()), view(g.dq, blk.q_shape()),
      view(g.dk, blk.kv_shape()), view(g.dv, blk.kv_shape()), Workspace{ws.data(), ws.size()});
  return g;
}

// attention_forward and attention_backward on the whole row, bf16 storage.
struct FullResultBf16 {
  Bf16Fwd f;
  Bf16Grads g;
};
inline FullResultBf16 full_attention_bf16(Row& r) {
  const RowCase& c = r.c;
  const Shape q_shape{c.B, c.T, c.Hq, c.Dh}, kv_shape{c.B, c.T, c.Hkv, c.Dh};
  const Shape lse_shape{c.B, c.Hq, c.T};
  Bf16Vec q = to_bf16(r.q), k = to_bf16(r.k), v = to_bf16(r.v), dout = to_bf16(r.dout);
  FullResultBf16 x{
      {Bf16Vec(q.size(), kBf16NaN), std::vector<float>(lse_shape.numel(), NAN)},
      {Bf16Vec(q.size(), kBf16NaN), Bf16Vec(k.size(), kBf16NaN), Bf16Vec(v.size(), kBf16NaN)}};
  std::vector<std::byte> ws(cpu::attention_workspace_bytes(c.B, c.T, c.Hq, c.Hkv, c.Dh));
  const Workspace w{ws.data(), ws.size()};
  const Tensor tq = view(q, q_shape), tk = view(k, kv_shape), tv = view(v, kv_shape);
  const Tensor seg = view(r.seg, Shape{c.B, c.T});
  const Tensor out = view(x.f.out, q_shape), lse = view(x.f.lse, lse_shape);
  cpu::attention_forward(tq, tk, tv, seg, out, lse, w);
  cpu::attention_backward(tq, tk, tv, seg, out, lse, view(dout, q_shape), view(x.g.dq, q_shape),
                          view(x.g.dk, kv_shape), view(x.g.dv, kv_shape), w);
  return x;
}

struct BlockCase {
  RowCase c;
  Span qs, ks;
};

inline std::string block_case_name(const BlockCase& x) {
  return case_name(x.c) + "_q" + std::to_string(x.qs.offset) + "_" + std::to_string(x.qs.len) +
         "_k" + std::to_string(x.ks.offset) + "_" + std::to_string(x.ks.len);
}

// Names the case in failure messages instead of its bytes.
inline void PrintTo(const BlockCase& x, std::ostream* os) { *os << block_case_name(x); }

}  // namespace shardlm::test
