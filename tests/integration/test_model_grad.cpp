// Whole-model gradient check: the decoder's analytic gradient (every parameter tensor)
// against central finite differences of its own loss, on a tiny config with GQA, attention
// bias, tied and untied heads, and packed documents.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "shardlm/backend/backend.h"
#include "shardlm/model/llama.h"
#include "test_util.h"

namespace shardlm {
namespace {

ModelConfig tiny_config(bool tie, bool bias) {
  ModelConfig c;
  c.name = "grad-check";
  c.dim = 16;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn_dim = 24;
  c.vocab_size = 37;
  c.rope_theta = 100.0;
  c.tie_embeddings = tie;
  c.attn_bias = bias;
  return c;
}

// Fills B rows of T tokens: two documents per row (split at a row-dependent point), a few
// ignored targets.
void fill_batch(BatchInputs& in, int64_t B, int64_t T, int64_t V, uint64_t seed) {
  std::mt19937_64 rng(seed);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t split = 3 + b;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t i = b * T + t;
      const int64_t start = t < split ? 0 : split;
      in.tokens.i32()[i] = int32_t(rng() % V);
      in.targets.i32()[i] = (t % 5 == 4) ? kIgnoreIndex : int32_t(rng() % V);
      in.positions.i32()[i] = int32_t(t - start);
      in.seg_start.i32()[i] = int32_t(start);
    }
  }
}

class ModelGradTest : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(ModelGradTest, EveryTensorMatchesFiniteDifferences) {
  const auto [tie, bias] = GetParam();
  const ModelConfig cfg = tiny_config(tie, bias);
  auto be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  ModelOptions opt;
  opt.max_batch = 2;
  opt.max_seq = 11;
  opt.loss_chunk_tokens = 5;  // several chunks, one partial
  LlamaModel model(cfg, opt, *be, ledger);
  model.init_weights(7);
  // Larger weights than the training init so that every path carries signal.
  float* w = model.params().f32();
  for (int64_t i = 0; i < model.layout().total; ++i) w[i] *= 3.f;
  for (const auto& e : model.layout().entries)
    if (e.name.find("norm") != std::string::npos || e.name.ends_with(".bias")) {
      std::mt19937_64 r(e.offset);
      for (int64_t i = 0; i < e.shape.numel(); ++i)
        w[e.offset + i] = 1.f + 0.3f * float(int(r() % 200) - 100) / 100.f;
    }
  const int64_t B = 2, T = 11;
  BatchInputs in = model.inputs(B, T);
  fill_batch(in, B, T, cfg.vocab_size, 3);

  model.zero_grads();
  const LossResult r = model.forward_backward(B, T, 1.f);  // gradient of the loss SUM
  ASSERT_GT(r.n_valid, 0);
  std::vector<float> g(model.grads().f32(), model.grads().f32() + model.layout().total);

  auto loss_at = [&]() { return model.forward_loss(B, T).loss_sum; };
  const double base = loss_at();
  EXPECT_NEAR(base, r.loss_sum, 1e-4 * std::abs(base));

  for (const auto& d : test::directional_derivatives(model.layout().entries, w, g, loss_at, 1e-3f))
    EXPECT_NEAR(d.analytic, d.finite_difference, 1e-2 * std::abs(d.finite_difference) + 2e-3)
        << d.name;
}

INSTANTIATE_TEST_SUITE_P(Variants, ModelGradTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()));

}  // namespace
}  // namespace shardlm
