// The op table's cases (op_table.h): every Backend op, each case building its inputs, running
// the op on the backend under test and checking the outputs against its f64 reference. Shapes
// are odd on purpose (no multiple of a tile or vector width); outputs start as NaN.
#pragma once

#include <fmt/format.h>

#include <cstring>
#include <string>
#include <utility>

namespace shardlm::test::ops {

namespace cases {

// The normwise tolerance of an op in `dt` whose longest f32 chain has `reduction` operations and
// which stores `bf16_roundings` bf16 values along it (the output; a GPU kernel's bf16 operands of
// its second product too) (tests/tolerance.h). An elementwise op with a transcendental counts its
// few operations (kElementChain: exp or sin, a division, products; libm's vector functions within
// 4 ulp).
inline double tol_of(DType dt, int64_t reduction, int bf16_roundings = 1) {
  return test::op_tolerance(dt, reduction, bf16_roundings);
}
constexpr int64_t kElementChain = 16;

// ---- memory movement and elementwise ----------------------------------------------------------

// The blocks of `layout` moved one element at a time from x (the source starting `offset`
// elements in) into a dst [dst_n] of NaN: copy_blocks' reference.
inline Values blocks_reference(const BlockCopy& layout, const Values& x, int64_t offset,
                               int64_t dst_n) {
  Values want(size_t(dst_n), std::numeric_limits<double>::quiet_NaN());
  for (int64_t i = 0; i < layout.n[0]; ++i)
    for (int64_t j = 0; j < layout.n[1]; ++j)
      for (int64_t l = 0; l < layout.n[2]; ++l)
        for (int64_t e = 0; e < layout.block; ++e)
          want[size_t(i * layout.dst[0] + j * layout.dst[1] + l * layout.dst[2] + e)] =
              x[size_t(offset + i * layout.src[0] + j * layout.src[1] + l * layout.src[2] + e)];
  return want;
}

// copy_blocks of `layout` from a random src [src_n] (a view `offset` elements into its buffer)
// into dst [dst_n], against blocks_reference.
inline void blocks_case(OpRun& r, const BlockCopy& layout, int64_t src_n, int64_t dst_n,
                        int64_t offset) {
  Values x = OpRun::randn(src_n, 21);
  const Tensor src = r.in_at(offset, x, {src_n}), dst = r.out({dst_n});
  const Values want = blocks_reference(layout, x, 0, dst_n);
  r.be.copy_blocks(src, dst, layout);
  r.check(dst, want, "dst");
}

// A host-pool tensor over `bytes` holding v in dtype dt, v rounded to what it holds (as in()).
inline Tensor host_values(std::vector<std::byte>& bytes, Values& v, DType dt) {
  const size_t es = dtype_size(dt);
  bytes.assign(v.size() * es, std::byte{0});
  for (size_t i = 0; i < v.size(); ++i) {
    if (dt == DType::kF32) {
      const float f = float(v[i]);
      std::memcpy(bytes.data() + i * es, &f, es);
      if (!std::isnan(v[i])) v[i] = f;
    } else {
      const uint16_t h = f32_to_bf16(float(v[i]));
      std::memcpy(bytes.data() + i * es, &h, es);
      if (!std::isnan(v[i])) v[i] = bf16_to_f32(h);
    }
  }
  return Tensor(bytes.data(), dt, {int64_t(v.size())}, MemPool::kHost);
}

inline Values host_read(const Tensor& t) {
  const size_t es = dtype_size(t.dtype());
  const auto* p = static_cast<const std::byte*>(t.data());
  Values v(size_t(t.numel()));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t.dtype() == DType::kF32) {
      float f;
      std::memcpy(&f, p + i * es, es);
      v[i] = f;
    } else {
      uint16_t h;
      std::memcpy(&h, p + i * es, es);
      v[i] = bf16_to_f32(h);
    }
  }
  return v;
}

// blocks_case with the src in host memory (`offset` elements into it) and the dst
// on the backend, then the src on the backend and the dst in host memory: a device backend
// moves host blocks as copy does.
inline void blocks_host_case(OpRun& r, const BlockCopy& layout, int64_t src_n, int64_t dst_n,
                             int64_t offset) {
  Values x = OpRun::randn(src_n + offset, 22);
  std::vector<std::byte> src_bytes, dst_bytes;
  const Tensor all = host_values(src_bytes, x, r.dtype);
  const Tensor src(static_cast<std::byte*>(all.data()) + offset * dtype_size(r.dtype), r.dtype,
                   {src_n}, MemPool::kHost);
  const Values want = blocks_reference(layout, x, offset, dst_n);
  const Tensor dst = r.out({dst_n});
  r.be.copy_blocks(src, dst, layout);
  r.check(dst, want, "device dst");
  Values from(x.begin() + offset, x.end());
  const Tensor dev_src = r.in(from, {src_n});
  Values poison(size_t(dst_n), std::numeric_limits<double>::quiet_NaN());
  const Tensor host_dst = host_values(dst_bytes, poison, r.dtype);
  r.be.copy_blocks(dev_src, host_dst, layout);
  r.check(host_read(host_dst), want, "host dst");
}

