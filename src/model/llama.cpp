// Llama decoder forward and backward, layer by layer, with explicit saved activations.
// Every buffer is allocated once in the constructor from the layout's size tables; a step
// only takes views, so the steady-state step allocates nothing.
#include "shardlm/model/llama.h"

#include <cmath>
#include <random>

namespace shardlm {

// Views of one layer's saved activations (order and shapes from layer_saved_activations).
struct LlamaModel::LayerActs {
  Tensor x_in;   // [N, D] layer input (residual stream)
  Tensor xn1;    // [N, D] attention-norm output
  Tensor rstd1;  // [N]
  Tensor q;      // [B, T, Hq, Dh] after RoPE
  Tensor k;      // [B, T, Hkv, Dh] after RoPE
  Tensor v;      // [B, T, Hkv, Dh]
  Tensor attn;   // [B, T, Hq, Dh] attention output (before o_proj)
  Tensor lse;    // [B, Hq, T]
  Tensor x_mid;  // [N, D] residual after attention
  Tensor xn2;    // [N, D] ffn-norm output
  Tensor rstd2;  // [N]
  Tensor gate;   // [N, F]
  Tensor up;     // [N, F]
};

// Views of the backward scratch (order and shapes from backward_transients).
struct LlamaModel::Transients {
  Tensor d_resid;  // [N, D] gradient of the residual stream, updated in place
  Tensor d_norm;   // [N, D] gradient of a norm's output
  Tensor d_part;   // [N, D] one consumer's share of d_norm
  Tensor ffn_h;    // [N, F] silu(gate)*up; d_gate in backward
  Tensor d_h;      // [N, F]
  Tensor d_up;     // [N, F]
  Tensor d_attn;   // [B, T, Hq, Dh]
  Tensor d_q;      // [B, T, Hq, Dh]
  Tensor d_k;      // [B, T, Hkv, Dh]
  Tensor d_v;      // [B, T, Hkv, Dh]
};

struct LlamaModel::StepViews {
  int64_t B = 0, T = 0;
  std::vector<LayerActs> layers;  // [n_layers]
  BatchInputs in;
  Tensor x_final;     // [N, D] output of the last layer
  Tensor xn_final;    // [N, D] final norm output (the LM head's input)
  Tensor rstd_final;  // [N]
  Transients tr;
};

namespace {

// Carves the specs' tensors out of `base` in order; returns the views.
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

}  // namespace

// The model's own store: the whole parameter and gradient arenas, in layout order.
class LlamaModel::OwnedStore final : public ParamStore {
 public:
  OwnedStore(const ParamLayout& layout, DType param_dtype, Backend& backend, MemoryLedger& ledger)
      : layout_(layout), dtype_(param_dtype) {
    params_ = Buffer(backend, ledger, MemCategory::kParams, MemPool::kDevice,
                     layout.total * dtype_size(param_dtype));
    grads_ = Buffer(backend, ledger, MemCategory::kGrads, MemPool::kDevice, layout.total * 4);
  }
  Tensor params() const { return params_.view(dtype_, {layout_.total}); }
  Tensor grads() const { return grads_.view(DType::kF32, {layout_.total}); }

  void begin_pass(Pass) override {}
  void end_pass() override {}
  Tensor acquire_params(int u) override {
    return params().rows(layout_.units[u].begin, layout_.unit_size(u));
  }
  void release_params(int) override {}
  Tensor acquire_grads(int u) override {
    return grads().rows(layout_.units[u].begin, layout_.unit_size(u));
  }
  void release_grads(int) override {}

 private:
  const ParamLayout& layout_;
  DType dtype_;
  Buffer params_;  // [total] param dtype (params)
  Buffer grads_;   // [total] f32 (grads)
};

// The model's own attention core: the backend's kernel over the whole sequence, its scratch in
// the model's workspace.
class LlamaModel::LocalAttention final : public AttentionCore {
 public:
  LocalAttention(Backend& backend, const Buffer& workspace) : be_(backend), ws_(workspace) {}
  void forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
               const Tensor& out, const Tensor& lse) override {
    be_.attention_forward(q, k, v, seg_start, out, lse, {ws_.data(), ws_.bytes()});
  }
  void backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& seg_start,
                const Tensor& out, const Tensor& lse, const Tensor& dout, const Tensor& dq,
                const Tensor& dk, const Tensor& dv) override {
    be_.attention_backward(q, k, v, seg_start, out, lse, dout, dq, dk, dv,
                           {ws_.data(), ws_.bytes()});
  }

 private:
  Backend& be_;
  const Buffer& ws_;
};

