// KvDecoder: LlamaModel's own forward restricted to new tokens. The decoder's model is forward
// only (no gradients, no backward scratch, one layer's kept tensors), holds one chunk of
// B = 1 x T = max_chunk rows and reads the given model's parameters through its ParamStore; its
// attention core writes each layer's new keys and values into that layer's cache rows and runs
// attention_decode over the cache. The logits of the last token are forward_last_logits'.
// All device and host buffers are allocated in the constructor; append() only re-takes views
// when a chunk's length changes.
#include "shardlm/model/decoder.h"

#include <algorithm>
#include <limits>
#include <vector>

namespace shardlm {

// The cache: per layer [max_len, Hkv * Dh] keys (after RoPE) and values, in the model's
// activation dtype (activations).
class KvDecoder::CacheAttention final : public AttentionCore {
 public:
  CacheAttention(const ModelConfig& cfg, DType dtype, Backend& backend, MemoryLedger& ledger,
                 int64_t max_len, int64_t max_chunk)
      : be_(backend),
        dtype_(dtype),
        max_len_(max_len),
        kv_dim_(cfg.kv_dim()),
        heads_(cfg.n_kv_heads),
        softcap_(float(cfg.attn_softcap)) {
    for (int64_t l = 0; l < cfg.n_layers; ++l) windows_.push_back(cfg.window_of_layer(l));
    const size_t bytes = size_t(cfg.n_layers * max_len * kv_dim_) * dtype_size(dtype);
    k_ = Buffer(backend, ledger, MemCategory::kActivations, MemPool::kDevice, bytes);
    v_ = Buffer(backend, ledger, MemCategory::kActivations, MemPool::kDevice, bytes);
    workspace_ = Buffer(backend, ledger, MemCategory::kWorkspace, MemPool::kDevice,
                        backend.attention_decode_workspace_bytes(1, max_chunk, max_len, cfg.n_heads,
                                                                 cfg.head_dim()));
  }
  // Positions held before the chunk the model runs now.
  void set_length(int64_t len) { len_ = len; }

  // q [1, n, Hq, Dh]; k, v [1, n, Hkv, Dh] of the chunk's tokens at positions len .. len+n-1:
  // written into the layer's cache rows, then every query attends the cache up to itself.
  void forward(int layer, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor&,
               const DocumentSpans&, const Tensor& out, const Tensor&) override {
    const int64_t n = q.dim(1);
    be_.copy(k.view({n, kv_dim_}), cache(k_, layer).rows(len_, n));
    be_.copy(v.view({n, kv_dim_}), cache(v_, layer).rows(len_, n));
    const int64_t Dh = kv_dim_ / heads_;
    const int64_t window = windows_[size_t(layer)];
    if (window == 0 || len_ + n <= window) {  // every query sees the whole cache up to itself
      be_.attention_decode(q, cache(k_, layer).view({1, max_len_, heads_, Dh}),
                           cache(v_, layer).view({1, max_len_, heads_, Dh}), len_, out,
                           {workspace_.data(), workspace_.bytes()}, softcap_);
      return;
    }
    // A sliding window: query len + t sees cache rows [len + t - window + 1, len + t], so each
    // query attends its own suffix of the cache, taken as a cache that starts there.
    const int64_t Hq = q.dim(2);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = len_ + t, first = std::max<int64_t>(pos - window + 1, 0);
      const int64_t rows = max_len_ - first;
      be_.attention_decode(q.view({n, Hq * Dh}).rows(t, 1).view({1, 1, Hq, Dh}),
                           cache(k_, layer).rows(first, rows).view({1, rows, heads_, Dh}),
                           cache(v_, layer).rows(first, rows).view({1, rows, heads_, Dh}),
                           pos - first, out.view({n, Hq * Dh}).rows(t, 1).view({1, 1, Hq, Dh}),
                           {workspace_.data(), workspace_.bytes()}, softcap_);
    }
  }
  void backward(int, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                const DocumentSpans&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                const Tensor&, const Tensor&) override {
    SHARDLM_FAIL(ErrorKind::kInternal, "the KV cache runs forward only");
  }

