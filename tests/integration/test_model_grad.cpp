// Whole-model gradient check: the decoder's analytic gradient (every parameter tensor)
// against central finite differences of its own loss, on a tiny config with GQA, attention
// bias, tied and untied heads, and packed documents; and with Qwen3's q/k norms and wider heads,
// and Gemma 2's and 3's layers.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "integration/grad_check_model.h"
#include "shardlm/backend/backend.h"
#include "shardlm/model/llama.h"
#include "test_util.h"

namespace shardlm {
namespace {

// step: the directional differences' step in the weights.
void expect_every_tensor_matches_finite_differences(const ModelConfig& cfg, float step = 1e-3f) {
  auto be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  ModelOptions opt;
  opt.max_batch = 2;
  opt.max_seq = 11;
  opt.loss_chunk_tokens = 5;  // several chunks, one partial
  LlamaModel model(cfg, opt, *be, ledger);
  // Larger weights than the training init so that every path carries signal.
  test::set_grad_check_weights(model, 7);
  float* w = model.params().f32();
  const int64_t B = 2, T = 11;
  BatchInputs in = model.inputs(B, T);
  test::fill_grad_batch(in, B, T, cfg.vocab_size, 3);

  model.zero_grads();
  const LossResult r = model.forward_backward(B, T, 1.f);  // gradient of the loss SUM
  ASSERT_GT(r.n_valid, 0);
  std::vector<float> g(model.grads().f32(), model.grads().f32() + model.layout().total);

  auto loss_at = [&]() { return model.forward_loss(B, T).loss_sum; };
  const double base = loss_at();
  EXPECT_NEAR(base, r.loss_sum, 1e-4 * std::abs(base));

  for (const auto& d : test::directional_derivatives(model.layout().entries, w, g, loss_at, step))
    EXPECT_NEAR(d.analytic, d.finite_difference, 1e-2 * std::abs(d.finite_difference) + 2e-3)
        << d.name;
}

class ModelGradTest : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

TEST_P(ModelGradTest, EveryTensorMatchesFiniteDifferences) {
  const auto [tie, bias] = GetParam();
  expect_every_tensor_matches_finite_differences(test::grad_check_config("grad-check", tie, bias));
}

// Qwen3's layers: per-head RMSNorms of q and k before RoPE (their weights among the tensors
// checked), heads of 6 so that q_dim = 24 differs from dim = 16, tied and untied.
TEST(ModelGrad, QkNormsAndHeadsWiderThanDimOverHeads) {
  for (bool tie : {false, true}) {
    SCOPED_TRACE(tie);
    ModelConfig cfg = test::grad_check_config("grad-check-qwen3", tie, /*bias=*/false);
    cfg.qk_norm = true;
    cfg.explicit_head_dim = 6;
    expect_every_tensor_matches_finite_differences(cfg);
  }
}

// Gemma 3's layers: (1 + w) norms, post-norms around attention and the MLP, GeGLU, the
// embedding times sqrt(dim), q scaled by query_pre_attn_scalar^-0.5, and local layers with a
// rotary base of their own (layer 0 local, layer 1 global with linear scaling); tied and untied.
TEST(ModelGrad, GemmaLayers) {
  for (bool tie : {false, true}) {
    SCOPED_TRACE(tie);
    ModelConfig cfg = test::grad_check_config("grad-check-gemma3", tie, /*bias=*/false);
    cfg.qk_norm = cfg.post_norms = cfg.norm_one_plus_weight = cfg.embed_scale = true;
    cfg.explicit_head_dim = 6;
    cfg.mlp_activation = "gelu_tanh";
    cfg.query_pre_attn_scalar = 10;
    cfg.global_layer_every = 2;
    cfg.rope_local_theta = 100.0;
    cfg.rope_scaling.type = "linear";
    cfg.rope_scaling.factor = 2.0;
    // The post-norms make the loss nearly invariant to the scale of the o and down weights,
    // so it curves strongly along their gradients: at the default step of 1e-3 the
    // differences' own truncation error exceeds the tolerance (it shrinks as step^2; 3e-4
    // still fails), while at 1e-4 the f32 rounding of the loss over the step does on AVX-512
    // sgemm kernels. 2e-4 sits in the middle of the steps (1.5e-4 to 2.5e-4) that pass on
    // OpenBLAS's SkylakeX, Haswell, Zen and Sandybridge kernels (OPENBLAS_CORETYPE).
    expect_every_tensor_matches_finite_differences(cfg, 2e-4f);
  }
}

// Gemma 2's layers: Gemma's without q/k norms, one rotary base, and soft caps on the attention
// scores and the final logits small enough that tanh bends them; tied (Gemma 2's).
TEST(ModelGrad, Gemma2SoftCaps) {
  ModelConfig cfg = test::grad_check_config("grad-check-gemma2", /*tie=*/true, /*bias=*/false);
  cfg.post_norms = cfg.norm_one_plus_weight = cfg.embed_scale = true;
  cfg.explicit_head_dim = 6;
  cfg.mlp_activation = "gelu_tanh";
  cfg.query_pre_attn_scalar = 10;
  cfg.global_layer_every = 2;
  cfg.attn_softcap = 0.3;
  cfg.final_softcap = 0.5;
  // The post-norms' curvature, as for Gemma 3's layers: the same step.
  expect_every_tensor_matches_finite_differences(cfg, 2e-4f);
}

INSTANTIATE_TEST_SUITE_P(Variants, ModelGradTest,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool()));

}  // namespace
}  // namespace shardlm
