// The Backend entry points (src/backend/contracts/) of attention, its merge, dropout and the
// vocabulary-sliced losses: dtypes, shapes, seg_start, sliding windows and soft caps are checked
// before the backend's implementation runs, and a good call reaches it unchanged (the other ops:
// test_backend_contracts.cpp).
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

// dropout's x and out, attention_merge's out and out_b and the slice losses' logits are f32 or
// bf16, one dtype between the tensors that must agree; lse, row_max and stats stay f32.
TEST(BackendContracts, DropoutMergeAndSliceLossTakeBf16OfOneDtype) {
  RecordingBackend be;
  Arena a;
  expect_rejected(
      be, [&] { be.dropout(a.f32({4}), a.bf16({4}), 0.5f, 1, 0); },
      "dropout: out is bf16 but x is f32; one dtype per op");
  expect_rejected(
      be, [&] { be.dropout(a.i32({4}), a.i32({4}), 0.5f, 1, 0); },
      "dropout: x must be f32 or bf16, got i32");
  expect_rejected(
      be,
      [&] {
        be.attention_merge(a.bf16({8, 4, 8}), a.f32({1, 4, 8}), a.f32({8, 4, 8}), a.f32({1, 4, 8}));
      },
      "attention_merge: out_b (out's shape) is f32 but out is bf16; one dtype per op");
  expect_rejected(
      be,
      [&] {
        be.attention_merge(a.bf16({8, 4, 8}), a.bf16({1, 4, 8}), a.bf16({8, 4, 8}),
                           a.f32({1, 4, 8}));
      },
      "attention_merge: lse [B, Hq, T] must be f32, got bf16");
  expect_rejected(
      be,
      [&] {
        be.xent_slice_max(a.bf16({3, 4}), a.bf16({3}));
      },
      "xent_slice_max: row_max must be f32, got bf16");
  be.ran.clear();
  be.attention_merge(a.bf16({8, 4, 8}), a.f32({1, 4, 8}), a.bf16({8, 4, 8}), a.f32({1, 4, 8}));
  be.xent_slice_max(a.bf16({3, 4}), a.f32({3}));
  be.xent_slice_stats(a.bf16({3, 4}), a.i32({3}), 0, 4, a.f32({3}), a.f32({3, 2}));
  be.xent_slice_fold(a.bf16({3, 4}), a.i32({3}), 0, 4, a.f32({3}), a.f32({3, 2}), true);
  be.xent_slice_finish(a.bf16({3, 4}), a.i32({3}), 0, a.f32({3}), a.f32({3, 2}), 1.f, true,
                       a.f64({2}), Workspace{});
  be.xent_slice_finish(a.bf16({3, 4}), a.i32({3}), 0, a.f32({3}), a.f32({3, 2}), 1.f, true,
                       Tensor(), Workspace{});  // no accumulator: a slice counted elsewhere
  be.read_loss(a.f64({2}));
  EXPECT_EQ(be.ran, (std::vector<std::string>{
                        "attention_merge", "xent_slice_max", "xent_slice_stats", "xent_slice_fold",
                        "xent_slice_finish", "xent_slice_finish", "read_loss"}));
  cpu::CpuBackend cpu;  // the recording backend has no dropout kernel; the CPU's takes bf16
  const Tensor x = a.bf16({4});
  cpu.dropout(x, x, 0.5f, 1, 0);
}

