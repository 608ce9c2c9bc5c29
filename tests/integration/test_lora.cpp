// LoRA in the model: the adapters' analytic gradients against central finite differences of
// the loss (every target, with and without dropout, tied and untied heads, attention bias);
// a frozen base holds no gradient bytes; merged weights (W + alpha/r B A) give the logits of
// base + adapters; checkpointing modes give bitwise the same adapter gradients with dropout; the
// scratch holds no target-sized term without dropout (the update's GEMMs accumulate).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "integration/grad_check_model.h"
#include "shardlm/backend/backend.h"
#include "shardlm/model/llama.h"
#include "test_util.h"
#include "tolerance.h"

namespace shardlm {
namespace {

LoraConfig lora_config(double dropout, const std::string& targets = "all") {
  LoraConfig l;
  l.rank = 3;
  l.alpha = 6;
  l.dropout = dropout;
  l.targets = lora_targets_from_string(targets);
  return l;
}

// Base weights larger than the training init, adapters random (B too, so that A's gradient is
// not zero): every path carries signal.
void set_weights(LlamaModel& model, uint64_t seed) {
  test::set_grad_check_weights(model, seed);
  const std::vector<float> a =
      test::random_vec(model.lora_layout().params.total, seed + 1, -0.4f, 0.4f);
  std::copy(a.begin(), a.end(), model.lora_params().f32());
}

// (tied, bias, dropout)
class LoraGradTest : public ::testing::TestWithParam<std::tuple<bool, bool, double>> {};

TEST_P(LoraGradTest, AdaptersMatchFiniteDifferences) {
  const auto [tie, bias, dropout] = GetParam();
  const ModelConfig cfg = test::grad_check_config("lora-check", tie, bias);
  auto be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  ModelOptions opt;
  opt.max_batch = 2;
  opt.max_seq = 11;
  opt.loss_chunk_tokens = 5;
  opt.mlp_chunk_tokens = 7;  // ragged MLP chunks: the mask follows the token, not the chunk
  opt.lora = lora_config(dropout);
  LlamaModel model(cfg, opt, *be, ledger);
  set_weights(model, 7);
  const int64_t B = 2, T = 11;
  BatchInputs in = model.inputs(B, T);
  test::fill_grad_batch(in, B, T, cfg.vocab_size, 3);
  model.set_lora_dropout(42, 0);

  // The frozen base holds parameters only: the gradient bytes are the adapters' alone.
  const int64_t n = model.lora_layout().params.total;
  EXPECT_EQ(ledger.peak(MemPool::kDevice, MemCategory::kGrads), n * 4);
  EXPECT_EQ(ledger.peak(MemPool::kDevice, MemCategory::kOptimizer), 0);
  EXPECT_THROW(model.grads(), Error);

  // The loss with this dropout mask (forward_backward draws it; forward_loss never drops).
  auto loss_at = [&]() {
    model.zero_grads();
    return model.forward_backward(B, T, 1.f).loss_sum;
  };
  const double base_loss = loss_at();
  std::vector<float> g(model.lora_grads().f32(), model.lora_grads().f32() + n);
  if (dropout == 0) {
    // The forward-only loss sums the same terms through other kernels (tests/tolerance.h).
    const double tol = test::reorder_tolerance(test::reduction_chain(cfg, T, B));
    EXPECT_NEAR(model.forward_loss(B, T).loss_sum, base_loss, tol * base_loss);
  }

  float* w = model.lora_params().f32();
  for (const auto& d :
       test::directional_derivatives(model.lora_layout().params.entries, w, g, loss_at, 3e-4f)) {
    EXPECT_NEAR(d.analytic, d.finite_difference, 1e-2 * std::abs(d.finite_difference) + 2e-3)
        << d.name;
    EXPECT_GT(std::abs(d.analytic), 1e-4) << d.name << ": no signal";
  }
}

INSTANTIATE_TEST_SUITE_P(Variants, LoraGradTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool(),
                                            ::testing::Values(0.0, 0.3)));

// Merged weights W + alpha/r B A in a plain model give the logits of base + adapters.
TEST(LoraMerge, MergedWeightsGiveTheSameLogits) {
  const ModelConfig cfg = test::grad_check_config("lora-check", false, true);
  auto be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  ModelOptions opt;
  opt.max_batch = 1;
  opt.max_seq = 11;
  opt.lora = lora_config(0.1, "q,v,o,down");
  LlamaModel model(cfg, opt, *be, ledger);
  set_weights(model, 5);
  BatchInputs in = model.inputs(1, 11);
  test::fill_grad_batch(in, 1, 11, cfg.vocab_size, 9);
  std::vector<float> with_adapters;
  model.forward_last_logits(11, with_adapters);

  ModelOptions plain_opt = opt;
  plain_opt.lora = LoraConfig{};
  LlamaModel plain(cfg, plain_opt, *be, ledger);
  std::vector<float> merged(model.params().f32(), model.params().f32() + model.layout().total);
  for (int l = 0; l < cfg.n_layers; ++l)
    merge_lora_layer(cfg, opt.lora, model.lora_layout(), model.layout(), l,
                     model.lora_params().f32() + model.lora_layout().params.units[l].begin,
                     merged.data() + model.layout().units[l + 1].begin);
  std::copy(merged.begin(), merged.end(), plain.params().f32());
  BatchInputs pin = plain.inputs(1, 11);
  test::fill_grad_batch(pin, 1, 11, cfg.vocab_size, 9);
  std::vector<float> from_merged;
  plain.forward_last_logits(11, from_merged);
  std::vector<float> base_only;
  EXPECT_CLOSE(from_merged, with_adapters, 2e-5, 1e-4);
  // ... and the adapters matter: the base alone differs.
  std::copy(model.params().f32(), model.params().f32() + model.layout().total,
            plain.params().f32());
  plain.forward_last_logits(11, base_only);
  double diff = 0;
  for (size_t i = 0; i < base_only.size(); ++i) diff += std::abs(base_only[i] - with_adapters[i]);
  EXPECT_GT(diff, 1e-2);
}

// The update's output and input gradient go straight into the projection's by accumulating
// GEMMs: the scratch is the two [N, r] low-rank terms, plus the masked input gradient and the
// dropped-out input [N, max in] only with dropout.
TEST(LoraTransients, HoldOnlyTheLowRankTermsWithoutDropout) {
  const ModelConfig c = model_preset("llama3.1-8b");
  const int64_t N = 4096, r = 16;
  LoraConfig lora = lora_config(0, "q,k,v,o");
  lora.rank = r;
  auto specs = [&](const LoraConfig& l) {
    std::vector<std::pair<std::string, Shape>> out;
    for (const TensorSpec& s : lora_transients(c, l, 1, N, DType::kBF16))
      out.emplace_back(s.name, s.shape);
    return out;
  };
  using Specs = std::vector<std::pair<std::string, Shape>>;
  EXPECT_EQ(specs(lora), (Specs{{"lora_u", {N, r}}, {"lora_du", {N, r}}}));
  lora.dropout = 0.1;
  EXPECT_EQ(specs(lora), (Specs{{"lora_u", {N, r}},
                                {"lora_du", {N, r}},
                                {"lora_dx", {N, c.dim}},
                                {"lora_x", {N, c.dim}}}));
  lora.targets = lora_targets_from_string("all");  // down's input is the MLP's width
  EXPECT_EQ(specs(lora)[3], (std::pair<std::string, Shape>{"lora_x", {N, c.ffn_dim}}));
}

// Dropout is recomputed, not stored: every checkpointing mode gives bitwise the same adapter
// gradients, with the checkpoints on the host or only every 2nd layer's kept, and with the
// frozen base in host memory (staged onto the device a unit at a time).
TEST(LoraCheckpointing, ModesGiveBitwiseEqualGradients) {
  const ModelConfig cfg = test::grad_check_config("lora-check", true, false);
  auto be = make_backend(DeviceKind::kCpu);
  std::vector<std::vector<float>> grads;
  struct Mode {
    Checkpointing checkpointing;
    CheckpointPlacement placement;
    bool offload_base;
  };
  const int all = CheckpointPlacement::kAll;
  for (const Mode mode :
       {Mode{Checkpointing::kNone, {}, false}, Mode{Checkpointing::kSelective, {}, false},
        Mode{Checkpointing::kFull, {}, false}, Mode{Checkpointing::kNone, {}, true},
        Mode{Checkpointing::kFull, {1, all}, true}, Mode{Checkpointing::kFull, {2, all}, true}}) {
    MemoryLedger ledger;
    ModelOptions opt;
    opt.max_batch = 2;
    opt.max_seq = 11;
    opt.mlp_chunk_tokens = 4;
    opt.checkpointing = mode.checkpointing;
    opt.checkpoint_placement = mode.placement;
    opt.lora = lora_config(0.25);
    opt.lora.offload_base = mode.offload_base;
    LlamaModel model(cfg, opt, *be, ledger);
    set_weights(model, 3);
    BatchInputs in = model.inputs(2, 11);
    test::fill_grad_batch(in, 2, 11, cfg.vocab_size, 4);
    model.set_lora_dropout(7, 22);
    model.zero_grads();
    model.forward_backward(2, 11, 1.f);
    const Tensor g = model.lora_grads();
    grads.emplace_back(g.f32(), g.f32() + g.numel());
  }
  for (size_t i = 1; i < grads.size(); ++i)
    EXPECT_EQ(std::memcmp(grads[0].data(), grads[i].data(), grads[0].size() * 4), 0) << i;
}

}  // namespace
}  // namespace shardlm
