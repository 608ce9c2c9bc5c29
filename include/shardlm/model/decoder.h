// KvDecoder: runs a LlamaModel's weights incrementally for generation, keeping every layer's
// keys and values (after RoPE) in a cache so that each new token costs one row per layer
// instead of a forward over the whole window. It is the model's own forward: a forward-only
// LlamaModel over the given model's ParamStore (B = 1, T = one chunk) whose attention core is the
// cache. It reads the parameters and never writes them (it does open and close the store's
// forward passes, so the store must hand out units without collectives: the model's own);
// sampling and what to do when the cache is full belong to the caller.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "shardlm/backend/backend.h"
#include "shardlm/model/llama.h"

namespace shardlm {

// The options of a KvDecoder's runner over a model whose options are `model`: forward only,
// B = 1, T = max_chunk, only a layer's input kept, a one-row logits workspace (the planner's
// inputs query the backend's scratch sizes with them).
ModelOptions kv_decoder_runner_options(const ModelOptions& model, int64_t max_chunk);

// The prefill chunk of sampling's KvDecoder (train/sampler.cpp, and the planner's
// sampler_plan_inputs_for): a prompt runs through the model this many tokens at a time.
inline constexpr int64_t kSamplePrefillChunk = 256;

class KvDecoder {
 public:
  // A cache of max_len positions per layer; prompts are prefilled in chunks of at most
  // max_chunk tokens (the size of the per-chunk scratch). Allocates everything here.
  KvDecoder(LlamaModel& model, Backend& backend, MemoryLedger& ledger, int64_t max_len,
            int64_t max_chunk);
  ~KvDecoder();
  KvDecoder(const KvDecoder&) = delete;
  KvDecoder& operator=(const KvDecoder&) = delete;

  // Forgets the cache: the next append starts at position 0.
  void reset();
  // Runs tokens [n] (host ids in [0, V)) at positions length() .. length()+n-1 and sets
  // logits_last [V] to the logits of the last of them. Requires 1 <= n and
  // length() + n <= max_len(): when the cache is full, reset() and re-append a window.
  void append(const int32_t* tokens, int64_t n, std::vector<float>& logits_last);

  int64_t length() const { return len_; }
  int64_t max_len() const { return max_len_; }
  int64_t max_chunk() const { return max_chunk_; }

 private:
  class CacheAttention;  // the model's AttentionCore: the cache and attention_decode
  void run_chunk(const int32_t* tokens, int64_t n, std::vector<float>* logits);

  int64_t max_len_;
  int64_t max_chunk_;
  int64_t len_ = 0;  // positions held in the cache
  std::unique_ptr<CacheAttention> cache_;
  std::unique_ptr<LlamaModel> runner_;   // forward only, over the model's parameters
  std::vector<int32_t> positions_host_;  // [max_chunk]
};

}  // namespace shardlm