inline void memory_cases(std::vector<OpCase>& c) {
  c.push_back({"zero", "n1031", DType::kF32, 0, true, [](OpRun& r) {
                 Values x = OpRun::randn(1031, 1);
                 const Tensor t = r.in(x, {1031});
                 r.be.zero(t);
                 r.check(t, Values(1031, 0.0), "x");
               }});
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back({"copy", "n1031", dt, 0, true, [](OpRun& r) {
                   Values x = OpRun::randn(1031, 2);
                   const Tensor src = r.in(x, {1031}), dst = r.out({1031});
                   r.be.copy(src, dst);
                   r.check(dst, x, "dst");
                 }});
  c.push_back(
      {"copy_async", "n4099 then a write after the fence", DType::kF32, 0, true, [](OpRun& r) {
         Values x = OpRun::randn(4099, 3), y = OpRun::randn(4099, 4);
         const Tensor src = r.in(x, {4099}), dst = r.out({4099});
         r.be.wait_fence(r.be.copy_async(src, dst));
         const Tensor other = r.in(y, {4099});
         r.be.copy(other, src);  // after the fence: the copy has read src already
         r.check(dst, x, "dst");
       }});
  c.push_back({"wait_fence", "two copies, the second fenced on the first", DType::kF32, 0, true,
               [](OpRun& r) {
                 Values x = OpRun::randn(2053, 5);
                 const Tensor a = r.in(x, {2053}), b = r.out({2053}), d = r.out({2053});
                 const uint64_t f = r.be.copy_async(a, b);
                 r.be.wait_fence(f);
                 r.be.copy(b, d);  // compute-stream work after the fence sees b written
                 r.check(d, x, "d");
               }});
  c.push_back({"host_wait_fence", "a copy into host memory, read by the host after the wait",
               DType::kF32, 0, true, [](OpRun& r) {
                 Values x = OpRun::randn(2053, 9);
                 const Tensor a = r.in(x, {2053});
                 std::vector<float> host(2053, std::numeric_limits<float>::quiet_NaN());
                 const Tensor h(host.data(), DType::kF32, {2053}, MemPool::kHost);
                 r.be.host_wait_fence(r.be.copy_async(a, h));
                 Values seen(host.begin(), host.end());  // what the host read, nothing else waited
                 r.check(r.in(seen, {2053}), x, "host dst");
               }});
  // Exact copies, element for element (tolerance 0), every dst element written. Packing 3 of
  // 7 heads per member for 2 members replicated over 2 (src stride 0), odd sizes; a token
  // reorder (a transpose of [U, M] blocks to [M, U]); a src view that starts misaligned.
  for (const DType dt : {DType::kF32, DType::kBF16}) {
    c.push_back(
        {"copy_blocks", "heads [13, 7, 5] -> [2, 2, 13, 3, 5], src stride 0", dt, 0, true,
         [](OpRun& r) {
           const int64_t N = 13, H = 7, Dh = 5, Hg = 3, row = Hg * Dh;
           const BlockCopy L{{2, 2, N}, row, {2 * Dh, 0, H * Dh}, {2 * N * row, N * row, row}};
           blocks_case(r, L, N * H * Dh, 4 * N * row, 0);
         }});
    c.push_back({"copy_blocks", "tokens [3, 4, 2 x 9] -> [4, 3, 2 x 9], misaligned src", dt, 0,
                 true, [](OpRun& r) {
                   const int64_t U = 3, M = 4, blk = 18;
                   const BlockCopy L{{1, U, M}, blk, {0, M * blk, blk}, {0, blk, U * blk}};
                   blocks_case(r, L, U * M * blk, U * M * blk, 1);
                 }});
    // Blocks, strides and pointers all multiples of 16 bytes (a device backend's widest
    // words), then the same src 2 elements in (8 bytes for f32, 4 for bf16).
    for (const int64_t offset : {0, 2})
      c.push_back({"copy_blocks",
                   "heads [11, 6, 8] -> [3, 11, 2, 8], src +" + std::to_string(offset), dt, 0, true,
                   [offset](OpRun& r) {
                     const int64_t N = 11, H = 6, Dh = 8, U = 3, row = 2 * Dh;
                     const BlockCopy L{{U, 1, N}, row, {row, 0, H * Dh}, {N * row, 0, row}};
                     blocks_case(r, L, N * H * Dh, U * N * row, offset);
                   }});
    // Host memory on one side: the input sharding's rows (two pieces of each of 3 rows, from a
    // view 1 element in), and replicated heads (src stride 0).
    c.push_back(
        {"copy_blocks", "host rows [3, 20] -> [3, 2 x 5], and back", dt, 0, true, [](OpRun& r) {
           const BlockCopy L{{3, 2, 1}, 5, {20, 12, 0}, {10, 5, 0}};
           blocks_host_case(r, L, 59, 30, 1);
         }});
    c.push_back(
        {"copy_blocks", "host heads [13, 7, 5] -> [2, 2, 13, 3, 5], and back", dt, 0, true,
         [](OpRun& r) {
           const int64_t N = 13, H = 7, Dh = 5, row = 3 * Dh;
           const BlockCopy L{{2, 2, N}, row, {2 * Dh, 0, H * Dh}, {2 * N * row, N * row, row}};
           blocks_host_case(r, L, N * H * Dh, 4 * N * row, 0);
         }});
  }
  c.push_back({"convert", "f32 -> bf16 -> f32, n777", DType::kBF16, 0, true, [](OpRun& r) {
                 Values x = OpRun::randn(777, 6, 3.0);
                 const Tensor f = r.in(x, {777}, DType::kF32), h = r.out({777}, DType::kBF16),
                              back = r.out({777}, DType::kF32);
                 Values want(x.size());  // round to nearest even, the contract
                 for (size_t i = 0; i < x.size(); ++i)
                   want[i] = bf16_to_f32(f32_to_bf16(float(x[i])));
                 r.be.convert(f, h);
                 r.be.convert(h, back);
                 r.check(h, want, "bf16");
                 r.check(back, want, "f32 again");
               }});
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back({"add", "n3001, and out aliasing a", dt, tol_of(dt, 1), true, [](OpRun& r) {
                   Values a = OpRun::randn(3001, 7), b = OpRun::randn(3001, 8);
                   const Tensor ta = r.in(a, {3001}), tb = r.in(b, {3001}), out = r.out({3001});
                   Values want(a.size());
                   for (size_t i = 0; i < a.size(); ++i) want[i] = a[i] + b[i];
                   r.be.add(ta, tb, out);
                   r.check(out, want, "out");
                   r.be.add(ta, tb, ta);
                   r.check(ta, want, "a (aliased)");
                 }});
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back({"scale", "n2999 by -0.37", dt, tol_of(dt, 1), true, [](OpRun& r) {
                   Values x = OpRun::randn(2999, 9);
                   const Tensor t = r.in(x, {2999});
                   for (double& v : x) v *= double(-0.37f);
                   r.be.scale(t, -0.37f);
                   r.check(t, x, "x");
                 }});
  // One f32 product per element, rounded once: the f64 product of the stored values.
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back({"scale_rows", "37 rows of 129", dt, tol_of(dt, 1), true, [](OpRun& r) {
                   Values x = OpRun::randn(37 * 129, 11), s = OpRun::randn(37, 12);
                   s[5] = 0.0;  // a row the objective gives no weight
                   const Tensor t = r.in(x, {37, 129});
                   const Tensor ts = r.in(s, {37}, DType::kF32);  // s rounded to f32 in place
                   for (size_t i = 0; i < x.size(); ++i) x[i] *= s[i / 129];
                   r.be.scale_rows(t, ts);
                   r.check(t, x, "x");
                 }});
  // The inputs are exact in either dtype and the sum of squares is f64: bf16 storage costs no
  // accuracy, and an f64 sum of positive terms is within gamma_n of it.
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back({"sum_squares", "n100003, f64 sum", dt, test::gamma_n(DType::kF64, 100003), true,
                 [](OpRun& r) {
                   Values x = OpRun::randn(100003, 10);
                   const Tensor t = r.in(x, {100003});
                   double want = 0;
                   for (double v : x) want += v * v;
                   r.check(Values{r.be.sum_squares(t)}, Values{want}, "sum");
                 }});
  // Exact in either dtype: one f32 product per kept element, rounded once to the storage type.
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back({"dropout", "p 0.3 from element 1000, n5003", dt, 0, true, [](OpRun& r) {
                   Values x = OpRun::randn(5003, 11);
                   const Tensor t = r.in(x, {5003}), out = r.out({5003});
                   r.be.dropout(t, out, 0.3f, 77, 1000);
                   // The mask is the contract of cpu/dropout.cpp: SplitMix64's finaliser of
                   // (mix(seed) ^ (first + i)), kept when its top 24 bits reach p * 2^24.
                   auto mix = [](uint64_t z) {
                     z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
                     z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
                     return z ^ (z >> 31);
                   };
                   const uint32_t threshold = uint32_t(0.3f * double(1u << 24));
                   Values want(x.size());
                   for (size_t i = 0; i < x.size(); ++i) {
                     const uint32_t bits = uint32_t(mix(mix(77) ^ uint64_t(1000 + i)) >> 40);
                     const float kept = float(x[i]) * (1.f / (1.f - 0.3f));
                     want[i] = bits < threshold         ? 0.0
                               : r.dtype == DType::kF32 ? double(kept)
                                                        : double(bf16_to_f32(f32_to_bf16(kept)));
                   }
                   r.check(out, want, "out");
                 }});
}