 private:
  Tensor cache(const Buffer& b, int layer) const {
    return b.view(dtype_, {max_len_, kv_dim_},
                  size_t(layer) * size_t(max_len_ * kv_dim_) * dtype_size(dtype_));
  }
  Backend& be_;
  DType dtype_;
  int64_t max_len_, kv_dim_, heads_;
  int64_t len_ = 0;
  float softcap_;                 // the model's attention soft cap (0: none)
  std::vector<int64_t> windows_;  // [n_layers] each layer's sliding window (0: none)
  Buffer k_, v_;                  // [n_layers, max_len, Hkv, Dh] (dtype_)
  Buffer workspace_;              // attention_decode scratch
};

ModelOptions kv_decoder_runner_options(const ModelOptions& model, int64_t max_chunk) {
  ModelOptions opt;
  opt.param_dtype = model.param_dtype;
  opt.activation_dtype = model.activation_dtype;
  opt.max_batch = 1;
  opt.max_seq = max_chunk;
  opt.loss_chunk_tokens = 1;  // the workspace holds one row's logits, not a loss chunk's
  opt.checkpointing = Checkpointing::kFull;  // nothing but a layer's input is kept
  opt.backward = false;
  return opt;
}

KvDecoder::~KvDecoder() = default;

KvDecoder::KvDecoder(LlamaModel& model, Backend& backend, MemoryLedger& ledger, int64_t max_len,
                     int64_t max_chunk)
    : max_len_(max_len),
      max_chunk_(std::min(max_chunk, max_len)),
      positions_host_(std::max<int64_t>(max_chunk_, 0)) {
  SHARDLM_CHECK(max_len >= 1 && max_len <= std::numeric_limits<int32_t>::max(),
                "KvDecoder: max_len = {} must be in [1, 2^31) (i32 positions)", max_len);
  SHARDLM_CHECK(max_chunk >= 1, "KvDecoder: max_chunk = {} must be >= 1", max_chunk);
  const ModelConfig& cfg = model.config();
  const ModelOptions opt = kv_decoder_runner_options(model.options(), max_chunk_);
  cache_ = std::make_unique<CacheAttention>(cfg, opt.activation_dtype, backend, ledger, max_len_,
                                            max_chunk_);
  runner_ = std::make_unique<LlamaModel>(
      cfg, opt, backend, ledger, ModelSeams{.store = &model.store(), .attention = cache_.get()});
}

void KvDecoder::reset() { len_ = 0; }

void KvDecoder::append(const int32_t* tokens, int64_t n, std::vector<float>& logits_last) {
  SHARDLM_CHECK(n >= 1, "KvDecoder::append: needs at least one token, got {}", n);
  SHARDLM_CHECK(len_ + n <= max_len_,
                "KvDecoder::append: {} tokens after {} cached exceed max_len = {}; reset() and "
                "re-append a shorter window",
                n, len_, max_len_);
  const int64_t V = runner_->config().vocab_size;
  for (int64_t i = 0; i < n; ++i) {
    SHARDLM_CHECK_KIND(ErrorKind::kData, tokens[i] >= 0 && tokens[i] < V,
                       "KvDecoder::append: token id {} at {} is outside the vocabulary [0, {})",
                       tokens[i], i, V);
  }
  for (int64_t begin = 0; begin < n; begin += max_chunk_) {
    const int64_t count = std::min(max_chunk_, n - begin);
    run_chunk(tokens + begin, count, begin + count == n ? &logits_last : nullptr);
  }
}

// The chunk's tokens at positions len .. len+n-1 through the model's forward; with `logits`,
// the last token's (only the append's last chunk needs the head).
void KvDecoder::run_chunk(const int32_t* tokens, int64_t n, std::vector<float>* logits) {
  Backend& be = runner_->backend();
  const BatchInputs in = runner_->inputs(1, n);
  for (int64_t i = 0; i < n; ++i) positions_host_[i] = static_cast<int32_t>(len_ + i);
  be.copy(Tensor(const_cast<int32_t*>(tokens), DType::kI32, {n}, MemPool::kHost), in.tokens);
  be.copy(Tensor(positions_host_.data(), DType::kI32, {n}, MemPool::kHost), in.positions);
  be.zero(in.seg_start);  // one document from position 0 (the cache core reads positions only)
  cache_->set_length(len_);
  if (logits != nullptr)
    runner_->forward_last_logits(n, *logits);
  else
    runner_->forward_layers_only(1, n);
  len_ += n;
}

}  // namespace shardlm
