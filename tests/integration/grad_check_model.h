// The tiny model and batch of the whole-model finite-difference checks (test_model_grad for the
// full model, test_lora for the adapters): GQA, optional attention bias and tied head, packed
// documents with ignored targets, and weights larger than the training init so that every path
// carries signal. Tests only.
#pragma once

#include <cstdint>
#include <random>
#include <string>

#include "shardlm/backend/backend.h"
#include "shardlm/model/llama.h"

namespace shardlm::test {

inline ModelConfig grad_check_config(const std::string& name, bool tie, bool bias) {
  ModelConfig c;
  c.name = name;
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
inline void fill_grad_batch(BatchInputs& in, int64_t B, int64_t T, int64_t V, uint64_t seed) {
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

// The model's own parameters: init_weights(seed) times 3, norms and biases spread around 1.
inline void set_grad_check_weights(LlamaModel& model, uint64_t seed) {
  model.init_weights(seed);
  float* w = model.params().f32();
  for (int64_t i = 0; i < model.layout().total; ++i) w[i] *= 3.f;
  for (const auto& e : model.layout().entries)
    if (e.name.find("norm") != std::string::npos || e.name.ends_with(".bias")) {
      std::mt19937_64 r(e.offset);
      for (int64_t i = 0; i < e.shape.numel(); ++i)
        w[e.offset + i] = 1.f + 0.3f * float(int(r() % 200) - 100) / 100.f;
    }
}

}  // namespace shardlm::test