// ---- linear, embedding
// ---------------------------------------------------------------------------

// y and dx overwritten (from NaN) or accumulated (OutputMode::kAccumulate: onto random values,
// the reference y0 + x W^T (+ b), dx0 + dy W).
inline void linear_forward_cases(std::vector<OpCase>& c) {
  for (const DType dt : {DType::kF32, DType::kBF16})
    for (const bool bias : {false, true})
      for (const OutputMode mode : {OutputMode::kOverwrite, OutputMode::kAccumulate}) {
        const bool acc = mode == OutputMode::kAccumulate;
        c.push_back({"linear_forward",
                     std::string("N37 in67 out45") + (bias ? " with bias" : "") +
                         (acc ? ", y accumulates" : ""),
                     dt, tol_of(dt, 67 + 2), true, [bias, acc, mode](OpRun& r) {
                       Values x = OpRun::randn(37 * 67, 12), w = OpRun::randn(45 * 67, 13, 0.2),
                              b = OpRun::randn(45, 14), y0 = OpRun::randn(37 * 45, 20);
                       const Tensor tx = r.in(x, {37, 67}), tw = r.in(w, {45, 67}),
                                    tb = bias ? r.in(b, {45}) : Tensor(),
                                    y = acc ? r.in(y0, {37, 45}) : r.out({37, 45});
                       Values want = matmul_nt(x, w, 37, 67, 45);  // [37, 45]
                       for (int64_t i = 0; i < 37 * 45; ++i)
                         want[i] += (bias ? b[i % 45] : 0.0) + (acc ? y0[i] : 0.0);
                       r.be.linear_forward(tx, tw, tb, y, mode);
                       r.check(y, want, "y");
                     }});
      }
}

