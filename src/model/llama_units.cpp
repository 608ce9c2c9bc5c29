// LlamaModel's parameter units (llama.h): acquiring a unit's parameters and gradients from the
// ParamStore (and the adapters' from theirs), the staging of the acquired unit into the activation
// dtype when the parameters are stored in another, and the views of one weight (activation dtype)
// or gradient (f32) inside it that the layers compute on.
#include "llama_views.h"

namespace shardlm {

void LlamaModel::acquire(int u) {
  SHARDLM_CHECK(!in_pieces(u), "unit {} is handed out in pieces", u);
  acquire_piece(u, 0);
}

void LlamaModel::release(int u) { release_piece(u, 0); }

void LlamaModel::acquire_grads(int u) {
  SHARDLM_CHECK(!in_pieces(u), "unit {} is handed out in pieces", u);
  acquire_piece_grads(u, 0);
}

void LlamaModel::release_grads(int u) { release_piece_grads(u, 0); }

void LlamaModel::acquire_piece(int u, int k) {
  const UnitPiece& piece = unit_pieces_[u][k];
  unit_params_[u] = in_pieces(u) ? store_->acquire_piece_params(u, k) : store_->acquire_params(u);
  unit_base_[u] = piece.begin;
  if (opt_.param_dtype == opt_.activation_dtype || (staged_ == u && staged_piece_ == k)) return;
  // One unit (or piece) at a time is staged in the activation dtype; its staging is redone at
  // every acquire, because the store may hand it out from another buffer (or with new values).
  be_.convert(unit_params_[u], staging_.view(opt_.activation_dtype, {piece.end - piece.begin}));
  staged_ = u;
  staged_piece_ = k;
}

void LlamaModel::release_piece(int u, int k) {
  if (in_pieces(u))
    store_->release_piece_params(u, k);
  else
    store_->release_params(u);
  unit_params_[u] = Tensor();
  if (staged_ == u) staged_ = -1;
}

void LlamaModel::acquire_piece_grads(int u, int k) {
  if (lora()) return;  // a frozen base has none
  unit_grads_[u] = in_pieces(u) ? store_->acquire_piece_grads(u, k) : store_->acquire_grads(u);
  grad_base_[u] = unit_pieces_[u][k].begin;
}

void LlamaModel::release_piece_grads(int u, int k) {
  if (lora()) return;
  if (in_pieces(u))
    store_->release_piece_grads(u, k);
  else
    store_->release_grads(u);
  unit_grads_[u] = Tensor();
}

void LlamaModel::begin_pass(ParamStore::Pass pass) {
  store_->begin_pass(pass);
  if (adapters_ != nullptr) adapters_->begin_pass(pass);
}

void LlamaModel::end_pass() {
  store_->end_pass();
  if (adapters_ != nullptr) adapters_->end_pass();
}

void LlamaModel::acquire_adapters(int l, bool grads) {
  if (!lora()) return;
  unit_adapters_[l] = adapters_->acquire_params(l);
  if (grads) unit_adapter_grads_[l] = adapters_->acquire_grads(l);
  if (opt_.activation_dtype == DType::kF32) return;
  // The f32 adapters of the one layer in use, in the activation dtype for its GEMMs.
  const Tensor staged = adapter_staging_.view(opt_.activation_dtype, {unit_adapters_[l].numel()});
  be_.convert(unit_adapters_[l], staged);
  unit_adapters_[l] = staged;
}

void LlamaModel::release_adapters(int l, bool grads) {
  if (!lora()) return;
  if (grads) {
    adapters_->release_grads(l);
    unit_adapter_grads_[l] = Tensor();
  }
  adapters_->release_params(l);
  unit_adapters_[l] = Tensor();
}

Tensor LlamaModel::norm_grad(int u, int64_t offset, int64_t D) const {
  if (lora()) return discard_grads_.view(DType::kF32, {D});
  return grad(u, offset, {D});
}

Tensor LlamaModel::weight(int u, int64_t offset, Shape shape) {
  const Tensor& p = unit_params_[u];
  SHARDLM_CHECK(!p.empty(), "unit {} used without being acquired", u);
  const int64_t rel = offset - unit_base_[u];  // in the acquired unit or piece
  SHARDLM_CHECK(rel >= 0 && rel + shape.numel() <= p.numel(),
                "weight at {} is not in the acquired part of unit {}", offset, u);
  const DType act = opt_.activation_dtype;
  if (opt_.param_dtype == act)
    return Tensor(static_cast<std::byte*>(p.data()) + rel * dtype_size(act), act, shape, p.pool());
  SHARDLM_CHECK(staged_ == u, "unit {} is not the staged unit ({})", u, staged_);
  return Tensor(staging_.data() + rel * dtype_size(act), act, shape, staging_.pool());
}

Tensor LlamaModel::grad(int u, int64_t offset, Shape shape) const {
  if (lora()) return Tensor();  // frozen: the kernels skip the weight's gradient
  const Tensor& g = unit_grads_[u];
  SHARDLM_CHECK(!g.empty(), "gradients of unit {} used without being acquired", u);
  const int64_t rel = offset - grad_base_[u];  // in the acquired unit or piece
  SHARDLM_CHECK(rel >= 0 && rel + shape.numel() <= g.numel(),
                "gradient at {} is not in the acquired part of unit {}", offset, u);
  return Tensor(g.f32() + rel, DType::kF32, shape, g.pool());
}

Tensor LlamaModel::final_norm_weight(const StepViews& s) {
  const int64_t D = cfg_.dim;
  const int u = layout_.head_unit;
  if (opt_.param_dtype == opt_.activation_dtype || staged_ == u)
    return weight(u, layout_.final_norm, {D});
  // Another unit staged (the LM head's, acquired after it: tied embeddings): converted into its
  // own transient.
  const Tensor w = s.tr.final_norm_w;  // [D]
  SHARDLM_CHECK_KIND(ErrorKind::kInternal, !w.empty(),
                     "final_norm_weight: unit {} is staged, and backward_transients has no "
                     "final_norm_w for this model (tied embeddings only)",
                     staged_);
  be_.convert(unit_params_[u].rows(layout_.final_norm - unit_base_[u], D), w);
  return w;
}

}  // namespace shardlm
