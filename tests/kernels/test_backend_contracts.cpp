// The Backend entry points (src/backend/contracts/): a bad argument is rejected before the
// backend's implementation runs, and a good one reaches it unchanged. RecordingBackend
// (recording_backend.h) only records which do_<op> ran, so what is tested is the entry point
// alone, for any backend. Attention, dropout and the sliced losses:
// test_backend_contracts_attention.cpp.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/recording_backend.h"
#include "shardlm/backend/backend.h"
#include "test_util.h"

namespace shardlm {
namespace {

using test::Arena;
using test::expect_rejected;
using test::RecordingBackend;

TEST(BackendContracts, MismatchedLinearShapesNeverReachTheBackend) {
  RecordingBackend be;
  Arena a;
  const Tensor x = a.f32({6, 4}), w = a.f32({3, 4}), y = a.f32({6, 3});
  expect_rejected(
      be,
      [&] {
        be.linear_forward(x, a.f32({3, 5}), Tensor(), y);
      },
      "linear_forward: x is [N, in] = [6, 4] but w is [out, in] = [3, 5]");
  expect_rejected(
      be,
      [&] {
        be.linear_forward(x, w, Tensor(), a.f32({6, 2}));
      },
      "linear_forward: y is [6, 2], expected [6, 3]");
  expect_rejected(
      be, [&] { be.linear_forward(x, w, a.f32({2}), y); }, "linear_forward: b is [2]");
  expect_rejected(
      be,
      [&] {
        be.linear_backward(x, w, y, Tensor(), a.f32({4, 3}), Tensor());
      },
      "linear_backward: dw [4, 3] and w [3, 4] must have the same shape");
  // An accumulated output must exist and must not be read as an operand while it is summed.
  constexpr OutputMode kAcc = OutputMode::kAccumulate;
  expect_rejected(
      be, [&] { be.linear_backward(x, w, y, Tensor(), Tensor(), Tensor(), kAcc); },
      "linear_backward: dx is accumulated (OutputMode::kAccumulate) but empty");
  const Tensor xy = a.f32({6, 4});                               // x, and in its memory:
  const Tensor prefix = xy.view({24}).rows(0, 18).view({6, 3});  // a [6, 3] y or dy
  expect_rejected(
      be,
      [&] {
        be.linear_forward(xy, a.f32({3, 4}), Tensor(), prefix, kAcc);
      },
      "linear_forward: y [6, 3] shares memory with x [6, 4]");
  expect_rejected(
      be, [&] { be.linear_backward(x, w, prefix, xy, Tensor(), Tensor(), kAcc); },
      "linear_backward: dx [6, 4] shares memory with dy [6, 3]");
  be.ran.clear();
  be.linear_forward(x, w, a.f32({3}), y);
  be.linear_backward(x, w, y, a.f32({6, 4}), a.f32({3, 4}), a.f32({3}));
  be.linear_forward(x, w, a.f32({3}), y, kAcc);
  be.linear_backward(x, w, y, a.f32({6, 4}), Tensor(), Tensor(), kAcc);
  EXPECT_EQ(be.ran, (std::vector<std::string>{"linear_forward", "linear_backward", "linear_forward",
                                              "linear_backward"}));
}

// The residual form of linear_forward: a residual of y's shape, either y itself (handed on as
// kAccumulate) or apart from y, x and w (handed on as it is), never with kAccumulate.
TEST(BackendContracts, LinearResidualIsYItselfOrApartFromEveryOperand) {
  RecordingBackend be;
  Arena a;
  const Tensor x = a.f32({6, 4}), w = a.f32({3, 4}), y = a.f32({6, 3}), res = a.f32({6, 3});
  constexpr OutputMode kAcc = OutputMode::kAccumulate, kOver = OutputMode::kOverwrite;
  expect_rejected(
      be, [&] { be.linear_forward(x, w, Tensor(), y, kAcc, res); },
      "linear_forward: a residual and OutputMode::kAccumulate together");
  expect_rejected(
      be,
      [&] {
        be.linear_forward(x, w, Tensor(), y, kOver, a.f32({6, 2}));
      },
      "linear_forward: residual is [6, 2], expected [6, 3]");
  expect_rejected(
      be,
      [&] {
        be.linear_forward(x, w, Tensor(), y, kOver, a.bf16({6, 3}));
      },
      "linear_forward: residual is bf16 but x is f32");
  const Tensor wide = a.f32({7, 3});  // y and, one row on, an overlapping residual
  expect_rejected(
      be, [&] { be.linear_forward(x, w, Tensor(), wide.rows(0, 6), kOver, wide.rows(1, 6)); },
      "linear_forward: y [6, 3] shares memory with residual [6, 3]");
  const Tensor xr = a.f32({6, 4});  // x, and in its memory a [6, 3] residual
  expect_rejected(
      be,
      [&] {
        be.linear_forward(xr, w, Tensor(), y, kOver, xr.view({24}).rows(0, 18).view({6, 3}));
      },
      "linear_forward: residual [6, 3] shares memory with x [6, 4]");

  be.ran.clear();
  be.linear_forward(x, w, Tensor(), y, kOver, res);
  EXPECT_EQ(be.linear_forward_mode, kOver);
  EXPECT_EQ(be.linear_forward_residual.data(), res.data());
  be.linear_forward(x, w, a.f32({3}), y, kOver, y);  // y = y + x W^T + b: accumulates
  EXPECT_EQ(be.linear_forward_mode, kAcc);
  EXPECT_TRUE(be.linear_forward_residual.empty());
  EXPECT_EQ(be.ran, (std::vector<std::string>{"linear_forward", "linear_forward"}));
}

TEST(BackendContracts, DtypesAreCheckedOncePerOpAndBf16IsAdmitted) {
  RecordingBackend be;
  Arena a;
  expect_rejected(
      be, [&] { be.add(a.f32({5}), a.bf16({5}), a.f32({5})); },
      "add: b is bf16 but a is f32; one dtype per op");
  expect_rejected(
      be, [&] { be.scale(a.i32({5}), 2.f); }, "scale: x must be f32 or bf16, got i32");
  expect_rejected(
      be,
      [&] {
        be.rmsnorm_forward(a.f32({2, 4}), a.f32({4}), 1e-5f, a.f32({2, 4}), a.i32({2}));
      },
      "rmsnorm_forward: rstd must be f32, got i32");
  // The contract admits bf16 activations (the CUDA backend computes on them) ...
  be.ran.clear();
  be.linear_forward(a.bf16({6, 4}), a.bf16({3, 4}), Tensor(), a.bf16({6, 3}));
  EXPECT_EQ(be.ran, std::vector<std::string>{"linear_forward"});
  // ... and so does the CPU backend's linear (in f32: 4 products of 1 and 0.5 make exactly 2).
  cpu::CpuBackend cpu;
  const Tensor x = a.bf16({6, 4}), w = a.bf16({3, 4}), y = a.bf16({6, 3});
  std::fill(x.bf16(), x.bf16() + x.numel(), f32_to_bf16(1.0f));
  std::fill(w.bf16(), w.bf16() + w.numel(), f32_to_bf16(0.5f));
  cpu.linear_forward(x, w, Tensor(), y);
  EXPECT_EQ(std::vector<uint16_t>(y.bf16(), y.bf16() + y.numel()),
            std::vector<uint16_t>(y.numel(), f32_to_bf16(2.0f)));
}

TEST(BackendContracts, CopyBlocksStaysInsideItsTensorsAndNeverOverlapsItsOutput) {
  RecordingBackend be;
  Arena a;
  const Tensor src = a.f32({24}), dst = a.f32({24});
  // [2, 3, 4] -> [3, 2, 4]: a transpose of 4-element blocks, every dst element written once.
  const BlockCopy swap{{1, 2, 3}, 4, {0, 12, 4}, {0, 4, 8}};
  expect_rejected(
      be, [&] { be.copy_blocks(src, a.bf16({24}), swap); },
      "copy_blocks: src is f32 but dst is bf16");
  expect_rejected(
      be, [&] { be.copy_blocks(src, a.f32({23}), swap); },
      "copy_blocks: the blocks reach element 24 of src [24] and 24 of dst [23]");
  expect_rejected(
      be,
      [&] {
        be.copy_blocks(src, dst, {{1, 2, 3}, 4, {0, 12, 4}, {0, 4, 4}});
      },
      "copy_blocks: dst stride 2 (4) is below the 8 elements inside it");
  expect_rejected(
      be,
      [&] {
        be.copy_blocks(src, dst, {{1, 2, 3}, 4, {0, 12, -4}, {0, 4, 8}});
      },
      "copy_blocks: src stride 2 is -4");
  expect_rejected(
      be, [&] { be.copy_blocks(src, src.view({24}), swap); },
      "copy_blocks: src and dst share memory");
  be.ran.clear();
  be.copy_blocks(src, dst, swap);
  be.copy_blocks(src, dst, {{1, 2, 3}, 4, {0, 0, 4}, {0, 4, 8}});  // src blocks read twice
  EXPECT_EQ(be.ran, (std::vector<std::string>{"copy_blocks", "copy_blocks"}));
}

TEST(BackendContracts, WorkspaceIsCheckedAgainstTheBackendsQuery) {
  RecordingBackend be;
  be.workspace = 4096;
  Arena a;
  const Tensor q = a.f32({1, 8, 4, 8}), kv = a.f32({1, 8, 2, 8}), seg = a.i32({1, 8});
  const Tensor out = a.f32({1, 8, 4, 8}), lse = a.f32({1, 4, 8});
  std::vector<std::byte> ws(4096);
  expect_rejected(
      be,
      [&] {
        be.attention_forward(q, kv, kv, seg, out, lse, Workspace{ws.data(), 4095});
      },
      "attention_forward: workspace has 4095 bytes, needs 4096; size it with "
      "attention_workspace_bytes()");
  expect_rejected(
      be,
      [&] {
        be.attention_forward(q, kv, kv, seg, out, lse, Workspace{nullptr, 4096});
      },
      "attention_forward: workspace has 4096 bytes, needs 4096");
  expect_rejected(
      be,
      [&] {
        be.lm_head_loss(a.f32({3, 4}), a.f32({5, 4}), a.i32({3}), 2, 1.f, Tensor(), Tensor(),
                        Workspace{ws.data(), 100});
      },
      "lm_head_loss: workspace has 100 bytes, needs 4096");
  be.ran.clear();
  be.attention_forward(q, kv, kv, seg, out, lse, Workspace{ws.data(), ws.size()});
  EXPECT_EQ(be.ran, std::vector<std::string>{"attention_forward"});
}

TEST(BackendContracts, EveryFamilyRejectsBeforeRunning) {
  RecordingBackend be;
  be.workspace = 64;
  Arena a;
  std::vector<std::byte> ws(64);
  const Workspace w64{ws.data(), ws.size()};
  expect_rejected(
      be, [&] { be.copy(a.f32({12}), a.f32({11})); },
      "copy: src [12] and dst [11] differ in element count");
  expect_rejected(
      be,
      [&] {
        float* p = a.f32({10}).f32();
        be.copy(Tensor(p, DType::kF32, {8}, MemPool::kHost),
                Tensor(p + 2, DType::kF32, {8}, MemPool::kHost));
      },
      "copy: src and dst overlap partially");
  expect_rejected(
      be, [&] { be.convert(a.f32({4}), a.i32({4})); },
      "convert: f32 -> i32 is not supported; only f32 <-> bf16");
  expect_rejected(
      be, [&] { be.dropout(a.f32({4}), a.f32({4}), 1.f, 1, 0); },
      "dropout: p = 1 must be in [0, 1)");
  expect_rejected(
      be,
      [&] {
        be.swiglu_forward(a.f32({3, 4}), a.f32({4, 3}), a.f32({3, 4}));
      },
      "swiglu_forward: up [4, 3] and gate [3, 4] must have the same shape");
  expect_rejected(
      be,
      [&] {
        be.embedding_forward_slice(a.i32({2}), a.f32({3, 2}), 7, 9, a.f32({2, 2}));
      },
      "embedding_forward: the slice [7, 10) of table [3, 2] is not inside the vocabulary");
  expect_rejected(
      be,
      [&] {
        be.rope_forward(a.f32({2, 3, 5}), a.i32({2}), a.f32({2}));
      },
      "rope_forward: x is [N, H, Dh] = [2, 3, 5]; Dh must be even");
  expect_rejected(
      be,
      [&] {
        be.attention_decode(a.f32({1, 4, 2, 8}), a.f32({1, 12, 1, 8}), a.f32({1, 12, 1, 8}), 9,
                            a.f32({1, 4, 2, 8}), w64);
      },
      "attention_decode: queries at positions [9, 13) do not fit a cache of Tmax = 12");
  expect_rejected(
      be,
      [&] {
        be.attention_merge(a.f32({1, 8, 4, 8}), a.f32({1, 4, 8}), a.f32({8, 4, 8}),
                           a.f32({1, 4, 8}));
      },
      "attention_merge: out_b (out's shape) must have rank 4");
  expect_rejected(
      be,
      [&] {
        be.xent_slice_max(a.f32({3, 4}), a.f32({2}));
      },
      "xent_slice_max: row_max must be [3] like the logits' rows, got [2]");
  expect_rejected(
      be, [&] { be.nf4_dequantize(a.u8({64}), a.f32({2}), a.f32({130})); },
      "nf4_dequantize: codes [64] must hold ceil(n / 2) = 65 bytes for out [130]");
  expect_rejected(
      be, [&] { be.nf4_dequantize(a.u8({65}), a.f32({2}), a.f32({130})); },
      "nf4_dequantize: absmax [2] must hold ceil(n / 64) = 3 values for out [130]");
  expect_rejected(
      be, [&] { be.nf4_dequantize(a.i32({65}), a.f32({3}), a.f32({130})); },
      "nf4_dequantize: codes must be u8, got i32");
  AdamWHyper step0;
  step0.step = 0;
  expect_rejected(
      be, [&] { be.adamw_step(a.f32({4}), a.f32({4}), a.f32({4}), a.f32({4}), step0); },
      "adamw_step step is 1-based, got 0");
}

TEST(BackendContracts, PreferenceOpsCheckTheirTablesAndTheLoss) {
  RecordingBackend be;
  Arena a;
  using Kind = PreferenceLossSpec::Kind;
  const PreferenceLossSpec dpo{Kind::kDpoSigmoid, 0.1, 0, 0}, simpo{Kind::kSimpo, 2.0, 0, 0.5};
  expect_rejected(
      be,
      [&] {
        be.segment_logp_sums(a.f32({6}), a.f32({6, 2}), a.i32({5}), a.f64({3, 2}));
      },
      "segment_logp_sums: segments must be [6] like row_max, got [5]");
  expect_rejected(
      be,
      [&] {
        be.segment_logp_sums(a.f32({6}), a.f32({6, 2}), a.i32({6}), a.f32({3, 2}));
      },
      "segment_logp_sums: sums must be f64, got f32");
  expect_rejected(
      be,
      [&] {
        be.segment_logp_sums(a.f32({6}), a.f32({6, 3}), a.i32({6}), a.f64({3, 2}));
      },
      "segment_logp_sums: stats must be [6, 2], got [6, 3]");
  expect_rejected(
      be,
      [&] {
        be.preference_coefficients(dpo, a.f64({4, 2}), Tensor(), 0.5, a.f32({4}), a.f64({7}));
      },
      "a DPO loss needs the reference's sums; reference is empty");
  expect_rejected(
      be,
      [&] {
        be.preference_coefficients(simpo, a.f64({3, 2}), Tensor(), 0.5, a.f32({3}), a.f64({7}));
      },
      "policy must be [2P, 2] (a chosen and a rejected sequence per pair), got [3, 2]");
  expect_rejected(
      be,
      [&] {
        be.preference_coefficients(dpo, a.f64({4, 2}), a.f64({2, 2}), 0.5, a.f32({4}), a.f64({7}));
      },
      "reference [2, 2] must be empty or [4, 2] like policy");
  expect_rejected(
      be,
      [&] {
        be.preference_coefficients(simpo, a.f64({4, 2}), Tensor(), 0.5, a.f32({4}), a.f64({6}));
      },
      "metrics must be [7], got [6]");
  expect_rejected(
      be,
      [&] {
        be.preference_coefficients({Kind::kDpoIpo, 0.0, 0, 0}, a.f64({4, 2}), a.f64({4, 2}), 0.5,
                                   a.f32({4}), a.f64({7}));
      },
      "beta = 0 must be finite and > 0");
  expect_rejected(
      be, [&] { be.gather_segment_weights(a.f32({3}), a.i32({4}), a.f32({5})); },
      "gather_segment_weights: segments must be [5] like weights, got [4]");
  // Accepted: SimPO without a reference, and DPO on a micro-batch without pairs.
  be.ran.clear();
  be.preference_coefficients(simpo, a.f64({4, 2}), Tensor(), 0.5, a.f32({4}), a.f64({7}));
  be.preference_coefficients(dpo, a.f64({0, 2}), Tensor(), 0.5, a.f32({0}), a.f64({7}));
  EXPECT_EQ(be.ran.size(), 2u);
}

TEST(BackendContracts, TwoTensorRopeNeedsOneDtypeOneDhAndSeparateMemory) {
  RecordingBackend be;
  Arena a;
  const Tensor pos = a.i32({2}), inv = a.f32({4});
  expect_rejected(
      be,
      [&] {
        be.rope_qk_forward(a.f32({2, 3, 8}), a.bf16({2, 1, 8}), pos, inv);
      },
      "rope_qk_forward: k is bf16 but q is f32; one dtype per op");
  expect_rejected(
      be,
      [&] {
        be.rope_qk_backward(a.f32({2, 3, 8}), a.f32({2, 1, 6}), pos, inv);
      },
      "rope_qk_backward: inv_freq is [4], expected [R/2] for the R rotated dims, 2 <= R <= "
      "Dh = 6");
  expect_rejected(
      be,
      [&] {
        be.rope_qk_forward(a.f32({2, 3, 8}), a.f32({3, 1, 8}), pos, inv);
      },
      "rope_qk_forward: positions is [2] but k is [N, H, Dh] = [3, 1, 8]");
  const Tensor qk = a.f32({2, 4, 8});  // k inside q's memory: two rotations of one element
  const Tensor k_in_q(qk.f32() + 8, DType::kF32, {2, 1, 8}, qk.pool());
  expect_rejected(
      be, [&] { be.rope_qk_forward(qk, k_in_q, pos, inv); },
      "rope_qk_forward: q [2, 4, 8] and k [2, 1, 8] share memory");
  be.ran.clear();
  be.rope_qk_forward(a.f32({2, 3, 8}), a.f32({2, 1, 8}), pos, inv);  // GQA: Hk < Hq
  EXPECT_EQ(be.ran, std::vector<std::string>{"rope_qk_forward"});
}

TEST(BackendContracts, AdamWSegmentsAreCheckedOneByOneAndWriteDisjointMemory) {
  RecordingBackend be;
  Arena a;
  AdamWHyper h;
  auto segment = [&](int64_t n) {
    return AdamWSegment{a.f32({n}), a.f32({n}), a.f32({n}), a.f32({n}), 0.1f};
  };
  std::vector<AdamWSegment> list = {segment(4), segment(3)};
  list[1].v = a.f32({2});
  expect_rejected(
      be, [&] { be.adamw_step_segments(list, h); },
      "adamw_step_segments needs segments[1].param, grad, m, v of equal size, got 3, 3, 3, 2");
  list[1] = segment(3);
  list[1].grad = a.bf16({3});
  expect_rejected(
      be, [&] { be.adamw_step_segments(list, h); },
      "adamw_step_segments: segments[1].grad must be f32, got bf16");
  list[1] = segment(3);
  list[1].m = list[0].param.rows(1, 3);  // segment 1's m is segment 0's param
  expect_rejected(
      be, [&] { be.adamw_step_segments(list, h); },
      "adamw_step_segments: segments 0 and 1 write the same memory");
  list[1] = segment(3);
  AdamWHyper step0;
  step0.step = 0;
  expect_rejected(
      be, [&] { be.adamw_step_segments(list, step0); },
      "adamw_step_segments step is 1-based, got 0");
  be.ran.clear();
  be.adamw_step_segments(list, h);
  be.adamw_step_segments({}, h);  // nothing to step
  EXPECT_EQ(be.ran, (std::vector<std::string>{"adamw_step_segments", "adamw_step_segments"}));
}

}  // namespace
}  // namespace shardlm