// xent_slice_fold takes xent_slice_stats's shapes: logits [n, Vs] inside the vocabulary,
// targets [n] i32, row_max [n] f32, stats [n, 2] f32; a good call reaches the backend unchanged.
TEST(BackendContracts, SliceFoldChecksItsStatisticsAndItsSlice) {
  RecordingBackend be;
  Arena a;
  const Tensor logits = a.f32({3, 4}), targets = a.i32({3}), row_max = a.f32({3}),
               stats = a.f32({3, 2});
  expect_rejected(
      be,
      [&] {
        be.xent_slice_fold(logits, targets, 0, 4, row_max, a.f32({3, 3}), false);
      },
      "xent_slice_fold: stats must be [3, 2], got [3, 3]");
  expect_rejected(
      be,
      [&] {
        be.xent_slice_fold(logits, targets, 0, 4, row_max, a.bf16({3, 2}), false);
      },
      "xent_slice_fold: stats must be f32, got bf16");
  expect_rejected(
      be, [&] { be.xent_slice_fold(logits, targets, 0, 4, a.f32({4}), stats, true); },
      "xent_slice_fold: row_max must be [3] like the logits' rows, got [4]");
  expect_rejected(
      be, [&] { be.xent_slice_fold(logits, a.i32({2}), 0, 4, row_max, stats, true); },
      "xent_slice_fold: targets must be [3], got [2]");
  expect_rejected(
      be, [&] { be.xent_slice_fold(logits, a.f32({3}), 0, 4, row_max, stats, true); },
      "xent_slice_fold: targets must be i32, got f32");
  expect_rejected(
      be, [&] { be.xent_slice_fold(a.f32({12}), targets, 0, 12, row_max, stats, true); },
      "xent_slice_fold: logits must have rank 2");
  expect_rejected(
      be, [&] { be.xent_slice_fold(logits, targets, 3, 6, row_max, stats, false); },
      "xent_slice_fold: the slice [3, 7) is not inside the vocabulary [0, 6)");
  expect_rejected(
      be, [&] { be.xent_slice_fold(logits, targets, -1, 6, row_max, stats, false); },
      "xent_slice_fold: the slice [-1, 3) is not inside the vocabulary [0, 6)");
  be.ran.clear();
  be.xent_slice_fold(logits, targets, 2, 6, row_max, stats, false);
  EXPECT_EQ(be.ran, std::vector<std::string>{"xent_slice_fold"});
}

// xent_slice_finish's loss_acc, when given, and read_loss's are [2] f64: the loss sum and the
// count a walk's finishes add to.
TEST(BackendContracts, TheLossAccumulatorIsTwoF64) {
  RecordingBackend be;
  Arena a;
  const Tensor logits = a.f32({3, 4}), targets = a.i32({3}), row_max = a.f32({3}),
               stats = a.f32({3, 2});
  auto finish = [&](const Tensor& acc) {
    be.xent_slice_finish(logits, targets, 0, row_max, stats, 1.f, false, acc, Workspace{});
  };
  expect_rejected(
      be, [&] { finish(a.f32({2})); }, "xent_slice_finish: loss_acc must be f64, got f32");
  expect_rejected(
      be, [&] { finish(a.f64({3})); },
      "xent_slice_finish: loss_acc must be [2] (the loss sum and the count), got [3]");
  expect_rejected(
      be,
      [&] {
        finish(a.f64({1, 2}));
      },
      "xent_slice_finish: loss_acc must have rank 1");
  expect_rejected(
      be, [&] { be.read_loss(Tensor()); }, "read_loss: loss_acc must be f64");
  expect_rejected(
      be, [&] { be.read_loss(a.f64({4})); },
      "read_loss: loss_acc must be [2] (the loss sum and the count), got [4]");
  be.ran.clear();
  finish(a.f64({2}));
  be.read_loss(a.f64({2}));
  EXPECT_EQ(be.ran, (std::vector<std::string>{"xent_slice_finish", "read_loss"}));
}