void initial_weights(const ModelConfig& cfg, const ParamLayout& layout, uint64_t seed,
                     const std::function<void(int unit, const float* values)>& sink) {
  // One generator over the entries in arena order, whatever the units: the values of a unit
  // depend only on the seed and the layout.
  std::mt19937_64 rng(seed);
  std::vector<float> host(layout.max_unit);
  const double std_out = 0.02 / std::sqrt(2.0 * cfg.n_layers);
  size_t e = 0;
  for (int u = 0; u < int(layout.units.size()); ++u) {
    const int64_t begin = layout.units[u].begin, end = layout.units[u].end;
    for (; e < layout.entries.size() && layout.entries[e].offset < end; ++e) {
      const ParamEntry& entry = layout.entries[e];
      float* p = host.data() + (entry.offset - begin);
      const int64_t n = entry.shape.numel();
      const bool is_norm = entry.name.find("norm") != std::string::npos;
      const bool is_bias = entry.name.ends_with(".bias");
      const bool is_out = entry.name.find("o_proj") != std::string::npos ||
                          entry.name.find("down_proj") != std::string::npos;
      std::normal_distribution<float> dist(0.f, is_out ? float(std_out) : 0.02f);
      for (int64_t i = 0; i < n; ++i) p[i] = is_norm ? 1.f : is_bias ? 0.f : dist(rng);
    }
    sink(u, host.data());
  }
}

LlamaModel::~LlamaModel() = default;

LlamaModel::LlamaModel(const ModelConfig& cfg, const ModelOptions& opt, Backend& backend,
                       MemoryLedger& ledger, ParamStore* store, AttentionCore* attention)
    : cfg_(cfg),
      opt_(opt),
      layout_(make_param_layout(cfg)),
      be_(backend),
      ledger_(ledger),
      views_(std::make_unique<StepViews>()) {
  cfg_.validate();
  SHARDLM_CHECK(opt.param_dtype == DType::kF32 || opt.param_dtype == DType::kBF16,
                "parameters must be f32 or bf16");
  const int64_t B = opt.max_batch, T = opt.max_seq;
  if (store == nullptr) {
    owned_ = std::make_unique<OwnedStore>(layout_, opt.param_dtype, backend, ledger);
    store = owned_.get();
  }
  store_ = store;
  unit_params_.resize(layout_.units.size());
  unit_grads_.resize(layout_.units.size());
  if (opt.param_dtype != DType::kF32)
    staging_ =
        Buffer(backend, ledger, MemCategory::kWorkspace, MemPool::kDevice, layout_.max_unit * 4);
  const std::vector<float> inv = rope_inv_freq(cfg_);
  inv_freq_ = Buffer(backend, ledger, MemCategory::kParams, MemPool::kDevice, inv.size() * 4);
  be_.copy(
      Tensor(const_cast<float*>(inv.data()), DType::kF32, {int64_t(inv.size())}, MemPool::kHost),
      inv_freq_.view(DType::kF32, {int64_t(inv.size())}));

  const DType act = DType::kF32;
  layer_stride_ = arena_bytes(layer_saved_activations(cfg_, B, T, act));
  saved_ =
      Buffer(backend, ledger, MemCategory::kActivations, MemPool::kDevice,
             layer_stride_ * cfg.n_layers + arena_bytes(model_saved_activations(cfg_, B, T, act)));
  transient_ = Buffer(backend, ledger, MemCategory::kActivations, MemPool::kDevice,
                      arena_bytes(backward_transients(cfg_, B, T, act)));
  const size_t chunk = std::min<int64_t>(opt.loss_chunk_tokens, B * T);
  const size_t attention_ws =
      attention != nullptr
          ? 0
          : be_.attention_workspace_bytes(B, T, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim());
  workspace_ =
      Buffer(backend, ledger, MemCategory::kWorkspace, MemPool::kDevice,
             std::max(attention_ws, be_.lm_head_loss_workspace_bytes(chunk, cfg.vocab_size)));
  if (attention == nullptr) {
    own_attention_ = std::make_unique<LocalAttention>(backend, workspace_);
    attention = own_attention_.get();
  }
  attention_ = attention;
}

