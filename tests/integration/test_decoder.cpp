// KV-cache generation against the training model: KvDecoder logits, appended token by token and
// in prefill chunks, equal LlamaModel::forward_last_logits on the same prefix (f32 and bf16
// parameters, GQA, attention bias, tied head); sample_text against a greedy loop of full
// forwards (window sliding included), top-k = 1 and tiny top-p against greedy, seeds, and the
// tokenizer's vocabulary bound.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "shardlm/backend/backend.h"
#include "shardlm/model/decoder.h"
#include "shardlm/model/llama.h"
#include "shardlm/train/trainer.h"
#include "test_util.h"
#include "tolerance.h"

namespace shardlm {
namespace {

ModelConfig decoder_config(bool bias, bool tie, int64_t vocab) {
  ModelConfig c;
  c.name = "decoder-test";
  c.dim = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn_dim = 48;
  c.vocab_size = vocab;
  c.rope_theta = 1000.0;
  c.attn_bias = bias;
  c.tie_embeddings = tie;
  return c;
}

// Weights large enough that attention is far from uniform and every path carries signal:
// matrices U(-0.3, 0.3), norms 1 +- 0.3, biases U(-0.3, 0.3), converted to the param dtype.
void set_weights(LlamaModel& model, Backend& be, uint64_t seed) {
  std::vector<float> host = test::random_vec(model.layout().total, seed, -0.3f, 0.3f);
  for (const auto& e : model.layout().entries) {
    if (e.name.find("norm") == std::string::npos) continue;
    for (int64_t i = 0; i < e.shape.numel(); ++i) host[e.offset + i] += 1.0f;
  }
  be.convert(Tensor(host.data(), DType::kF32, {model.layout().total}, MemPool::kHost),
             model.params());
}

// Logits [V] of the last of `ids` by a full forward at positions 0..T-1.
std::vector<float> full_forward_logits(LlamaModel& model, const std::vector<int32_t>& ids) {
  const int64_t T = int64_t(ids.size());
  BatchInputs in = model.inputs(1, T);
  for (int64_t t = 0; t < T; ++t) {
    in.tokens.i32()[t] = ids[t];
    in.targets.i32()[t] = kIgnoreIndex;
    in.positions.i32()[t] = int32_t(t);
    in.seg_start.i32()[t] = 0;
  }
  std::vector<float> logits;
  model.forward_last_logits(T, logits);
  return logits;
}

std::vector<int32_t> random_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> ids(n);
  for (auto& id : ids) id = int32_t(rng() % vocab);
  return ids;
}

// ---- decoder logits vs the training forward ---------------------------------------------------

// (param dtype, attention bias, tied embeddings)
// The layers: Llama's (no bias), with Qwen2's q/k/v biases, or Qwen3's q/k norms and heads of 12
// (q is 48 wide, the model 32), or Llama's with sliding windows (layer 0 sees 5 tokens, layer 1
// 11: each query against its own suffix of the cache, prefill chunks included), or Gemma 3's:
// those q/k norms with post-norms, GeGLU, (1 + w) norms, scaled embeddings and queries, a local
// layer's rotary base and its sliding window (6 tokens), or Gemma 2's: Gemma 3's without q/k
// norms, with its attention scores and final logits soft-capped.
enum class Layers { kLlama, kBias, kQwen3, kSliding, kGemma3, kGemma2 };

class DecoderLogits : public ::testing::TestWithParam<std::tuple<DType, Layers, bool>> {
 protected:
  void SetUp() override {
    const auto [dtype, layers, tie] = GetParam();
    cfg_ = decoder_config(layers == Layers::kBias, tie, 61);
    const bool gemma2 = layers == Layers::kGemma2;
    const bool gemma3 = layers == Layers::kGemma3 || gemma2;
    cfg_.qk_norm = layers == Layers::kQwen3 || (gemma3 && !gemma2);
    cfg_.explicit_head_dim = cfg_.qk_norm || gemma2 ? 12 : 0;
    cfg_.post_norms = cfg_.norm_one_plus_weight = cfg_.embed_scale = gemma3;
    if (gemma2) {
      cfg_.attn_softcap = 0.3;
      cfg_.final_softcap = 0.5;
    }
    if (gemma3) {
      cfg_.mlp_activation = "gelu_tanh";
      cfg_.query_pre_attn_scalar = 20;
      cfg_.global_layer_every = 2;
      cfg_.sliding_window = 6;
    }
    if (layers == Layers::kSliding) cfg_.layer_windows = {5, 11};
    ModelOptions opt;
    opt.param_dtype = dtype;
    opt.max_batch = 1;
    opt.max_seq = kTokens;
    model_ = std::make_unique<LlamaModel>(cfg_, opt, *be_, ledger_);
    set_weights(*model_, *be_, 11);
    ids_ = random_tokens(kTokens, cfg_.vocab_size, 5);
    for (int64_t T = 1; T <= kTokens; ++T) {
      expected_.push_back(
          full_forward_logits(*model_, std::vector<int32_t>(ids_.begin(), ids_.begin() + T)));
    }
  }