// seg_start may be empty (one document per row) but, when given, must be [B, Tq] i32.
TEST(BackendContracts, AttentionTakesAnEmptySegStart) {
  RecordingBackend be;
  be.workspace = 64;
  Arena a;
  const Tensor q = a.f32({1, 8, 4, 8}), kv = a.f32({1, 8, 2, 8});
  const Tensor out = a.f32({1, 8, 4, 8}), lse = a.f32({1, 4, 8});
  std::vector<std::byte> ws(64);
  be.attention_forward(q, kv, kv, Tensor(), out, lse, Workspace{ws.data(), ws.size()});
  EXPECT_EQ(be.ran, std::vector<std::string>{"attention_forward"});
  expect_rejected(
      be,
      [&] {
        be.attention_forward(q, kv, kv, a.i32({1, 7}), out, lse, Workspace{ws.data(), ws.size()});
      },
      "attention_forward: seg_start is [1, 7] but must be [B, Tq] = [1, 8]");
}

// A sliding window is 0 (none) or a positive key count, on every attention op, checked before
// the backend runs.
TEST(BackendContracts, AttentionWindowIsNonNegative) {
  RecordingBackend be;
  be.workspace = 64;
  Arena a;
  const Tensor q = a.f32({1, 8, 4, 8}), kv = a.f32({1, 8, 2, 8});
  const Tensor out = a.f32({1, 8, 4, 8}), lse = a.f32({1, 4, 8});
  std::vector<std::byte> ws(64);
  const Workspace w{ws.data(), ws.size()};
  expect_rejected(
      be, [&] { be.attention_forward(q, kv, kv, Tensor(), out, lse, w, {}, -1); },
      "attention_forward: window = -1 must be 0 (no sliding window) or a positive key count");
  expect_rejected(
      be,
      [&] {
        be.attention_block_backward(q, kv, kv, Tensor(), 8, 0, out, lse, out, out, kv, kv, w, -3);
      },
      "attention_block_backward: window = -3 must be 0");
  be.ran.clear();
  be.attention_forward(q, kv, kv, Tensor(), out, lse, w, {}, 5);
  EXPECT_EQ(be.ran, std::vector<std::string>{"attention_forward"});
}

// A soft cap is 0 (none) or a positive finite cap, on the attention ops and the losses, checked
// before the backend runs.
TEST(BackendContracts, SoftcapIsNonNegativeAndFinite) {
  RecordingBackend be;
  be.workspace = 64;
  Arena a;
  const Tensor q = a.f32({1, 8, 4, 8}), kv = a.f32({1, 8, 2, 8});
  const Tensor out = a.f32({1, 8, 4, 8}), lse = a.f32({1, 4, 8});
  std::vector<std::byte> ws(64);
  const Workspace w{ws.data(), ws.size()};
  expect_rejected(
      be, [&] { be.attention_forward(q, kv, kv, Tensor(), out, lse, w, {}, 0, -1.f); },
      "attention_forward: softcap = -1 must be 0 (no soft-capping) or a positive finite cap");
  expect_rejected(
      be, [&] { be.attention_decode(q, kv, kv, 0, out, w, INFINITY); },
      "attention_decode: softcap = inf must be 0");
  const Tensor logits = a.f32({3, 5}), row_max = a.f32({3});
  expect_rejected(
      be, [&] { be.xent_slice_max(logits, row_max, -2.f); },
      "xent_slice_max: softcap = -2 must be 0 (no soft-capping) or a positive finite cap on the "
      "logits");
  be.ran.clear();
  be.attention_forward(q, kv, kv, Tensor(), out, lse, w, {}, 0, 50.f);
  be.xent_slice_max(logits, row_max, 30.f);
  EXPECT_EQ(be.ran, (std::vector<std::string>{"attention_forward", "xent_slice_max"}));
}

// The CPU backend has only its own attention kernels.
TEST(BackendContracts, AttentionImplementationChoiceOnTheCpu) {
  cpu::CpuBackend be;
  EXPECT_EQ(be.select_attention("auto"), "own kernels");
  EXPECT_EQ(be.select_attention("own"), "own kernels");
  test::expect_config_error([&] { be.select_attention("cudnn"); },
                            {"train.attention", "cudnn", "train.device = \"cuda\""});
}

}  // namespace
}  // namespace shardlm