// y = residual + x W^T (+ b) from NaN, the residual apart from y or y itself (the contract's
// two aliasings; the second is kAccumulate by another name).
inline void linear_residual_cases(std::vector<OpCase>& c) {
  for (const DType dt : {DType::kF32, DType::kBF16})
    for (const bool bias : {false, true})
      for (const bool in_place : {false, true})
        c.push_back({"linear_forward",
                     std::string("N37 in67 out45, residual") +
                         (in_place ? " is y" : " apart from y") + (bias ? ", with bias" : ""),
                     dt, tol_of(dt, 67 + 2), true, [bias, in_place](OpRun& r) {
                       Values x = OpRun::randn(37 * 67, 22), w = OpRun::randn(45 * 67, 23, 0.2),
                              b = OpRun::randn(45, 24), res = OpRun::randn(37 * 45, 25, 3.0);
                       const Tensor tx = r.in(x, {37, 67}), tw = r.in(w, {45, 67}),
                                    tb = bias ? r.in(b, {45}) : Tensor(),
                                    tres = r.in(res, {37, 45}),
                                    y = in_place ? tres : r.out({37, 45});
                       Values want = matmul_nt(x, w, 37, 67, 45);  // [37, 45]
                       for (int64_t i = 0; i < 37 * 45; ++i)
                         want[i] += (bias ? b[i % 45] : 0.0) + res[i];
                       r.be.linear_forward(tx, tw, tb, y, OutputMode::kOverwrite, tres);
                       r.check(y, want, "y");
                       if (!in_place) r.check(tres, res, "residual (read only)");
                     }});
}

inline void linear_cases(std::vector<OpCase>& c) {
  linear_forward_cases(c);
  linear_residual_cases(c);
  // dw f32 or the activations' dtype; db f32
  for (const auto& [dt, dw_dt] :
       {std::pair{DType::kF32, DType::kF32}, std::pair{DType::kBF16, DType::kF32},
        std::pair{DType::kBF16, DType::kBF16}})
    for (const OutputMode mode : {OutputMode::kOverwrite, OutputMode::kAccumulate})
      c.push_back({"linear_backward",
                   std::string("N29 in51 out23, dw and db accumulate") +
                       (mode == OutputMode::kAccumulate ? ", dx accumulates" : "") +
                       (dt == DType::kF32      ? ""
                        : dw_dt == DType::kF32 ? ", f32 dw"
                                               : ", bf16 dw"),
                   dt, tol_of(dt, 29 + 1), true, [dw_dt, mode](OpRun& r) {
                     const int64_t N = 29, in = 51, out = 23;
                     const bool acc = mode == OutputMode::kAccumulate;
                     Values x = OpRun::randn(N * in, 15), w = OpRun::randn(out * in, 16),
                            dy = OpRun::randn(N * out, 17), dw = OpRun::randn(out * in, 18),
                            db = OpRun::randn(out, 19), dx0 = OpRun::randn(N * in, 21);
                     const Tensor tx = r.in(x, {N, in}), tw = r.in(w, {out, in}),
                                  tdy = r.in(dy, {N, out}),
                                  tdx = acc ? r.in(dx0, {N, in}) : r.out({N, in}),
                                  tdw = r.in(dw, {out, in}, dw_dt),
                                  tdb = r.in(db, {out}, DType::kF32);
                     Values dx = acc ? dx0 : Values(static_cast<size_t>(N * in), 0.0);  // [N, in]
                     for (int64_t n = 0; n < N; ++n)
                       for (int64_t o = 0; o < out; ++o) {
                         db[o] += dy[n * out + o];
                         for (int64_t i = 0; i < in; ++i) {
                           dx[n * in + i] += dy[n * out + o] * w[o * in + i];
                           dw[o * in + i] += dy[n * out + o] * x[n * in + i];
                         }
                       }
                     r.be.linear_backward(tx, tw, tdy, tdx, tdw, tdb, mode);
                     r.check(tdx, dx, "dx");
                     r.check(tdw, dw, "dw");
                     r.check(tdb, db, "db");
                   }});
}