Tensor LlamaModel::params() const {
  SHARDLM_CHECK(owned_ != nullptr, "params(): this model's parameters live in a caller's store");
  return owned_->params();
}

Tensor LlamaModel::grads() const {
  SHARDLM_CHECK(owned_ != nullptr, "grads(): this model's gradients live in a caller's store");
  return owned_->grads();
}

void LlamaModel::init_weights(uint64_t seed) {
  const Tensor p = params();
  initial_weights(cfg_, layout_, seed, [&](int u, const float* values) {
    const int64_t n = layout_.unit_size(u);
    be_.convert(Tensor(const_cast<float*>(values), DType::kF32, {n}, MemPool::kHost),
                p.rows(layout_.units[u].begin, n));
  });
}

void LlamaModel::zero_grads() { be_.zero(grads()); }

const LlamaModel::StepViews& LlamaModel::bind(int64_t B, int64_t T) {
  SHARDLM_CHECK(B >= 1 && B <= opt_.max_batch && T >= 1 && T <= opt_.max_seq,
                "micro-batch {}x{} exceeds the model's buffers ({}x{})", B, T, opt_.max_batch,
                opt_.max_seq);
  StepViews& s = *views_;
  if (s.B == B && s.T == T) return s;
  const DType act = DType::kF32;
  const int64_t Hq = cfg_.n_heads, Hkv = cfg_.n_kv_heads, Dh = cfg_.head_dim();
  const auto layer_specs = layer_saved_activations(cfg_, B, T, act);
  s.layers.resize(cfg_.n_layers);
  for (int l = 0; l < cfg_.n_layers; ++l) {
    auto v = carve(saved_.data() + layer_stride_ * l, saved_.pool(), layer_specs);
    s.layers[l] = {v[0],
                   v[1],
                   v[2],
                   v[3].view({B, T, Hq, Dh}),
                   v[4].view({B, T, Hkv, Dh}),
                   v[5].view({B, T, Hkv, Dh}),
                   v[6].view({B, T, Hq, Dh}),
                   v[7],
                   v[8],
                   v[9],
                   v[10],
                   v[11],
                   v[12]};
  }
  auto m = carve(saved_.data() + layer_stride_ * cfg_.n_layers, saved_.pool(),
                 model_saved_activations(cfg_, B, T, act));
  s.in = {m[0], m[1], m[2], m[3]};
  s.x_final = m[4];
  s.xn_final = m[5];
  s.rstd_final = m[6];
  auto t = carve(transient_.data(), transient_.pool(), backward_transients(cfg_, B, T, act));
  s.tr = {t[0],
          t[1],
          t[2],
          t[3],
          t[4],
          t[5],
          t[6].view({B, T, Hq, Dh}),
          t[7].view({B, T, Hq, Dh}),
          t[8].view({B, T, Hkv, Dh}),
          t[9].view({B, T, Hkv, Dh})};
  s.B = B;
  s.T = T;
  return s;
}

BatchInputs LlamaModel::inputs(int64_t B, int64_t T) { return bind(B, T).in; }

void LlamaModel::acquire(int u) {
  unit_params_[u] = store_->acquire_params(u);
  if (opt_.param_dtype == DType::kF32 || staged_ == u) return;
  // bf16: one unit at a time is staged in f32; a unit's staging is redone at every acquire,
  // because the store may hand out the unit from another buffer (or with new values).
  const int64_t n = layout_.unit_size(u);
  be_.convert(unit_params_[u], staging_.view(DType::kF32, {n}));
  staged_ = u;
}

void LlamaModel::release(int u) {
  store_->release_params(u);
  unit_params_[u] = Tensor();
  if (staged_ == u) staged_ = -1;
}

void LlamaModel::acquire_grads(int u) { unit_grads_[u] = store_->acquire_grads(u); }

void LlamaModel::release_grads(int u) {
  store_->release_grads(u);
  unit_grads_[u] = Tensor();
}

