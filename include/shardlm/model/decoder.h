// KvDecoder: runs a LlamaModel's weights incrementally for generation, keeping every layer's
// keys and values (after RoPE) in a cache so that each new token costs one row per layer
// instead of a forward over the whole window. It reads the model's parameters and never
// writes them; sampling and what to do when the cache is full belong to the caller.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "shardlm/backend/backend.h"
#include "shardlm/core/buffer.h"
#include "shardlm/model/llama.h"

namespace shardlm {

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
  struct Chunk;  // views of the per-chunk scratch
  void run_chunk(const int32_t* tokens, int64_t n);
  void embed(const int32_t* tokens, int64_t n);
  void layer_forward(int l, int64_t n);
  void last_logits(int64_t n, std::vector<float>& logits);
  void stage(int64_t begin, int64_t count);          // bf16 params [begin, begin+count) -> f32
  Tensor weight(int64_t offset, Shape shape) const;  // f32 view: params, or the staged block
  Tensor k_cache(int l) const;                       // [max_len, Hkv*Dh] of layer l
  Tensor v_cache(int l) const;                       // [max_len, Hkv*Dh] of layer l

  LlamaModel& model_;
  Backend& be_;
  int64_t max_len_;
  int64_t max_chunk_;
  int64_t len_ = 0;  // positions held in the cache

  Buffer k_cache_;    // [n_layers, max_len, Hkv, Dh] f32 keys after RoPE (activations)
  Buffer v_cache_;    // [n_layers, max_len, Hkv, Dh] f32 values (activations)
  Buffer scratch_;    // per-chunk activations of one layer, the logits (workspace)
  Buffer kernel_ws_;  // attention_decode scratch (workspace)
  Buffer staging_;    // f32 copy of one layer or a block of LM-head rows, bf16 params (workspace)
  int64_t staged_begin_ = -1;  // element range of params() that staging_ holds
  int64_t staged_count_ = 0;
  std::vector<int32_t> positions_host_;  // [max_chunk]
  std::unique_ptr<Chunk> chunk_;
};

}  // namespace shardlm