inline std::vector<int32_t> token_ids(int64_t n, int64_t V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(static_cast<size_t>(n));
  for (int32_t& t : ids) t = int32_t(rng() % uint64_t(V));
  return ids;
}

// The forward copies rows (exact in either dtype); the backward adds dout rows of either dtype
// into an f32 dtable in f32, so its tolerance is f32's in both.
inline void embedding_cases(std::vector<OpCase>& c) {
  for (const DType dt : {DType::kF32, DType::kBF16}) {
    c.push_back({"embedding_forward", "N41 V53 D19", dt, 0, true, [](OpRun& r) {
                   Values table = OpRun::randn(53 * 19, 20);
                   const std::vector<int32_t> ids = token_ids(41, 53, 21);
                   const Tensor tt = r.in(table, {53, 19}), out = r.out({41, 19});
                   Values want(static_cast<size_t>(41 * 19));
                   for (int64_t n = 0; n < 41; ++n)
                     for (int64_t d = 0; d < 19; ++d) want[n * 19 + d] = table[ids[n] * 19 + d];
                   r.be.embedding_forward(r.ids(ids), tt, out);
                   r.check(out, want, "out");
                 }});
    c.push_back(
        {"embedding_backward", "N41 V53 D19, repeated ids accumulate into f32", dt,
         tol_of(DType::kF32, 41 + 1), true, [](OpRun& r) {
           Values dout = OpRun::randn(41 * 19, 22), dtable = OpRun::randn(53 * 19, 23);
           const std::vector<int32_t> ids = token_ids(41, 53, 24);
           const Tensor tdo = r.in(dout, {41, 19}), tdt = r.in(dtable, {53, 19}, DType::kF32);
           for (int64_t n = 0; n < 41; ++n)
             for (int64_t d = 0; d < 19; ++d) dtable[ids[n] * 19 + d] += dout[n * 19 + d];
           r.be.embedding_backward(r.ids(ids), tdo, tdt);
           r.check(tdt, dtable, "dtable");
         }});
    c.push_back(
        {"embedding_forward_slice", "ids of V61, this slice [20, 37)", dt, 0, true, [](OpRun& r) {
           Values table = OpRun::randn(17 * 13, 25);
           const std::vector<int32_t> ids = token_ids(43, 61, 26);
           const Tensor tt = r.in(table, {17, 13}), out = r.out({43, 13});
           Values want(static_cast<size_t>(43 * 13), 0.0);
           for (int64_t n = 0; n < 43; ++n)
             if (ids[n] >= 20 && ids[n] < 37)
               for (int64_t d = 0; d < 13; ++d) want[n * 13 + d] = table[(ids[n] - 20) * 13 + d];
           r.be.embedding_forward_slice(r.ids(ids), tt, 20, 61, out);
           r.check(out, want, "out");
         }});
    c.push_back(
        {"embedding_backward_slice", "ids of V61, this slice [20, 37)", dt,
         tol_of(DType::kF32, 43 + 1), true, [](OpRun& r) {
           Values dout = OpRun::randn(43 * 13, 27), dtable = OpRun::randn(17 * 13, 28);
           const std::vector<int32_t> ids = token_ids(43, 61, 29);
           const Tensor tdo = r.in(dout, {43, 13}), tdt = r.in(dtable, {17, 13}, DType::kF32);
           for (int64_t n = 0; n < 43; ++n)
             if (ids[n] >= 20 && ids[n] < 37)
               for (int64_t d = 0; d < 13; ++d) dtable[(ids[n] - 20) * 13 + d] += dout[n * 13 + d];
           r.be.embedding_backward_slice(r.ids(ids), tdo, 20, 61, tdt);
           r.check(tdt, dtable, "dtable");
         }});
  }
}

// ---- RMSNorm, RoPE, SwiGLU, GeGLU ------------------------------------------------------------