  // Decoder and training forward run the same ops except attention (cached rows vs flash tiles)
  // and GEMM row counts: two f32 forwards that sum in other orders, within the bound of
  // tests/tolerance.h relative to the position's largest logit.
  double logit_atol(const std::vector<float>& want) const {
    double scale = 0;
    for (float x : want) scale = std::max(scale, double(std::abs(x)));
    return test::reorder_tolerance(test::reduction_chain(cfg_, kTokens)) * scale;
  }

  static constexpr int64_t kTokens = 37;
  std::unique_ptr<Backend> be_ = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger_;
  ModelConfig cfg_;
  std::unique_ptr<LlamaModel> model_;
  std::vector<int32_t> ids_;                  // [kTokens]
  std::vector<std::vector<float>> expected_;  // [kTokens][V]: logits after prefix 1..kTokens
};

TEST_P(DecoderLogits, TokenByTokenMatchesFullForward) {
  KvDecoder dec(*model_, *be_, ledger_, kTokens + 3, 4);
  std::vector<float> logits;
  for (int64_t t = 0; t < kTokens; ++t) {
    dec.append(&ids_[t], 1, logits);
    ASSERT_EQ(dec.length(), t + 1);
    EXPECT_CLOSE(logits, expected_[t], logit_atol(expected_[t]), 0)
        << "after " << t + 1 << " tokens";
  }
}

// A parameters-only model (what the trainer samples from) holds no gradients or activations and
// decodes the same logits; running it forward is a clear error.
TEST_P(DecoderLogits, AParametersOnlyModelDecodesTheSame) {
  ModelOptions opt = model_->options();
  opt.activations = false;
  MemoryLedger ledger;
  LlamaModel params_only(cfg_, opt, *be_, ledger);
  be_->copy(model_->params(), params_only.params());
  for (MemCategory c : {MemCategory::kGrads, MemCategory::kActivations, MemCategory::kCheckpoints})
    EXPECT_EQ(ledger.peak(MemPool::kDevice, c), 0) << mem_category_name(c);
  EXPECT_THROW(params_only.grads(), Error);
  EXPECT_THROW(params_only.inputs(1, 4), Error);
  KvDecoder dec(params_only, *be_, ledger, kTokens, 8);
  std::vector<float> logits;
  dec.append(ids_.data(), kTokens, logits);
  EXPECT_CLOSE(logits, expected_[kTokens - 1], logit_atol(expected_[kTokens - 1]), 0);
}

// Appends of uneven sizes, each split into chunks of at most 5 tokens inside the decoder.
TEST_P(DecoderLogits, PrefillChunksMatchFullForward) {
  KvDecoder dec(*model_, *be_, ledger_, kTokens, 5);
  std::vector<float> logits;
  int64_t done = 0;
  for (int64_t n : {7, 1, 13, 5, 2, 9}) {
    dec.append(&ids_[done], n, logits);
    done += n;
    EXPECT_CLOSE(logits, expected_[done - 1], logit_atol(expected_[done - 1]), 0)
        << "after " << done;
  }
  ASSERT_EQ(done, kTokens);
  EXPECT_THROW(dec.append(&ids_[0], 1, logits), Error);  // the cache is full

  // After reset the cache is rewritten from position 0.
  dec.reset();
  dec.append(ids_.data(), kTokens, logits);
  EXPECT_CLOSE(logits, expected_.back(), logit_atol(expected_.back()), 0);
}

INSTANTIATE_TEST_SUITE_P(Params, DecoderLogits,
                         ::testing::Combine(::testing::Values(DType::kF32, DType::kBF16),
                                            ::testing::Values(Layers::kLlama, Layers::kBias,
                                                              Layers::kQwen3, Layers::kSliding,
                                                              Layers::kGemma3, Layers::kGemma2),
                                            ::testing::Bool()),
                         [](const auto& info) {
                           const Layers layers = std::get<1>(info.param);
                           return std::string(dtype_name(std::get<0>(info.param))) +
                                  (layers == Layers::kBias      ? "_bias"
                                   : layers == Layers::kQwen3   ? "_qwen3"
                                   : layers == Layers::kSliding ? "_sliding"
                                   : layers == Layers::kGemma3  ? "_gemma3"
                                   : layers == Layers::kGemma2  ? "_gemma2"
                                                                : "") +
                                  (std::get<2>(info.param) ? "_tied" : "");
                         });

// ---- sampling ---------------------------------------------------------------------------------

class Sampling : public ::testing::Test {
 protected:
  void SetUp() override {
    // 300 ids for the byte tokenizer's 259: the top 41 are padding that must never be drawn.
    cfg_ = decoder_config(true, false, 300);
    ModelOptions opt;
    opt.param_dtype = DType::kF32;
    opt.max_seq = kWindow;
    model_ = std::make_unique<LlamaModel>(cfg_, opt, *be_, ledger_);
    set_weights(*model_, *be_, 23);
  }

