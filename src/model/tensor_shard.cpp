// The tensor-parallel split of a Llama model's parameter arena (model/tensor_shard.h): each
// entry of the full layout is whole (the norms), split by rows (column-parallel projections: q,
// k, v with their biases, gate, up; the vocabulary-parallel embedding table and LM head) or
// split by columns (row-parallel: o, down). LoRA's adapters follow their base projection: a
// column-parallel one's B by rows (A whole), a row-parallel one's A by columns (B whole).
#include "shardlm/model/tensor_shard.h"

#include <string_view>

#include "shardlm/core/check.h"

namespace shardlm {

namespace {

enum class Split { kWhole, kRows, kCols };

bool has(const std::string& name, const char* part) { return name.find(part) != std::string::npos; }

Split split_of(const std::string& name) {
  // y = x W^T + s x A^T B^T: A [r, in] meets W's input side, B [out, r] its output side.
  for (const char* p :
       {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head"})
    if (has(name, p)) return has(name, "lora_A") ? Split::kWhole : Split::kRows;
  for (const char* p : {"o_proj", "down_proj"})
    if (has(name, p)) return has(name, "lora_B") ? Split::kWhole : Split::kCols;
  return Split::kWhole;
}

// Every element of the shard arena `sl` exactly once, in its order, with its place in the full
// arena `fl` (the same entries, by name, each whole or split as split_of says).
std::vector<ShardPiece> layout_shard_pieces(const ParamLayout& fl, const ParamLayout& sl,
                                            int64_t rank) {
  SHARDLM_CHECK(fl.entries.size() == sl.entries.size(), "tp shard layout mismatch");
  std::vector<ShardPiece> out;
  size_t entry_first = 0;  // pieces merge within one entry only (so never across units)
  auto add = [&](int64_t f, int64_t s, int64_t n) {
    if (out.size() > entry_first && out.back().full + out.back().count == f &&
        out.back().shard + out.back().count == s) {
      out.back().count += n;
      return;
    }
    out.push_back({f, s, n});
  };
  for (size_t e = 0; e < fl.entries.size(); ++e) {
    const ParamEntry& fe = fl.entries[e];
    const ParamEntry& se = sl.entries[e];
    SHARDLM_CHECK(fe.name == se.name, "tp shard layout mismatch at {}", fe.name);
    // tied embeddings: the LM head entry aliases the embedding (skip duplicates)
    if (e > 0 && se.offset < sl.entries[e - 1].offset + sl.entries[e - 1].shape.numel()) continue;
    entry_first = out.size();
    switch (split_of(fe.name)) {
      case Split::kWhole:
        add(fe.offset, se.offset, se.shape.numel());
        break;
      case Split::kRows: {  // [rows, cols] (or a bias [rows]): rank r holds rows r*n..(r+1)*n
        const int64_t n = se.shape.numel();
        add(fe.offset + rank * n, se.offset, n);
        break;
      }
      case Split::kCols: {  // [rows, cols]: each row's columns r*c..(r+1)*c
        const int64_t rows = se.shape[0], c = se.shape[1], fc = fe.shape[1];
        for (int64_t i = 0; i < rows; ++i) add(fe.offset + i * fc + rank * c, se.offset + i * c, c);
        break;
      }
    }
  }
  return out;
}

// `pieces` (full offsets into the stage's arena `stage`, at tp = 1) moved to their places in the
// whole model's arena `whole`: the stage's entries are a subsequence of the whole model's, with
// the same names, and a piece never spans two entries.
std::vector<ShardPiece> stage_pieces_in_whole(const ParamLayout& whole, const ParamLayout& stage,
                                              const std::vector<ShardPiece>& pieces) {
  std::vector<int64_t> delta(stage.entries.size());  // whole offset - stage offset, per entry
  size_t w = 0;
  for (size_t e = 0; e < stage.entries.size(); ++e) {
    while (w < whole.entries.size() && whole.entries[w].name != stage.entries[e].name) ++w;
    SHARDLM_CHECK(w < whole.entries.size(), "stage entry {} is not in the model",
                  stage.entries[e].name);
    delta[e] = whole.entries[w].offset - stage.entries[e].offset;
  }
  std::vector<ShardPiece> out;
  out.reserve(pieces.size());
  size_t e = 0;
  for (const ShardPiece& p : pieces) {  // in stage order
    while (e + 1 < stage.entries.size() && stage.entries[e + 1].offset <= p.full) ++e;
    out.push_back({p.full + delta[e], p.shard, p.count});
  }
  return out;
}

}  // namespace

ModelConfig tp_shard_config(const ModelConfig& full, int64_t tp) {
  SHARDLM_CHECK(full.tp_shards == 1, "tp_shard_config: the config is already a shard");
  if (tp == 1) return full;
  auto divides = [&](int64_t v, const char* key, std::string_view or_else = "") {
    if (v % tp != 0)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "parallel.tp = {} does not divide {} = {}: tensor parallelism gives each rank "
                   "an equal share of it; pick parallel.tp that divides {}{}",
                   tp, key, v, key, or_else);
  };
  divides(full.n_heads, "model.n_heads");
  divides(full.n_kv_heads, "model.n_kv_heads");
  divides(full.ffn_dim, "model.ffn_dim");
  const int64_t padded = (full.vocab_size + tp - 1) / tp * tp;
  divides(full.vocab_size, "model.vocab_size",
          fmt::format(", or pad the vocabulary: set model.vocab_size = {} (a multiple of "
                      "parallel.tp; ids past the tokenizer's are never seen)",
                      padded));
  ModelConfig s = full;  // vocab_size stays whole: the shard holds vocab_rows() of it
  s.n_heads = full.n_heads / tp;
  s.n_kv_heads = full.n_kv_heads / tp;
  s.ffn_dim = full.ffn_dim / tp;
  s.tp_shards = tp;
  return s;
}

std::vector<ShardPiece> tp_shard_pieces(const ModelConfig& full, int64_t tp, int64_t rank) {
  SHARDLM_CHECK(rank >= 0 && rank < tp, "tp rank {} out of [0, {})", rank, tp);
  return layout_shard_pieces(make_param_layout(full), make_param_layout(tp_shard_config(full, tp)),
                             rank);
}

std::vector<ShardPiece> lora_shard_pieces(const ModelConfig& full, const LoraConfig& lora,
                                          int64_t tp, int64_t rank) {
  SHARDLM_CHECK(rank >= 0 && rank < tp, "tp rank {} out of [0, {})", rank, tp);
  return layout_shard_pieces(make_lora_layout(full, lora).params,
                             make_lora_layout(tp_shard_config(full, tp), lora).params, rank);
}

std::vector<ShardPiece> stage_shard_pieces(const ModelConfig& full, int64_t pp_begin,
                                           int64_t pp_end, int64_t tp, int64_t rank) {
  SHARDLM_CHECK(full.whole_pipeline(), "stage_shard_pieces: the config is already a stage");
  ModelConfig stage = full;
  stage.pp_begin = pp_begin;
  stage.pp_end = pp_end;
  const std::vector<ShardPiece> tp_pieces = tp_shard_pieces(stage, tp, rank);
  if (stage.whole_pipeline()) return tp_pieces;
  return stage_pieces_in_whole(make_param_layout(full), make_param_layout(stage), tp_pieces);
}

std::vector<ShardPiece> lora_stage_shard_pieces(const ModelConfig& full, const LoraConfig& lora,
                                                int64_t pp_begin, int64_t pp_end, int64_t tp,
                                                int64_t rank) {
  SHARDLM_CHECK(full.whole_pipeline(), "lora_stage_shard_pieces: the config is already a stage");
  ModelConfig stage = full;
  stage.pp_begin = pp_begin;
  stage.pp_end = pp_end;
  const std::vector<ShardPiece> tp_pieces = lora_shard_pieces(stage, lora, tp, rank);
  if (stage.whole_pipeline()) return tp_pieces;
  return stage_pieces_in_whole(make_lora_layout(full, lora).params,
                               make_lora_layout(stage, lora).params, tp_pieces);
}

std::vector<std::pair<int64_t, int64_t>> tp_replicated_ranges(const ParamLayout& shard_layout) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const ParamEntry& e : shard_layout.entries) {
    if (split_of(e.name) != Split::kWhole) continue;
    const int64_t b = e.offset, n = e.shape.numel();
    if (!out.empty() && out.back().second >= b) {
      out.back().second = std::max(out.back().second, b + n);
      continue;
    }
    out.push_back({b, b + n});
  }
  return out;
}

std::vector<std::pair<int64_t, int64_t>> tp_partial_ranges(const ParamLayout& shard_layout,
                                                           bool sequence_parallel) {
  std::vector<std::pair<int64_t, int64_t>> out;
  for (const ParamEntry& e : shard_layout.entries) {
    const bool head_norm =
        e.name.find("q_norm") != std::string::npos || e.name.find("k_norm") != std::string::npos;
    // input_layernorm, post_attention_layernorm, model.norm (and the q/k norms)
    const bool norm = e.name.find("norm") != std::string::npos;
    if (head_norm || (sequence_parallel && norm))
      out.push_back({e.offset, e.offset + e.shape.numel()});
  }
  return out;
}

}  // namespace shardlm