inline void norm_cases(std::vector<OpCase>& c) {
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back(
        {"rmsnorm_forward", "N33 D71", dt, tol_of(dt, 71 + kElementChain), true, [](OpRun& r) {
           const int64_t N = 33, D = 71;
           Values x = OpRun::randn(N * D, 30, 2.0), w = OpRun::randn(D, 31);
           const Tensor tx = r.in(x, {N, D}), tw = r.in(w, {D}), y = r.out({N, D}),
                        rstd = r.out({N}, DType::kF32);
           Values want(static_cast<size_t>(N * D)), want_rstd(static_cast<size_t>(N));
           rmsnorm_reference(x, w, N, D, want_rstd, &want);
           r.be.rmsnorm_forward(tx, tw, 1e-5f, y, rstd);
           r.check(y, want, "y");
           r.check(rstd, want_rstd, "rstd");
         }});
  // x, w, dy, dx of the case's dtype; rstd and dw f32.
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back({"rmsnorm_backward", "N33 D71, dx and dw accumulate", dt,
                 tol_of(dt, 71 + 33 + kElementChain), true, [](OpRun& r) {
                   const int64_t N = 33, D = 71;
                   Values x = OpRun::randn(N * D, 32), w = OpRun::randn(D, 33),
                          dy = OpRun::randn(N * D, 34), dx = OpRun::randn(N * D, 35),
                          dw = OpRun::randn(D, 36), rstd(static_cast<size_t>(N));
                   const Tensor tx = r.in(x, {N, D}), tw = r.in(w, {D}), tdy = r.in(dy, {N, D}),
                                tdx = r.in(dx, {N, D}), tdw = r.in(dw, {D}, DType::kF32);
                   rmsnorm_reference(x, w, N, D, rstd, nullptr);
                   const Tensor tr = r.in(rstd, {N}, DType::kF32);
                   rmsnorm_backward_reference(x, w, dy, rstd, N, D, dx, dw);
                   r.be.rmsnorm_backward(tx, tw, tr, tdy, tdx, tdw);
                   r.check(tdx, dx, "dx");
                   r.check(tdw, dw, "dw");
                 }});
  // The residual add and the norm in one op: the sum stored (rounded once more in bf16, the norm's
  // input then carrying it) and the norm of it; D 71 (one element at a time on a GPU) and D 64
  // (packs) with Gemma's offset.
  for (const DType dt : {DType::kF32, DType::kBF16})
    for (const int64_t D : {int64_t(71), int64_t(64)})
      c.push_back({"add_rmsnorm_forward", D == 71 ? "N33 D71" : "N33 D64, w_offset 1", dt,
                   tol_of(dt, D + kElementChain, 2), true, [D](OpRun& r) {
                     const int64_t N = 33;
                     const double off = D == 64 ? 1.0 : 0.0;
                     Values x = OpRun::randn(N * D, 140, 2.0), res = OpRun::randn(N * D, 141, 2.0),
                            w = OpRun::randn(D, 142, off > 0 ? 0.3 : 1.0);
                     const Tensor tx = r.in(x, {N, D}), tres = r.in(res, {N, D}), tw = r.in(w, {D}),
                                  y = r.out({N, D}), rstd = r.out({N}, DType::kF32);
                     Values sum(res.size()), want(res.size()), want_rstd(static_cast<size_t>(N));
                     for (size_t i = 0; i < sum.size(); ++i) sum[i] = res[i] + x[i];
                     rmsnorm_reference(sum, w, N, D, want_rstd, &want, off);
                     r.be.add_rmsnorm_forward(tx, tres, tw, 1e-5f, y, rstd, float(off));
                     r.check(tres, sum, "residual");
                     r.check(y, want, "y");
                     r.check(rstd, want_rstd, "rstd");
                   }});
  // Gemma's (1 + w) weights: w_offset 1, w small around 0 as trained Gemma norms are.
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back({"rmsnorm_forward", "N33 D71, w_offset 1", dt, tol_of(dt, 71 + kElementChain), true,
                 [](OpRun& r) {
                   const int64_t N = 33, D = 71;
                   Values x = OpRun::randn(N * D, 130, 2.0), w = OpRun::randn(D, 131, 0.3);
                   const Tensor tx = r.in(x, {N, D}), tw = r.in(w, {D}), y = r.out({N, D}),
                                rstd = r.out({N}, DType::kF32);
                   Values want(static_cast<size_t>(N * D)), want_rstd(static_cast<size_t>(N));
                   rmsnorm_reference(x, w, N, D, want_rstd, &want, 1.0);
                   r.be.rmsnorm_forward(tx, tw, 1e-5f, y, rstd, 1.f);
                   r.check(y, want, "y");
                   r.check(rstd, want_rstd, "rstd");
                 }});
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back({"rmsnorm_backward", "N33 D71, w_offset 1, dx and dw accumulate", dt,
                 tol_of(dt, 71 + 33 + kElementChain), true, [](OpRun& r) {
                   const int64_t N = 33, D = 71;
                   Values x = OpRun::randn(N * D, 132), w = OpRun::randn(D, 133, 0.3),
                          dy = OpRun::randn(N * D, 134), dx = OpRun::randn(N * D, 135),
                          dw = OpRun::randn(D, 136), rstd(static_cast<size_t>(N));
                   const Tensor tx = r.in(x, {N, D}), tw = r.in(w, {D}), tdy = r.in(dy, {N, D}),
                                tdx = r.in(dx, {N, D}), tdw = r.in(dw, {D}, DType::kF32);
                   rmsnorm_reference(x, w, N, D, rstd, nullptr, 1.0);
                   const Tensor tr = r.in(rstd, {N}, DType::kF32);
                   rmsnorm_backward_reference(x, w, dy, rstd, N, D, dx, dw, 1.0);
                   r.be.rmsnorm_backward(tx, tw, tr, tdy, tdx, tdw, 1.f);
                   r.check(tdx, dx, "dx");
                   r.check(tdw, dw, "dw");
                 }});
}

