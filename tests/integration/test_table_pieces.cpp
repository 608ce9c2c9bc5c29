// The vocabulary tables in pieces of rows (ParamStore::piece_rows, model/llama_head.cpp): a
// store that hands the embeddings and the LM head out in pieces gives the loss, every gradient,
// the evaluation loss and the last position's logits of the whole tables, to rounding (the
// sum of exponentials is folded piece by piece), in f32 and bf16 activations, with
// checkpointing and with tied embeddings (whose pieces take gradients at both ends); the model
// walks the pieces in the pass's order; a LoRA base offloaded to the host is handed out in
// pieces of a layer and trains as the base on the device does; a walk over the head's pieces
// and loss chunks reads its loss once.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "integration/grad_check_model.h"
#include "loss_reads.h"
#include "shardlm/backend/backend.h"
#include "shardlm/model/llama.h"
#include "tolerance.h"

namespace shardlm {
namespace {

constexpr int64_t kVocab = 300;  // the tables (4,800 elements) outgrow a layer (2,000)
constexpr int64_t kB = 2, kT = 12;

ModelConfig config(bool tie = false) {
  ModelConfig c = test::grad_check_config("pieces", tie, /*bias=*/true);
  c.vocab_size = kVocab;
  return c;
}

// Whole f32 arenas on the host, the tables handed out in pieces of `rows` rows; records the
// order in which pieces of the tables are acquired.
class PiecedStore final : public ParamStore {
 public:
  PiecedStore(const ParamLayout& layout, int64_t rows) {
    params_.resize(layout.total);
    grads_.assign(layout.total, 0.f);
    for (int u = 0; u < int(layout.units.size()); ++u) {
      rows_.push_back(unit_has_table(layout, u) ? rows : 0);
      pieces_.push_back(unit_pieces(layout, u, rows_.back()));
    }
  }
  std::vector<float>& params() { return params_; }
  const std::vector<float>& grads() const { return grads_; }
  std::vector<std::string> walk;  // "p<unit>.<piece>" / "g<unit>.<piece>", tables only

  void begin_pass(Pass) override {}
  void end_pass() override {}
  Tensor acquire_params(int u) override { return view(params_, u, whole(u)); }
  void release_params(int) override {}
  Tensor acquire_grads(int u) override { return view(grads_, u, whole(u)); }
  void release_grads(int) override {}
  int64_t piece_rows(int u) const override { return rows_[u]; }
  Tensor acquire_piece_params(int u, int k) override {
    walk.push_back(fmt::format("p{}.{}", u, k));
    return view(params_, u, k);
  }
  void release_piece_params(int, int) override {}
  Tensor acquire_piece_grads(int u, int k) override {
    walk.push_back(fmt::format("g{}.{}", u, k));
    return view(grads_, u, k);
  }
  void release_piece_grads(int, int) override {}

