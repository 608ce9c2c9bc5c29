// Autoregressive sampling over a KvDecoder: the prompt is prefilled once, then every new token
// costs one cached step. Temperature (0 = greedy), top-k and top-p (nucleus) filtering; only
// the tokenizer's ids can be drawn (padding rows of the model's vocabulary never are). When
// the cache is full the window slides: the last max_len/2 tokens are re-prefilled from
// position 0, as the model saw positions in training.
#include <algorithm>
#include <cmath>
#include <numeric>

#include "shardlm/model/decoder.h"
#include "shardlm/train/trainer.h"

namespace shardlm {
namespace {

// Tokens per prefill chunk when sample_text builds its own decoder: big enough for GEMM-shaped
// prompt work, small enough that the chunk scratch stays a few MiB.

// Draws the next id from logits [0, V). Candidates are ranked by logit, ties by lower id, so
// that top_k = 1 and a tiny top_p both give the greedy (first-maximum) choice.
int32_t pick_token(const std::vector<float>& logits, int32_t V, const SampleConfig& cfg,
                   std::mt19937_64& rng, std::vector<int32_t>& order, std::vector<double>& probs) {
  if (cfg.temperature <= 0)
    return int32_t(std::max_element(logits.begin(), logits.begin() + V) - logits.begin());
  auto ranks_before = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  order.resize(V);
  std::iota(order.begin(), order.end(), 0);
  int32_t k = cfg.top_k > 0 ? int32_t(std::min<int64_t>(cfg.top_k, V)) : V;
  const bool nucleus = cfg.top_p < 1.0;
  if (k < V) {
    std::partial_sort(order.begin(), order.begin() + k, order.end(), ranks_before);
  } else if (nucleus) {
    std::sort(order.begin(), order.end(), ranks_before);
  }
  float max_logit = logits[order[0]];
  for (int32_t i = 1; i < k; ++i) max_logit = std::max(max_logit, logits[order[i]]);
  probs.resize(k);
  double total = 0;
  for (int32_t i = 0; i < k; ++i) {
    probs[i] = std::exp((double(logits[order[i]]) - max_logit) / cfg.temperature);
    total += probs[i];
  }
  if (nucleus) {
    // The smallest prefix of the ranked candidates whose mass reaches top_p (at least one).
    double mass = 0;
    int32_t keep = 0;
    while (keep < k && (keep == 0 || mass < cfg.top_p * total)) mass += probs[keep++];
    k = keep;
  }
  std::discrete_distribution<int32_t> dist(probs.begin(), probs.begin() + k);
  return order[dist(rng)];
}

}  // namespace

std::string sample_text(KvDecoder& decoder, const Tokenizer& tok, const std::string& prompt,
                        const SampleConfig& cfg, std::mt19937_64& rng,
                        const std::function<void(const std::string&)>& on_token) {
  if (cfg.max_new_tokens <= 0) return "";
  return sample_tokens(decoder, tok, tok.encode(prompt), cfg, rng, on_token);
}

std::string sample_tokens(KvDecoder& decoder, const Tokenizer& tok, std::vector<int32_t> ids,
                          const SampleConfig& cfg, std::mt19937_64& rng,
                          const std::function<void(const std::string&)>& on_token,
                          int32_t stop_id) {
  if (cfg.max_new_tokens <= 0) return "";
  if (ids.empty()) ids.push_back(tok.eos_id());  // an empty prompt starts a new document
  const int64_t max_len = decoder.max_len();
  std::vector<float> logits;  // [V]
  // Refills the cache with the newest tokens: all of them when they fit, else the last half
  // window, so that the next max_len/2 steps need no refill.
  auto prefill_window = [&] {
    const int64_t n = int64_t(ids.size());
    const int64_t keep = n <= max_len ? n : std::max<int64_t>(1, max_len / 2);
    decoder.reset();
    decoder.append(ids.data() + (n - keep), keep, logits);
  };
  prefill_window();

  std::vector<int32_t> generated, order;
  std::vector<double> probs;
  for (int64_t step = 0; step < cfg.max_new_tokens; ++step) {
    const int32_t V = std::min<int32_t>(tok.vocab_size(), int32_t(logits.size()));
    const int32_t next = pick_token(logits, V, cfg, rng, order, probs);
    if (next == tok.eos_id() || next == stop_id) break;
    ids.push_back(next);
    generated.push_back(next);
    if (on_token) on_token(tok.decode({next}));
    if (step + 1 == cfg.max_new_tokens) break;  // its logits would go unused
    if (decoder.length() < max_len) {
      decoder.append(&next, 1, logits);
    } else {
      prefill_window();
    }
  }
  return tok.decode(generated);
}

std::string sample_text(LlamaModel& model, const Tokenizer& tok, const std::string& prompt,
                        const SampleConfig& cfg, std::mt19937_64& rng,
                        const std::function<void(const std::string&)>& on_token) {
  if (cfg.max_new_tokens <= 0) return "";
  const int64_t window = model.options().max_seq;
  KvDecoder decoder(model, model.backend(), model.ledger(), window,
                    std::min(window, kSamplePrefillChunk));
  return sample_text(decoder, tok, prompt, cfg, rng, on_token);
}

}  // namespace shardlm