// Rotates pair i of the first R = 2 * inv_freq.size() dims of each head of x [N, H, Dh] by
// pos * inv_freq[i]: dims (i, i + R/2), or (2i, 2i + 1) when interleaved (GLM); the other dims
// stay. sign -1 is the inverse.
inline void rope_ref(Values& x, const std::vector<int32_t>& pos, const Values& inv_freq, int64_t H,
                     int64_t Dh, double sign, bool interleaved = false) {
  const auto freqs = int64_t(inv_freq.size());
  for (size_t n = 0; n < pos.size(); ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < freqs; ++i) {
        const double a = sign * pos[n] * inv_freq[i];
        double* head = &x[(n * H + h) * Dh];
        double& x1 = interleaved ? head[2 * i] : head[i];
        double& x2 = interleaved ? head[2 * i + 1] : head[i + freqs];
        const double y1 = x1 * std::cos(a) - x2 * std::sin(a);
        const double y2 = x2 * std::cos(a) + x1 * std::sin(a);
        x1 = y1;
        x2 = y2;
      }
}

// inv_freq [R/2] as models compute it: theta^(-2i/R) in f32, R the rotated dims.
inline Values rope_inv_freq(int64_t rotary_dim, double theta = 10000.0) {
  Values inv(static_cast<size_t>(rotary_dim / 2));
  for (int64_t i = 0; i < rotary_dim / 2; ++i)
    inv[i] = double(float(std::pow(theta, -2.0 * double(i) / double(rotary_dim))));
  return inv;
}

inline void rope_swiglu_cases(std::vector<OpCase>& c) {
  // x of the case's dtype, rotated in place; inv_freq f32.
  // Whole heads in rotate_half pairs (Llama), and GLM's interleaved pairs over part of a head
  // (R = 10 of Dh = 22: an odd number of pairs, the last 12 dims passed through).
  struct RopeVariant {
    int64_t R;
    bool interleaved;
  };
  for (const RopeVariant v : {RopeVariant{22, false}, RopeVariant{10, true}})
    for (const DType dt : {DType::kF32, DType::kBF16})
      for (const bool forward : {true, false})
        c.push_back(
            {forward ? "rope_forward" : "rope_backward",
             fmt::format("N19 H3 Dh22 R{}{}, positions to 5000", v.R,
                         v.interleaved ? " interleaved" : ""),
             dt, tol_of(dt, kElementChain), true, [v, forward](OpRun& r) {
               const int64_t N = 19, H = 3, Dh = 22;
               Values x = OpRun::randn(N * H * Dh, forward ? 37 : 38), inv = rope_inv_freq(v.R);
               std::vector<int32_t> pos = token_ids(N, 5000, 39);
               const Tensor tx = r.in(x, {N, H, Dh}), tinv = r.in(inv, {v.R / 2}, DType::kF32);
               const Tensor tpos = r.ids(pos);
               const RopePairs pairs = v.interleaved ? RopePairs::kInterleaved : RopePairs::kHalf;
               rope_ref(x, pos, inv, H, Dh, forward ? 1.0 : -1.0, v.interleaved);
               if (forward)
                 r.be.rope_forward(tx, tpos, tinv, pairs);
               else
                 r.be.rope_backward(tx, tpos, tinv, pairs);
               r.check(tx, x, "x");
             }});
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back({"swiglu_forward", "N17 F93", dt, tol_of(dt, kElementChain), true, [](OpRun& r) {
                   Values g = OpRun::randn(17 * 93, 40, 3.0), u = OpRun::randn(17 * 93, 41);
                   const Tensor tg = r.in(g, {17, 93}), tu = r.in(u, {17, 93}), h = r.out({17, 93});
                   Values want(g.size());
                   for (size_t i = 0; i < g.size(); ++i)
                     want[i] = g[i] / (1 + std::exp(-g[i])) * u[i];
                   r.be.swiglu_forward(tg, tu, h);
                   r.check(h, want, "h");
                 }});
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back({"swiglu_backward", "N17 F93", dt, tol_of(dt, kElementChain), true, [](OpRun& r) {
                   Values g = OpRun::randn(17 * 93, 42, 3.0), u = OpRun::randn(17 * 93, 43),
                          dh = OpRun::randn(17 * 93, 44);
                   const Tensor tg = r.in(g, {17, 93}), tu = r.in(u, {17, 93}),
                                tdh = r.in(dh, {17, 93}), dg = r.out({17, 93}),
                                du = r.out({17, 93});
                   Values want_g(g.size()), want_u(g.size());
                   swiglu_backward_reference(g, u, dh, want_g, want_u);
                   r.be.swiglu_backward(tg, tu, tdh, dg, du);
                   r.check(dg, want_g, "dgate");
                   r.check(du, want_u, "dup");
                 }});
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back({"geglu_forward", "N17 F93", dt, tol_of(dt, kElementChain), true, [](OpRun& r) {
                   Values g = OpRun::randn(17 * 93, 140, 3.0), u = OpRun::randn(17 * 93, 141);
                   const Tensor tg = r.in(g, {17, 93}), tu = r.in(u, {17, 93}), h = r.out({17, 93});
                   Values want(g.size());
                   for (size_t i = 0; i < g.size(); ++i) want[i] = gelu_tanh_reference(g[i]) * u[i];
                   r.be.geglu_forward(tg, tu, h);
                   r.check(h, want, "h");
                 }});
  for (const DType dt : {DType::kF32, DType::kBF16})
    c.push_back({"geglu_backward", "N17 F93", dt, tol_of(dt, kElementChain), true, [](OpRun& r) {
                   Values g = OpRun::randn(17 * 93, 142, 3.0), u = OpRun::randn(17 * 93, 143),
                          dh = OpRun::randn(17 * 93, 144);
                   const Tensor tg = r.in(g, {17, 93}), tu = r.in(u, {17, 93}),
                                tdh = r.in(dh, {17, 93}), dg = r.out({17, 93}),
                                du = r.out({17, 93});
                   Values want_g(g.size()), want_u(g.size());
                   geglu_backward_reference(g, u, dh, want_g, want_u);
                   r.be.geglu_backward(tg, tu, tdh, dg, du);
                   r.check(dg, want_g, "dgate");
                   r.check(du, want_u, "dup");
                 }});
}

}  // namespace cases
}  // namespace shardlm::test::ops

