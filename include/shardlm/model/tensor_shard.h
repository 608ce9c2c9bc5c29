// Tensor-parallel sharding of a Llama model's parameters: which part of every tensor rank r of
// tp holds (Megatron's split: q/k/v and gate/up by output rows, o and down by input columns,
// whole heads and kv heads per rank; the embedding table and the LM head by vocabulary rows;
// the norms replicated; LoRA's adapters with their base projection), as the shard's
// ModelConfig and as copy pieces between the full arena and the shard's. Pure arithmetic: no
// backend, no allocation beyond the tables.
#pragma once

#include <cstdint>
#include <vector>

#include "shardlm/model/config.h"
#include "shardlm/model/layout.h"
#include "shardlm/model/lora.h"

namespace shardlm {

// One rank's shard of `full` split tp ways: n_heads / tp, n_kv_heads / tp, ffn_dim / tp and
// tp_shards = tp (so vocab_rows() = vocab_size / tp). Error(kConfig) naming model.n_heads,
// model.n_kv_heads, model.ffn_dim or model.vocab_size (and parallel.tp) when tp does not divide
// it. tp = 1: `full` itself.
ModelConfig tp_shard_config(const ModelConfig& full, int64_t tp);

// A contiguous run of elements that rank `rank`'s shard arena holds at `shard` and the full
// arena at `full` (element offsets into make_param_layout of each config).
struct ShardPiece {
  int64_t full = 0, shard = 0, count = 0;
};
// Every element of rank `rank`'s shard arena exactly once, in shard-arena order, which is
// also full-arena order (adjacent pieces of one tensor merged; a piece never spans two
// tensors, hence never two units). Replicated tensors map whole; split matrices by rows or by
// columns.
std::vector<ShardPiece> tp_shard_pieces(const ModelConfig& full, int64_t tp, int64_t rank);

// The same for LoRA's adapter arena (make_lora_layout of `full` and of its tp shard): a
// column-parallel projection's B [out, r] split by rows with its base, A [r, in] whole; a
// row-parallel one's (o, down) A split by columns with its base, B [out, r] whole.
std::vector<ShardPiece> lora_shard_pieces(const ModelConfig& full, const LoraConfig& lora,
                                          int64_t tp, int64_t rank);
// A pipeline stage's adapter units within the whole model's adapter arena, one piece per layer
// the stage holds (stage: make_lora_layout of the stage's config, whole: of the whole model's).
std::vector<ShardPiece> lora_stage_pieces(const LoraLayout& whole, const LoraLayout& stage);

// Pipeline stage layers [pp_begin, pp_end) composed with tp rank `rank`'s shard: every element
// of that stage's shard arena (make_param_layout of tp_shard_config(full with pp_begin/pp_end,
// tp)) exactly once, in its arena order, with its place in the whole model's arena (full at
// pp and tp 1). The stage's tensors keep the whole model's names, so pieces map by name.
std::vector<ShardPiece> stage_shard_pieces(const ModelConfig& full, int64_t pp_begin,
                                           int64_t pp_end, int64_t tp, int64_t rank);

// The same for LoRA's adapters: stage layers [pp_begin, pp_end) of tp rank `rank`'s shard of
// the adapter arena (make_lora_layout of the stage's tp shard config), each element with its
// place in the whole model's adapter arena (make_lora_layout of `full`). pp_begin = 0 and
// pp_end = n_layers: lora_shard_pieces; tp = 1: lora_stage_pieces.
std::vector<ShardPiece> lora_stage_shard_pieces(const ModelConfig& full, const LoraConfig& lora,
                                                int64_t pp_begin, int64_t pp_end, int64_t tp,
                                                int64_t rank);

// Element ranges [begin, end) of a shard arena (layout of tp_shard_config) that hold
// replicated tensors (the same values on every tp rank): the norms, and in an adapter arena
// the column-parallel projections' A and the row-parallel ones' B. A global norm over the tp
// group counts them once.
std::vector<std::pair<int64_t, int64_t>> tp_replicated_ranges(const ParamLayout& shard_layout);

// The element ranges [begin, end) of a shard arena whose gradients each tp rank holds a part
// of: the q/k norms' weights (shared by every head, and each rank holds its own heads) and,
// under sequence parallelism, every norm's weight (each rank normalises its own rows). They
// must be summed over the tp group before the optimizer; then they are replicated again.
std::vector<std::pair<int64_t, int64_t>> tp_partial_ranges(const ParamLayout& shard_layout,
                                                           bool sequence_parallel);

}  // namespace shardlm