Tensor LlamaModel::weight(int u, int64_t offset, Shape shape) {
  const int64_t rel = offset - layout_.units[u].begin;
  SHARDLM_CHECK(rel >= 0 && rel + shape.numel() <= layout_.unit_size(u),
                "weight at {} is not in unit {}", offset, u);
  if (opt_.param_dtype == DType::kF32) {
    const Tensor& p = unit_params_[u];
    SHARDLM_CHECK(!p.empty(), "unit {} used without being acquired", u);
    return Tensor(p.f32() + rel, DType::kF32, shape, p.pool());
  }
  SHARDLM_CHECK(staged_ == u, "unit {} is not the staged unit ({})", u, staged_);
  return Tensor(staging_.data() + rel * 4, DType::kF32, shape, staging_.pool());
}

Tensor LlamaModel::grad(int u, int64_t offset, Shape shape) const {
  const Tensor& g = unit_grads_[u];
  SHARDLM_CHECK(!g.empty(), "gradients of unit {} used without being acquired", u);
  const int64_t rel = offset - layout_.units[u].begin;
  return Tensor(g.f32() + rel, DType::kF32, shape, g.pool());
}

Tensor LlamaModel::final_norm_weight(const StepViews& s) {
  const int64_t D = cfg_.dim;
  const int u = layout_.head_unit;
  if (opt_.param_dtype == DType::kF32 || staged_ == u) return weight(u, layout_.final_norm, {D});
  // bf16 with another unit staged (the tied LM head): converted into the first row of d_part,
  // which is idle whenever the final norm runs (after the last layer's forward, and before
  // the first layer's backward).
  const Tensor w = s.tr.d_part.rows(0, 1).view({D});
  be_.convert(unit_params_[u].rows(layout_.final_norm - layout_.units[u].begin, D), w);
  return w;
}

void LlamaModel::layer_forward(int l, const StepViews& s) {
  const auto& o = layout_.layers[l];
  const int u = l + 1;  // the layer's unit; the caller has acquired it
  const int64_t N = s.B * s.T, D = cfg_.dim, F = cfg_.ffn_dim, qd = cfg_.q_dim(),
                kvd = cfg_.kv_dim();
  const int64_t Hq = cfg_.n_heads, Hkv = cfg_.n_kv_heads, Dh = cfg_.head_dim();
  const LayerActs& a = s.layers[l];
  const Tensor inv_freq = inv_freq_.view(DType::kF32, {Dh / 2});
  auto bias = [&](int64_t off, int64_t n) { return off < 0 ? Tensor() : weight(u, off, {n}); };

  be_.rmsnorm_forward(a.x_in, weight(u, o.attn_norm, {D}), float(cfg_.norm_eps), a.xn1, a.rstd1);
  be_.linear_forward(a.xn1, weight(u, o.wq, {qd, D}), bias(o.bq, qd), a.q.view({N, qd}));
  be_.linear_forward(a.xn1, weight(u, o.wk, {kvd, D}), bias(o.bk, kvd), a.k.view({N, kvd}));
  be_.linear_forward(a.xn1, weight(u, o.wv, {kvd, D}), bias(o.bv, kvd), a.v.view({N, kvd}));
  be_.rope_forward(a.q.view({N, Hq, Dh}), s.in.positions, inv_freq);
  be_.rope_forward(a.k.view({N, Hkv, Dh}), s.in.positions, inv_freq);
  attention_->forward(a.q, a.k, a.v, s.in.seg_start.view({s.B, s.T}), a.attn, a.lse);
  // x_mid = x_in + attn Wo^T
  be_.linear_forward(a.attn.view({N, qd}), weight(u, o.wo, {D, qd}), Tensor(), a.x_mid);
  be_.add(a.x_mid, a.x_in, a.x_mid);

  be_.rmsnorm_forward(a.x_mid, weight(u, o.ffn_norm, {D}), float(cfg_.norm_eps), a.xn2, a.rstd2);
  be_.linear_forward(a.xn2, weight(u, o.w_gate, {F, D}), Tensor(), a.gate);
  be_.linear_forward(a.xn2, weight(u, o.w_up, {F, D}), Tensor(), a.up);
  be_.swiglu_forward(a.gate, a.up, s.tr.ffn_h);
  // The output is the next layer's input, or x_final after the last layer.
  const Tensor out = l + 1 < cfg_.n_layers ? s.layers[l + 1].x_in : s.x_final;
  be_.linear_forward(s.tr.ffn_h, weight(u, o.w_down, {D, F}), Tensor(), out);
  be_.add(out, a.x_mid, out);
}

