// LoRA adapters' size table: which projections of each decoder layer carry a low-rank update
// y = x W^T + (alpha / r) * dropout(x) A^T B^T (A [r, in], B [out, r]), where the adapters live in
// their own flat arena (a ParamLayout whose units are the decoder layers, PEFT's tensor names),
// the transient buffers their forward and backward use, and PEFT's initialisation. Pure
// arithmetic like model/layout: the model allocates from these tables and the planner sums them.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "shardlm/model/config.h"
#include "shardlm/model/layout.h"

namespace shardlm {

// The projections an adapter can target, in a layer's order (PEFT's target_modules names are
// q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj).
enum class LoraTarget : int { kQ, kK, kV, kO, kGate, kUp, kDown };
constexpr int kNumLoraTargets = 7;
// "q", "k", ..., "down".
std::string lora_target_name(LoraTarget t);
// "q_proj", ..., "down_proj".
std::string lora_module_name(LoraTarget t);
// "self_attn.q_proj", ..., "mlp.down_proj" (the module path inside a decoder layer).
std::string lora_module_path(LoraTarget t);

struct LoraConfig {
  int64_t rank = 0;      // r; 0 = no adapters (full fine-tuning)
  double alpha = 16;     // the update is scaled by alpha / r
  double dropout = 0;    // on the adapter's input, in training only
  uint32_t targets = 0;  // bit (1 << LoraTarget) per targeted projection
  // The frozen base in the host pool, its units staged onto the device one at a time (two
  // device slots of a decoder layer each: the unit in use and the next one, fetched ahead on
  // the copy stream; the tables larger than a layer in pieces of rows).
  bool offload_base = false;
  // The frozen base's decoder projections (q, k, v, o, gate, up, down) stored in NF4
  // (quant/nf4.h, QLoRA), dequantized a decoder layer at a time on use (model/nf4_base.h); the
  // norms, biases, embeddings and LM head stay in the parameter dtype. With offload_base the
  // codes, absmax and dense parts are in the host pool, a layer's staged in 4 bits
  // (Nf4HostLayout).
  bool nf4_base = false;
  // A dense base sharded over ZeRO-3's ranks (lora_base_sharded): when a decoder layer is
  // acquired, the walk's next layer is all-gathered ahead into a second gather buffer while it
  // computes (zero.prefetch_layers >= 1). false: one gather buffer, each layer gathered on use.
  bool prefetch_base = false;
  bool enabled() const { return rank > 0; }
  bool has(LoraTarget t) const { return (targets >> int(t)) & 1u; }
  float scaling() const { return rank > 0 ? float(alpha / double(rank)) : 0.f; }
};

// Parses lora.targets: names separated by commas ("q,k,v,o", "all", or PEFT's "q_proj,...");
// Error(kConfig) naming the key and the valid names otherwise.
uint32_t lora_targets_from_string(const std::string& text);
// "q,k,v,o" (canonical order).
std::string lora_targets_string(uint32_t targets);

// Input and output sizes of a target's projection.
int64_t lora_in_features(const ModelConfig& cfg, LoraTarget t);
int64_t lora_out_features(const ModelConfig& cfg, LoraTarget t);

struct LoraLayout {
  // The adapters' arena: unit l = decoder layer l's adapters (contiguous, the targets in
  // LoraTarget order, A then B each); names "base_model.model.model.layers.L.self_attn.
  // q_proj.lora_A.weight" as PEFT writes them; lm_head_unit = -1 (nothing is tied). A pipeline
  // stage's layout (pp_begin, pp_end) keeps every layer's unit, the other stages' empty.
  ParamLayout params;
  // Element offsets into the arena per layer and target: A [r, in] and B [out, r]; -1 when the
  // target is not adapted.
  std::vector<std::array<int64_t, kNumLoraTargets>> a, b;
};
LoraLayout make_lora_layout(const ModelConfig& cfg, const LoraConfig& lora);

// The scratch one adapter's forward and backward uses, shared by every target and layer
// (rows: B*T, the largest case, attention's projections): the low-rank activations
// u = alpha/r * x A^T and du; with lora.dropout > 0 also the dropped-out input and the update's
// input gradient before its mask. The update's output and (without dropout) its input gradient
// are accumulated into the projection's own by the GEMMs, so they need no buffer.
std::vector<TensorSpec> lora_transients(const ModelConfig& cfg, const LoraConfig& lora, int64_t B,
                                        int64_t T, DType act);

// PEFT's initialisation of unit u (decoder layer u): A as torch's kaiming_uniform_(a=sqrt(5)),
// i.e. U(-1/sqrt(in), 1/sqrt(in)), B zero, from one generator seeded with `seed` over the
// units in order; `sink(u, values)` receives [unit_size(u)] f32.
void initial_lora_weights(const ModelConfig& cfg, const LoraConfig& lora, const LoraLayout& layout,
                          uint64_t seed,
                          const std::function<void(int unit, const float* values)>& sink);

// Merges layer l's adapters into its base weights on the host: W += alpha/r * B A for every
// target (f64 accumulation over r). base_unit: the base ParamLayout's unit l + 1 [unit_size]
// f32; adapters: the LoRA arena's unit l [unit_size] f32.
void merge_lora_layer(const ModelConfig& cfg, const LoraConfig& lora, const LoraLayout& layout,
                      const ParamLayout& base, int l, const float* adapters, float* base_unit);

}  // namespace shardlm