  SampleConfig config(double temperature, int64_t top_k, double top_p, int64_t n) const {
    SampleConfig c;
    c.max_new_tokens = n;
    c.temperature = temperature;
    c.top_k = top_k;
    c.top_p = top_p;
    return c;
  }

  std::string sample(const SampleConfig& c, uint64_t seed) {
    std::mt19937_64 rng(seed);
    return sample_text(*model_, tok_, kPrompt, c, rng);
  }

  // Greedy continuation by full forwards over the window the sampler keeps: everything while it
  // fits a cache of max_len, else from the last max_len/2 tokens (refilled when full).
  std::string greedy_reference(int64_t max_len, int64_t n_new) {
    std::vector<int32_t> ids = tok_.encode(kPrompt), generated;
    size_t start = ids.size() <= size_t(max_len) ? 0 : ids.size() - max_len / 2;
    for (int64_t n = 0; n < n_new; ++n) {
      const std::vector<float> logits =
          full_forward_logits(*model_, std::vector<int32_t>(ids.begin() + start, ids.end()));
      const int32_t next = int32_t(
          std::max_element(logits.begin(), logits.begin() + tok_.vocab_size()) - logits.begin());
      if (next == tok_.eos_id()) break;
      ids.push_back(next);
      generated.push_back(next);
      if (ids.size() - 1 - start >= size_t(max_len)) start = ids.size() - max_len / 2;
    }
    return tok_.decode(generated);
  }

  static constexpr int64_t kWindow = 24;
  static constexpr const char* kPrompt = "In the beginning";
  std::unique_ptr<Backend> be_ = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger_;
  ModelConfig cfg_;
  std::unique_ptr<LlamaModel> model_;
  ByteTokenizer tok_;
};

TEST_F(Sampling, GreedyEqualsArgmaxOfFullForwards) {
  const std::string expected = greedy_reference(kWindow, 6);
  ASSERT_FALSE(expected.empty());
  std::string streamed;
  std::mt19937_64 rng(1);
  const std::string text = sample_text(*model_, tok_, kPrompt, config(0.0, 40, 1.0, 6), rng,
                                       [&](const std::string& piece) { streamed += piece; });
  EXPECT_EQ(text, expected);
  EXPECT_EQ(streamed, text);
  EXPECT_EQ(sample(config(0.0, 40, 1.0, 6), 2), text);  // deterministic, seed unused
}

// 40 new tokens after a 16-token prompt in a window of 24: the cache is refilled twice.
TEST_F(Sampling, GreedySlidesTheWindowLikeFullForwards) {
  const std::string expected = greedy_reference(kWindow, 40);
  EXPECT_EQ(sample(config(0.0, 0, 1.0, 40), 3), expected);
  // A caller's decoder with a window of 10: the prompt alone does not fit.
  KvDecoder dec(*model_, *be_, ledger_, 10, 3);
  std::mt19937_64 rng(3);
  EXPECT_EQ(sample_text(dec, tok_, kPrompt, config(0.0, 0, 1.0, 30), rng),
            greedy_reference(10, 30));
}

TEST_F(Sampling, TopKOneAndTinyTopPAreGreedy) {
  const std::string greedy = sample(config(0.0, 0, 1.0, 12), 0);
  EXPECT_EQ(sample(config(1.0, 1, 1.0, 12), 5), greedy);
  EXPECT_EQ(sample(config(1.5, 0, 1e-9, 12), 6), greedy);
  EXPECT_EQ(sample(config(0.7, 50, 1e-9, 12), 7), greedy);
}

TEST_F(Sampling, SameSeedSameText) {
  for (const SampleConfig& c : {config(1.0, 0, 1.0, 20), config(0.8, 20, 0.9, 20)}) {
    const std::string a = sample(c, 42);
    EXPECT_EQ(sample(c, 42), a);
    EXPECT_NE(sample(c, 43), a);
  }
}

// A tokenizer of 64 ids over a model of 300: flat sampling must only ever draw ids < 64.
class SmallTokenizer final : public Tokenizer {
 public:
  std::vector<int32_t> encode(std::string_view text) const override {
    std::vector<int32_t> ids;
    for (unsigned char ch : text) ids.push_back(int32_t(ch % 62));
    return ids;
  }
  std::string decode(const std::vector<int32_t>& ids) const override {
    for (int32_t id : ids) seen.push_back(id);
    return std::string(ids.size(), 'x');
  }
  int32_t vocab_size() const override { return 64; }
  int32_t bos_id() const override { return 62; }
  int32_t eos_id() const override { return 63; }
  std::string name() const override { return "small"; }
  mutable std::vector<int32_t> seen;
};

TEST_F(Sampling, DrawsOnlyTokenizerIds) {
  SmallTokenizer small;
  for (uint64_t seed = 0; seed < 4; ++seed) {
    std::mt19937_64 rng(seed);
    sample_text(*model_, small, kPrompt, config(5.0, 0, 1.0, 60), rng);
  }
  ASSERT_GT(small.seen.size(), 20u);
  for (int32_t id : small.seen) EXPECT_LT(id, 64);
}

}  // namespace
}  // namespace shardlm