void LlamaModel::forward_layers(int64_t B, int64_t T) {
  const StepViews& s = bind(B, T);
  acquire(0);
  be_.embedding_forward(s.in.tokens, weight(0, layout_.embed, {cfg_.vocab_size, cfg_.dim}),
                        s.layers[0].x_in);
  release(0);
  for (int l = 0; l < cfg_.n_layers; ++l) {
    acquire(l + 1);
    layer_forward(l, s);
    release(l + 1);
  }
}

LossResult LlamaModel::forward_loss(int64_t B, int64_t T) {
  store_->begin_pass(ParamStore::Pass::kForward);
  forward_layers(B, T);
  const StepViews& s = bind(B, T);
  const int h = layout_.head_unit, lm = layout_.lm_head_unit;
  acquire(h);
  be_.rmsnorm_forward(s.x_final, final_norm_weight(s), float(cfg_.norm_eps), s.xn_final,
                      s.rstd_final);
  if (lm != h) acquire(lm);
  const int64_t chunk = std::min<int64_t>(opt_.loss_chunk_tokens, B * T);
  const LossResult loss =
      be_.lm_head_loss(s.xn_final, weight(lm, layout_.lm_head, {cfg_.vocab_size, cfg_.dim}),
                       s.in.targets, chunk, 0.f, Tensor(), Tensor(), workspace());
  if (lm != h) release(lm);
  release(h);
  store_->end_pass();
  return loss;
}

void LlamaModel::layer_backward(int l, const StepViews& s) {
  const auto& o = layout_.layers[l];
  const int u = l + 1;  // the caller has acquired the unit's parameters and gradients
  const int64_t N = s.B * s.T, D = cfg_.dim, F = cfg_.ffn_dim, qd = cfg_.q_dim(),
                kvd = cfg_.kv_dim();
  const int64_t Hq = cfg_.n_heads, Hkv = cfg_.n_kv_heads, Dh = cfg_.head_dim();
  const LayerActs& a = s.layers[l];
  const Transients& t = s.tr;
  const Tensor inv_freq = inv_freq_.view(DType::kF32, {Dh / 2});
  auto bgrad = [&](int64_t off, int64_t n) { return off < 0 ? Tensor() : grad(u, off, {n}); };

  // MLP: out = x_mid + down(silu(gate) * up); d_resid holds d(out) and becomes d(x_mid).
  be_.swiglu_forward(a.gate, a.up, t.ffn_h);  // recompute h instead of saving it
  be_.linear_backward(t.ffn_h, weight(u, o.w_down, {D, F}), t.d_resid, t.d_h,
                      grad(u, o.w_down, {D, F}), Tensor());
  const Tensor d_gate = t.ffn_h;  // h is dead once d(w_down) is done
  be_.swiglu_backward(a.gate, a.up, t.d_h, d_gate, t.d_up);
  be_.linear_backward(a.xn2, weight(u, o.w_gate, {F, D}), d_gate, t.d_norm,
                      grad(u, o.w_gate, {F, D}), Tensor());
  be_.linear_backward(a.xn2, weight(u, o.w_up, {F, D}), t.d_up, t.d_part, grad(u, o.w_up, {F, D}),
                      Tensor());
  be_.add(t.d_norm, t.d_part, t.d_norm);
  be_.rmsnorm_backward(a.x_mid, weight(u, o.ffn_norm, {D}), a.rstd2, t.d_norm, t.d_resid,
                       grad(u, o.ffn_norm, {D}));

  // Attention: x_mid = x_in + o_proj(attn(rope(q), rope(k), v)); d_resid becomes d(x_in).
  be_.linear_backward(a.attn.view({N, qd}), weight(u, o.wo, {D, qd}), t.d_resid,
                      t.d_attn.view({N, qd}), grad(u, o.wo, {D, qd}), Tensor());
  attention_->backward(a.q, a.k, a.v, s.in.seg_start.view({s.B, s.T}), a.attn, a.lse, t.d_attn,
                       t.d_q, t.d_k, t.d_v);
  be_.rope_backward(t.d_q.view({N, Hq, Dh}), s.in.positions, inv_freq);
  be_.rope_backward(t.d_k.view({N, Hkv, Dh}), s.in.positions, inv_freq);
  be_.linear_backward(a.xn1, weight(u, o.wq, {qd, D}), t.d_q.view({N, qd}), t.d_norm,
                      grad(u, o.wq, {qd, D}), bgrad(o.bq, qd));
  be_.linear_backward(a.xn1, weight(u, o.wk, {kvd, D}), t.d_k.view({N, kvd}), t.d_part,
                      grad(u, o.wk, {kvd, D}), bgrad(o.bk, kvd));
  be_.add(t.d_norm, t.d_part, t.d_norm);
  be_.linear_backward(a.xn1, weight(u, o.wv, {kvd, D}), t.d_v.view({N, kvd}), t.d_part,
                      grad(u, o.wv, {kvd, D}), bgrad(o.bv, kvd));
  be_.add(t.d_norm, t.d_part, t.d_norm);
  be_.rmsnorm_backward(a.x_in, weight(u, o.attn_norm, {D}), a.rstd1, t.d_norm, t.d_resid,
                       grad(u, o.attn_norm, {D}));
}

