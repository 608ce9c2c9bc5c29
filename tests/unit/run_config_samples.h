// The run configs the RunConfig tests share: one with every key set away from its default,
// a minimal one, and the parse and merge helpers that the parsing and the malformed-config tests
// build their inputs with. Tests only.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardlm/config/config.h"

namespace shardlm::test {

// Every key set away from its default, so that a key dropped by to_json or parse shows up.
inline constexpr const char* kFullConfig = R"({
  "model": {
    "preset": "tiny", "dim": 96, "n_layers": 3, "n_heads": 6, "n_kv_heads": 3,
    "ffn_dim": 256, "vocab_size": 300, "rope_theta": 50000.5,
    "rope_scaling": {"type": "llama3", "factor": 4.0, "low_freq_factor": 1.5,
                     "high_freq_factor": 3.5, "original_max_position": 1024},
    "norm_eps": 1e-6, "tie_embeddings": true, "attn_bias": true, "head_dim": 24, "qk_norm": true
  },
  "data": {"train": "/data/train.txt", "valid": "/data/valid.txt", "valid_fraction": 0.1,
           "seq_len": 64},
  "train": {"micro_batch": 4, "grad_accum": 2, "epochs": 0, "max_steps": 100, "lr": 0.001,
            "min_lr": 0.0001, "warmup_steps": 5, "weight_decay": 0.05, "beta1": 0.8,
            "beta2": 0.99, "eps": 1e-7, "grad_clip": 0.5, "seed": 18446744073709551615,
            "eval_every": 10, "eval_batches": 3},
  "precision": {"param": "bf16"},
  "parallel": {"tp": 1, "pp": 1, "cp": 1, "cp_kind": "hybrid", "cp_ulysses": 1,
               "sequence_parallel": false},
  "zero": {"stage": 0, "offload_optimizer": "none", "offload_params": "none",
           "overlap_comm": false, "reduce_bucket_bytes": 1000, "allgather_bucket_bytes": 2000,
           "prefetch_layers": 2, "reduce_dtype": "f32"},
  "memory": {"checkpointing": "selective", "offload_checkpoints": true, "loss_chunk_tokens": 512,
             "mlp_chunk_tokens": 200, "budget_gib": 1.5},
  "log": {"dir": "/runs/x", "every_steps": 7},
  "sample": {"prompt": "Once upon", "max_new_tokens": 50, "temperature": 0.0, "top_k": 5,
             "count": 1}
})";

inline constexpr const char* kMinimalConfig =
    R"({"data": {"train": "t.txt"}, "train": {"max_steps": 10}})";

inline RunConfig parse(const std::string& text, const std::vector<std::string>& overrides = {}) {
  return parse_run_config(text, overrides, "");
}

inline std::string with(const std::string& section_json) {
  // kMinimalConfig plus extra sections; a later duplicate key replaces the earlier.
  nlohmann::json base = nlohmann::json::parse(kMinimalConfig);
  base.merge_patch(nlohmann::json::parse(section_json));
  return base.dump();
}

}  // namespace shardlm::test
