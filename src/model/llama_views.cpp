// The views a LlamaModel step carves out of its arenas (llama_views.h): every tensor of one
// micro-batch slot at one (B, T), found by the name model/layout's tables give it. A step only
// re-carves when (B, T) changes, so the steady-state step allocates nothing.
#include <algorithm>
#include <utility>

#include "llama_views.h"

namespace shardlm {

std::vector<Tensor> carve(std::byte* base, MemPool pool, const std::vector<TensorSpec>& specs) {
  std::vector<Tensor> out;
  out.reserve(specs.size());
  size_t off = 0;
  for (const auto& s : specs) {
    out.emplace_back(base + off, s.dtype, s.shape, pool);
    off += align_up(s.bytes());
  }
  return out;
}

NamedViews::NamedViews(std::byte* base, MemPool pool, const std::vector<TensorSpec>& specs)
    : specs_(specs), views_(carve(base, pool, specs)), used_(specs.size(), false) {}

bool NamedViews::has(std::string_view name) const {
  return std::any_of(specs_.begin(), specs_.end(),
                     [&](const TensorSpec& s) { return s.name == name; });
}

Tensor NamedViews::get(std::string_view name) {
  for (size_t i = 0; i < specs_.size(); ++i)
    if (specs_[i].name == name) {
      used_[i] = true;
      return views_[i];
    }
  SHARDLM_FAIL(ErrorKind::kInternal, "the layout's table has no tensor named '{}'", name);
}

void NamedViews::check_all_used(const char* table) const {
  for (size_t i = 0; i < specs_.size(); ++i)
    SHARDLM_CHECK(used_[i], "{}: the layout's tensor '{}' has no field in the model's views", table,
                  specs_[i].name);
}

const LlamaModel::StepViews& LlamaModel::bind(int64_t B, int64_t T) {
  SHARDLM_CHECK(opt_.activations,
                "this model holds parameters only (ModelOptions::activations = false): it can "
                "be sampled from through a KvDecoder, not run forward or backward");
  SHARDLM_CHECK(B >= 1 && B <= opt_.max_batch && T >= 1 && T <= opt_.max_seq,
                "micro-batch {}x{} exceeds the model's buffers ({}x{})", B, T, opt_.max_batch,
                opt_.max_seq);
  StepViews& s = *views_[slot_];
  if (s.B == B && s.T == T) return s;
  bind_layers(s, B, T);
  bind_model_tensors(s, B, T);
  s.B = B;
  s.T = T;
  return s;
}

// The stage's layers' views (a pipeline stage carves only its layers, in its slot's part of the
// checkpoint arena) and each device checkpoint slot's used bytes.
void LlamaModel::bind_layers(StepViews& s, int64_t B, int64_t T) {
  const int64_t Hq = cfg_.n_heads, Hkv = cfg_.n_kv_heads, Dh = cfg_.head_dim();
  const LayerActivationSpecs specs = layer_activation_specs(
      cfg_, B, T, opt_.mlp_chunk_tokens, opt_.checkpointing, opt_.activation_dtype);
  // LayerActs' fields by the names of layer_activation_specs; x_full exists only with the rows
  // split (sequence parallelism), q_raw, k_raw, rstd_q and rstd_k only with q/k norms, the
  // post-norms' tensors only with them.
  static constexpr std::pair<const char*, Tensor LayerActs::*> kFields[] = {
      {"x_in", &LayerActs::x_in},
      {"xn1", &LayerActs::xn1},
      {"rstd1", &LayerActs::rstd1},
      {"q", &LayerActs::q},
      {"k", &LayerActs::k},
      {"v", &LayerActs::v},
      {"attn", &LayerActs::attn},
      {"lse", &LayerActs::lse},
      {"x_mid", &LayerActs::x_mid},
      {"xn2", &LayerActs::xn2},
      {"rstd2", &LayerActs::rstd2},
      {"gate", &LayerActs::gate},
      {"up", &LayerActs::up},
      {"x_full", &LayerActs::x_full},
      {"q_raw", &LayerActs::q_raw},
      {"k_raw", &LayerActs::k_raw},
      {"rstd_q", &LayerActs::rstd_q},
      {"rstd_k", &LayerActs::rstd_k},
      {"attn_out", &LayerActs::attn_out},
      {"rstd_post1", &LayerActs::rstd_post1},
      {"mlp_out", &LayerActs::mlp_out},
      {"rstd_post2", &LayerActs::rstd_post2},
  };
  auto exists = [&](std::string_view name) {
    if (name == "x_full") return seam_->splits_rows();
    if (name == "q_raw" || name == "k_raw" || name == "rstd_q" || name == "rstd_k")
      return cfg_.qk_norm;
    if (name == "attn_out" || name == "rstd_post1" || name == "mlp_out" || name == "rstd_post2")
      return cfg_.post_norms;
    return true;
  };
  NamedViews work(activations_.data(), activations_.pool(), specs.work);
  s.layers.assign(cfg_.n_layers, LayerActs{});
  const size_t slot_kept_base = kept_stride_ * slots_ * slot_;
  for (int l = int(cfg_.pp_begin); l < cfg_.stage_end(); ++l) {
    NamedViews kept(checkpoints_.data() + slot_kept_base + kept_stride_ * checkpoint_slot(l),
                    checkpoints_.pool(), specs.kept);
    LayerActs& a = s.layers[l];
    for (const auto& [name, field] : kFields)  // from its checkpoint slot, else the work set
      if (exists(name)) a.*field = kept.has(name) ? kept.get(name) : work.get(name);
    kept.check_all_used("layer_activation_specs (kept)");
    a.q = a.q.view({B, T, Hq, Dh});
    a.k = a.k.view({B, T, Hkv, Dh});
    a.v = a.v.view({B, T, Hkv, Dh});
    a.attn = a.attn.view({B, T, Hq, Dh});
  }
  if (cfg_.stage_end() > cfg_.pp_begin) work.check_all_used("layer_activation_specs (work)");
  s.mlp_chunk = mlp_chunk_rows(B, T, opt_.mlp_chunk_tokens);
  s.mlp_kept = opt_.checkpointing == Checkpointing::kNone;
  s.mlp_norm_whole = seam_->splits_rows();
  // The kept tensors of a layer are carved in order from the start of its slot, so copying a
  // slot's first kept_bytes moves them all; the copy views them as 4-byte words whatever their
  // dtypes (every tensor of the arena starts aligned).
  const int64_t kept_floats = int64_t(arena_bytes(specs.kept) / 4);
  s.slot_kept.clear();
  for (int i = 0; i < slots_; ++i)
    s.slot_kept.push_back(
        checkpoints_.view(DType::kF32, {kept_floats}, slot_kept_base + kept_stride_ * i));
  s.host_kept.clear();
  if (!offloaded_.empty()) {  // the host layers', by CheckpointMap::host_index, in the slot's part
    const int host = checkpoint_map_.host_layers();
    for (int i = 0; i < host; ++i)
      s.host_kept.push_back(
          offloaded_.view(DType::kF32, {kept_floats}, kept_stride_ * (size_t(host) * slot_ + i)));
  }
  for (int i = 0; i < slots_; ++i) slot_layer(i) = -1;
}

// The slot's batch inputs and model-level saved tensors, and the backward scratch.
void LlamaModel::bind_model_tensors(StepViews& s, int64_t B, int64_t T) {
  const DType act = opt_.activation_dtype;
  NamedViews saved(activations_.data() + work_bytes_ + saved_bytes_ * slot_, activations_.pool(),
                   model_saved_activations(cfg_, B, T, opt_.checkpointing, act));
  s.in = {saved.get("tokens"), saved.get("targets"), saved.get("positions"), saved.get("seg_start"),
          saved.get("doc_starts")};
  // The final norm's input and output in the last layer's dead work tensors (work_set_aliases;
  // a model of one stage, so one micro-batch slot).
  const WorkSetAliases aliases = work_set_aliases(cfg_, opt_.checkpointing);
  // The last layer's work views; the final norm's aliases exist only on a model of one stage.
  const LayerActs* last = aliases.x_final_in_x_mid || aliases.xn_final_in_q
                              ? &s.layers[size_t(cfg_.stage_end() - 1)]
                              : nullptr;
  const int64_t N = B * T, D = cfg_.dim;
  SHARDLM_CHECK(opt_.pipeline_slots == 1 || !(aliases.x_final_in_x_mid || aliases.xn_final_in_q),
                "a model of one stage runs one micro-batch at a time (pipeline_slots = {})",
                opt_.pipeline_slots);
  s.x_final = aliases.x_final_in_x_mid ? last->x_mid : saved.get("x_final");
  // A stage before the last: its last layer's output (the hidden state to send) is x_final.
  if (!cfg_.holds_head()) s.layers[cfg_.stage_end()].x_in = s.x_final;
  s.xn_final = aliases.xn_final_in_q ? last->q.view({N * cfg_.q_dim()}).rows(0, N * D).view({N, D})
                                     : saved.get("xn_final");
  s.rstd_final = saved.get("rstd_final");
  saved.check_all_used("model_saved_activations");
  bind_transients(s, B, T);
}

// The scratch shared by every slot: the MLP chunk's product, and the backward's.
void LlamaModel::bind_transients(StepViews& s, int64_t B, int64_t T) {
  const int64_t Hq = cfg_.n_heads, Hkv = cfg_.n_kv_heads, Dh = cfg_.head_dim();
  NamedViews tr(transient_.data(), transient_.pool(), transient_specs(B, T));
  Transients& t = s.tr;
  t.ffn_h = tr.get("ffn_h");
  if (!opt_.backward) return tr.check_all_used("backward_transients (forward only)");
  t.d_resid = tr.get("d_resid");
  // Scratch placed in the work set's dead tensors (the same bytes for every layer).
  const WorkSetAliases aliases = work_set_aliases(cfg_, opt_.checkpointing);
  // The stage's first layer's work views (every layer's are the same bytes); aliases exist
  // only on a stage with layers.
  const LayerActs* work = aliases.d_attn_in_x_mid || aliases.d_norm_in_attn
                              ? &s.layers[size_t(cfg_.pp_begin)]
                              : nullptr;
  const int64_t N = B * T, D = cfg_.dim, qd = cfg_.q_dim();
  t.d_norm = aliases.d_norm_in_attn ? work->attn.view({N * qd}).rows(0, N * D).view({N, D})
                                    : tr.get("d_norm");
  t.d_xn2 = aliases.d_norm_in_attn ? tr.get("d_xn2") : Tensor();
  t.d_part = tr.has("d_part") ? tr.get("d_part") : Tensor();
  t.d_post = tr.has("d_post") ? tr.get("d_post") : Tensor();
  t.final_norm_w = tr.has("final_norm_w") ? tr.get("final_norm_w") : Tensor();
  t.d_h = tr.get("d_h");
  t.d_up = tr.get("d_up");
  t.d_attn =
      (aliases.d_attn_in_x_mid ? work->x_mid.view({N * D}).rows(0, N * qd) : tr.get("d_attn"))
          .view({B, T, Hq, Dh});
  t.d_q = tr.get("d_q").view({B, T, Hq, Dh});
  t.d_k = tr.get("d_k").view({B, T, Hkv, Dh});
  t.d_v = tr.get("d_v").view({B, T, Hkv, Dh});
  tr.check_all_used("backward_transients");
}

std::vector<TensorSpec> LlamaModel::transient_specs(int64_t B, int64_t T) const {
  if (!opt_.backward)
    return forward_transients(cfg_, B, T, opt_.mlp_chunk_tokens, opt_.activation_dtype);
  return backward_transients(cfg_, B, T, opt_.mlp_chunk_tokens, opt_.checkpointing,
                             opt_.activation_dtype);
}

}  // namespace shardlm