LossResult LlamaModel::forward_backward(int64_t B, int64_t T, float grad_scale) {
  store_->begin_pass(ParamStore::Pass::kForward);
  forward_layers(B, T);
  const StepViews& s = bind(B, T);
  const int64_t V = cfg_.vocab_size, D = cfg_.dim;
  const int h = layout_.head_unit, lm = layout_.lm_head_unit;
  acquire(h);
  be_.rmsnorm_forward(s.x_final, final_norm_weight(s), float(cfg_.norm_eps), s.xn_final,
                      s.rstd_final);
  release(h);
  store_->end_pass();

  store_->begin_pass(ParamStore::Pass::kBackward);
  // The fused head + loss gives d(xn_final) directly. Tied embeddings: unit 0's gradients
  // stay acquired from here to the embedding backward at the end.
  acquire(h);
  acquire_grads(h);
  if (lm != h) {
    acquire(lm);
    acquire_grads(lm);
  }
  const int64_t chunk = std::min<int64_t>(opt_.loss_chunk_tokens, B * T);
  const LossResult loss =
      be_.lm_head_loss(s.xn_final, weight(lm, layout_.lm_head, {V, D}), s.in.targets, chunk,
                       grad_scale, s.tr.d_norm, grad(lm, layout_.lm_head, {V, D}), workspace());
  if (lm != h) release(lm);
  be_.zero(s.tr.d_resid);
  be_.rmsnorm_backward(s.x_final, final_norm_weight(s), s.rstd_final, s.tr.d_norm, s.tr.d_resid,
                       grad(h, layout_.final_norm, {D}));
  release_grads(h);
  release(h);
  for (int l = cfg_.n_layers - 1; l >= 0; --l) {
    acquire(l + 1);
    acquire_grads(l + 1);
    layer_backward(l, s);
    release_grads(l + 1);
    release(l + 1);
  }
  if (lm == h) acquire_grads(0);
  be_.embedding_backward(s.in.tokens, s.tr.d_resid, grad(0, layout_.embed, {V, D}));
  release_grads(0);
  store_->end_pass();
  return loss;
}

void LlamaModel::forward_last_logits(int64_t T, std::vector<float>& logits) {
  store_->begin_pass(ParamStore::Pass::kForward);
  forward_layers(1, T);
  const StepViews& s = bind(1, T);
  const int64_t V = cfg_.vocab_size, D = cfg_.dim;
  const int h = layout_.head_unit, lm = layout_.lm_head_unit;
  acquire(h);
  be_.rmsnorm_forward(s.x_final, final_norm_weight(s), float(cfg_.norm_eps), s.xn_final,
                      s.rstd_final);
  if (lm != h) acquire(lm);
  // The backward scratch is idle during inference: it holds the [1, V] logits.
  SHARDLM_CHECK(transient_.bytes() >= size_t(V) * 4, "transient area too small for logits");
  const Tensor out = transient_.view(DType::kF32, {1, V});
  be_.linear_forward(s.xn_final.rows(T - 1, 1), weight(lm, layout_.lm_head, {V, D}), Tensor(), out);
  if (lm != h) release(lm);
  release(h);
  store_->end_pass();
  logits.resize(V);
  be_.copy(out, Tensor(logits.data(), DType::kF32, {1, V}, MemPool::kHost));
}

}  // namespace shardlm