#include "kernels/op_table_attention.h"
#include "kernels/op_table_packs.h"
#include "kernels/op_table_preference.h"
#include "kernels/op_table_xent_fold.h"
#include "shardlm/quant/nf4.h"

namespace shardlm::test::ops {

namespace cases {

// NF4 codes of seeded N(0, 1) values, each block scaled differently (one all zero), quantized on
// the host; the reference is code * absmax in f64 (exact), so the f32 result may differ only by
// its own rounding.
inline void nf4_cases(std::vector<OpCase>& c) {
  struct Shape2 {
    int64_t rows, cols, offset;  // offset 1: the output misaligned (the per-byte path)
  };
  for (const DType dt : {DType::kF32, DType::kBF16})
    for (const Shape2 s : {Shape2{48, 64, 0}, Shape2{48, 64, 1}, Shape2{7, 331, 0}})
      c.push_back({"nf4_dequantize", fmt::format("[{}, {}] offset {}", s.rows, s.cols, s.offset),
                   dt, tol_of(dt, 1), true, [s](OpRun& r) {
                     const int64_t n = s.rows * s.cols;
                     Values x = OpRun::randn(n, 70);
                     std::vector<float> xf(x.begin(), x.end());
                     for (int64_t i = 0; i < n; ++i)
                       xf[i] *= (i / nf4::kBlock == 3) ? 0.0f : float(1 + (i / nf4::kBlock) % 5);
                     // Sized from xf.size(), which GCC 12 knows is an object's size: from n it
                     // warns that the size may be negative (-Walloc-size-larger-than).
                     std::vector<uint8_t> codes(nf4::packed_bytes(int64_t(xf.size())));
                     std::vector<float> absmax(nf4::num_blocks(n));
                     nf4::quantize(xf.data(), n, codes.data(), absmax.data());
                     Values want(n);
                     for (int64_t i = 0; i < n; ++i) {
                       const uint8_t byte = codes[i / 2];
                       const int q = i % 2 == 0 ? byte >> 4 : byte & 0x0f;
                       want[i] = double(nf4::code()[q]) * double(absmax[i / nf4::kBlock]);
                     }
                     Values am(absmax.begin(), absmax.end());
                     const Tensor tc = r.bytes(codes),
                                  ta = r.in(am, {int64_t(am.size())}, DType::kF32);
                     const Tensor out = r.out_at(s.offset, {s.rows, s.cols});
                     r.be.nf4_dequantize(tc, ta, out);
                     r.check(out, want, "out");
                   }});
}

}  // namespace cases

inline std::vector<OpCase> op_cases() {
  std::vector<OpCase> c;
  cases::memory_cases(c);
  cases::nf4_cases(c);
  cases::linear_cases(c);
  cases::embedding_cases(c);
  cases::norm_cases(c);
  cases::rope_swiglu_cases(c);
  cases::attention_cases(c);
  cases::loss_cases(c);
  cases::xent_fold_cases(c);
  cases::packed_cases(c);
  cases::preference_cases(c);
  return c;
}

}  // namespace shardlm::test::ops