 private:
  int whole(int u) const {
    EXPECT_EQ(rows_[u], 0) << "unit " << u << " acquired whole but handed out in pieces";
    return 0;
  }
  Tensor view(std::vector<float>& arena, int u, int k) {
    const UnitPiece& p = pieces_[u][k];
    return Tensor(arena.data() + p.begin, DType::kF32, {p.end - p.begin}, MemPool::kHost);
  }
  std::vector<float> params_, grads_;
  std::vector<int64_t> rows_;
  std::vector<std::vector<UnitPiece>> pieces_;
};

struct Results {
  double loss = 0, eval_loss = 0;
  std::vector<float> grads, logits;
};

void fill(LlamaModel& model, int64_t B, uint64_t seed) {
  BatchInputs in = model.inputs(B, kT);
  test::fill_grad_batch(in, B, kT, kVocab, seed);
}

// forward_backward, forward_loss and forward_last_logits on one batch.
Results run(LlamaModel& model) {
  Results r;
  fill(model, kB, 7);
  r.loss = model.forward_backward(kB, kT, 0.1f).loss_sum;
  fill(model, kB, 8);
  r.eval_loss = model.forward_loss(kB, kT).loss_sum;
  fill(model, 1, 9);
  model.forward_last_logits(kT, r.logits);
  return r;
}

struct Variant {
  DType act;
  Checkpointing checkpointing;
  int64_t rows;
  const char* name;
  bool tie = false;  // the embeddings are the head: their pieces serve both ends
};

class TablePieces : public ::testing::TestWithParam<Variant> {};

TEST_P(TablePieces, GiveTheWholeTablesResultsToRounding) {
  const Variant& v = GetParam();
  const ModelConfig cfg = config(v.tie);
  auto be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger_whole, ledger_pieces;
  ModelOptions opt;
  opt.max_batch = kB;
  opt.max_seq = kT;
  opt.loss_chunk_tokens = 7;  // chunks that do not divide the 24 rows
  opt.activation_dtype = v.act;
  opt.checkpointing = v.checkpointing;

  LlamaModel whole(cfg, opt, *be, ledger_whole);
  test::set_grad_check_weights(whole, 3);
  whole.zero_grads();
  Results ref = run(whole);
  ref.grads.assign(whole.grads().f32(), whole.grads().f32() + whole.layout().total);

  const ParamLayout layout = make_param_layout(cfg);
  PiecedStore store(layout, v.rows);
  std::copy(whole.params().f32(), whole.params().f32() + layout.total, store.params().begin());
  LlamaModel pieced(cfg, opt, *be, ledger_pieces, {.store = &store});
  Results got = run(pieced);
  got.grads = store.grads();

  // Sums in another order (pieces of the tables' rows, the head's statistics folded piece by
  // piece), plus with bf16 activations the stores that round the other way (tests/tolerance.h).
  double tol = test::reorder_tolerance(test::reduction_chain(cfg, kT, kB));
  if (v.act == DType::kBF16)
    tol += test::bf16_mean_tolerance(test::bf16_stores_per_token(cfg), kB * kT);
  EXPECT_NEAR(got.loss, ref.loss, tol * std::abs(ref.loss));
  EXPECT_NEAR(got.eval_loss, ref.eval_loss, tol * std::abs(ref.eval_loss));
  float g_max = 0, l_max = 0;
  for (float g : ref.grads) g_max = std::max(g_max, std::abs(g));
  for (float l : ref.logits) l_max = std::max(l_max, std::abs(l));
  ASSERT_GT(g_max, 0.f);
  for (const ParamEntry& e : layout.entries)
    for (int64_t i = 0; i < e.shape.numel(); ++i)
      ASSERT_NEAR(got.grads[e.offset + i], ref.grads[e.offset + i], tol * g_max)
          << e.name << " element " << i;
  ASSERT_EQ(got.logits.size(), ref.logits.size());
  // The logits are the same dot products, piece by piece, in the BLAS kernel's order for the
  // piece's width (the edge tiles of a narrower call sum in another order); a bf16 logit may
  // then round to the neighbouring value, 2 u of it.
  EXPECT_GT(l_max, 0.f);
  const double logit_tol =
      tol + (v.act == DType::kBF16 ? 2 * test::unit_roundoff(DType::kBF16) : 0.0);
  for (size_t i = 0; i < ref.logits.size(); ++i)
    ASSERT_NEAR(got.logits[i], ref.logits[i], logit_tol * l_max) << "logit " << i;
}

INSTANTIATE_TEST_SUITE_P(
    Variants, TablePieces,
    ::testing::Values(Variant{DType::kF32, Checkpointing::kNone, 64, "f32"},
                      Variant{DType::kF32, Checkpointing::kFull, 299, "f32_full_two_pieces"},
                      Variant{DType::kF32, Checkpointing::kSelective, 1, "f32_one_row_a_piece"},
                      Variant{DType::kBF16, Checkpointing::kFull, 100, "bf16_full"},
                      Variant{DType::kF32, Checkpointing::kNone, 64, "f32_tied", true},
                      Variant{DType::kBF16, Checkpointing::kFull, 100, "bf16_full_tied", true}),
    [](const ::testing::TestParamInfo<Variant>& info) { return std::string(info.param.name); });

TEST(TablePieces, AreWalkedInThePassesOrder) {
  const ModelConfig cfg = config();
  auto be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  ModelOptions opt;
  opt.max_batch = kB;
  opt.max_seq = kT;
  const ParamLayout layout = make_param_layout(cfg);
  PiecedStore store(layout, 128);  // 300 rows: pieces of 128, 128, 44
  LlamaModel model(cfg, opt, *be, ledger, {.store = &store});
  fill(model, kB, 7);
  model.forward_backward(kB, kT, 1.f);
  const std::string h = std::to_string(layout.head_unit);
  const std::vector<std::string> expected = {
      // forward: the embedding's pieces, then the final norm (with the head's first rows)
      "p0.0", "p0.1", "p0.2", "p" + h + ".0",
      // backward: the statistics walk, then the gradient walk, both descending
      "p" + h + ".2", "p" + h + ".1", "p" + h + ".0",  //
      "p" + h + ".2", "g" + h + ".2", "p" + h + ".1", "g" + h + ".1", "p" + h + ".0",
      "g" + h + ".0",
      // the embedding's gradients, descending
      "g0.2", "g0.1", "g0.0"};
  EXPECT_EQ(store.walk, expected);
}

// The head's walks add every loss chunk's loss on the device and read it once: 3 pieces x 4
// chunks of finishes, the first piece's 4 adding to the accumulator, one read per pass (on a
// GPU one wait, where each finish used to be one).
TEST(TablePieces, ReadTheLossOncePerWalk) {
  const ModelConfig cfg = config();
  test::LossReads be;
  MemoryLedger ledger;
  ModelOptions opt;
  opt.max_batch = kB;
  opt.max_seq = kT;
  opt.loss_chunk_tokens = 7;  // 24 rows: chunks of 7, 7, 7, 3
  const ParamLayout layout = make_param_layout(cfg);
  PiecedStore store(layout, 128);  // 300 rows: pieces of 128, 128, 44
  {
    MemoryLedger whole_ledger;
    LlamaModel whole(cfg, opt, be, whole_ledger);
    test::set_grad_check_weights(whole, 3);
    std::copy(whole.params().f32(), whole.params().f32() + layout.total, store.params().begin());
  }
  LlamaModel model(cfg, opt, be, ledger, {.store = &store});
  fill(model, kB, 7);
  const LossResult loss = model.forward_backward(kB, kT, 0.1f);
  EXPECT_EQ(be.reads, 1);
  EXPECT_EQ(be.finishes, 3 * 4);
  EXPECT_EQ(be.counted, 4);
  EXPECT_EQ(loss.n_valid, kB * (kT - 2)) << "fill_grad_batch ignores positions 4 and 9";
  EXPECT_GT(loss.loss_sum, 0.0);
  be.reads = be.finishes = be.counted = 0;
  fill(model, kB, 8);
  model.forward_loss(kB, kT);  // the loss from the statistics walk: one finish per chunk
  EXPECT_EQ(be.reads, 1);
  EXPECT_EQ(be.finishes, 4);
  EXPECT_EQ(be.counted, 4);
}

// LoRA over a frozen base in host memory: the base's tables (larger than a layer) are staged
// through the two layer-sized device slots in pieces, and the adapters train as over a base on
// the device.
TEST(TablePieces, AnOffloadedLoraBaseTrainsAsOnTheDevice) {
  const ModelConfig cfg = config();
  auto be = make_backend(DeviceKind::kCpu);
  ModelOptions opt;
  opt.max_batch = kB;
  opt.max_seq = kT;
  opt.lora.rank = 4;
  opt.lora.alpha = 8;
  opt.lora.targets = lora_targets_from_string("all");
  std::vector<std::vector<float>> grads;
  std::vector<double> losses;
  for (bool offload : {false, true}) {
    opt.lora.offload_base = offload;
    MemoryLedger ledger;
    LlamaModel model(cfg, opt, *be, ledger);
    model.init_weights(5);
    const int64_t n = model.lora_layout().params.total;
    for (int64_t i = 0; i < n; ++i) model.lora_params().f32()[i] = 0.01f * float(i % 17 - 8);
    be->zero(model.lora_grads());
    fill(model, kB, 7);
    losses.push_back(model.forward_backward(kB, kT, 0.1f).loss_sum);
    grads.emplace_back(model.lora_grads().f32(), model.lora_grads().f32() + n);
    if (offload) {  // two slots of a layer, not of the 4,800-element tables
      const ParamLayout L = make_param_layout(cfg);
      EXPECT_EQ(offloaded_base_slot_elems(L, /*split_tables=*/true), L.max_layer);
      // the base's two slots, the f32 adapters and the rotary table
      EXPECT_EQ(ledger.peak(MemPool::kDevice, MemCategory::kParams),
                int64_t((2 * L.max_layer + n) * 4 + cfg.head_dim() / 2 * 4));
    }
  }
  // The offloaded base's layers are the same arithmetic; its tables are summed piece by piece.
  const double tol = test::reorder_tolerance(test::reduction_chain(cfg, kT, kB));
  EXPECT_NEAR(losses[1], losses[0], tol * std::abs(losses[0]));
  float g_max = 0;
  for (float g : grads[0]) g_max = std::max(g_max, std::abs(g));
  ASSERT_GT(g_max, 0.f);
  for (size_t i = 0; i < grads[0].size(); ++i)
    ASSERT_NEAR(grads[1][i], grads[0][i], tol * g_max) << "adapter gradient " << i;
}

}  // namespace
}  // namespace shardlm
