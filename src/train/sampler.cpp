// Autoregressive sampling with temperature and top-k. Re-runs the whole window per token
// (no KV cache yet): fine for the demo's short contexts.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "shardlm/train/trainer.h"

namespace shardlm {

std::string sample_text(LlamaModel& model, const Tokenizer& tok, const std::string& prompt,
                        const SampleConfig& cfg, std::mt19937_64& rng,
                        const std::function<void(const std::string&)>& on_token) {
  std::vector<int32_t> ids = tok.encode(prompt);
  if (ids.empty()) ids.push_back(tok.eos_id());  // an empty prompt starts a new document
  const int64_t window = model.options().max_seq;
  std::vector<float> logits;
  std::vector<int32_t> generated;
  std::vector<int32_t> order(model.config().vocab_size);
  for (int64_t n = 0; n < cfg.max_new_tokens; ++n) {
    const int64_t T = std::min<int64_t>(window, int64_t(ids.size()));
    BatchInputs in = model.inputs(1, T);
    const int64_t start = int64_t(ids.size()) - T;
    for (int64_t t = 0; t < T; ++t) {
      in.tokens.i32()[t] = ids[start + t];
      in.targets.i32()[t] = kIgnoreIndex;
      in.positions.i32()[t] = static_cast<int32_t>(t);
      in.seg_start.i32()[t] = 0;
    }
    model.forward_last_logits(T, logits);
    // Only real tokens may be sampled: padding entries of the vocabulary are excluded.
    const int32_t V = std::min<int32_t>(tok.vocab_size(), int32_t(logits.size()));
    int32_t next;
    if (cfg.temperature <= 0) {
      next = int32_t(std::max_element(logits.begin(), logits.begin() + V) - logits.begin());
    } else {
      std::iota(order.begin(), order.begin() + V, 0);
      const int32_t k = cfg.top_k > 0 ? std::min<int32_t>(int32_t(cfg.top_k), V) : V;
      std::partial_sort(order.begin(), order.begin() + k, order.begin() + V,
                        [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
      const double mx = logits[order[0]];
      std::vector<double> p(k);
      for (int32_t i = 0; i < k; ++i) p[i] = std::exp((logits[order[i]] - mx) / cfg.temperature);
      std::discrete_distribution<int32_t> dist(p.begin(), p.end());
      next = order[dist(rng)];
    }
    if (next == tok.eos_id()) break;
    ids.push_back(next);
    generated.push_back(next);
    if (on_token) on_token(tok.decode({next}));
  }
  return tok.decode(generated);
}

}  // namespace shardlm
