// KvDecoder: the Llama forward of model/llama.cpp restricted to new tokens, with keys and
// values written into a per-layer cache and attention_decode reading it. Same ops in the same
// order as LlamaModel's forward, so logits agree with forward_last_logits to rounding. All
// memory is allocated in the constructor; append() allocates nothing but the logits vector.
#include "shardlm/model/decoder.h"

#include <algorithm>
#include <limits>

namespace shardlm {

// Views of the per-chunk scratch; the first n rows are used for a chunk of n tokens.
struct KvDecoder::Chunk {
  Tensor tokens;     // [C] i32
  Tensor positions;  // [C] i32 absolute positions (RoPE)
  Tensor inv_freq;   // [Dh/2] f32
  Tensor x;          // [C, D] residual stream
  Tensor xn;         // [C, D] norm output
  Tensor rstd;       // [C]
  Tensor q;          // [C, Hq*Dh] after RoPE
  Tensor attn;       // [C, Hq*Dh] attention output, before o_proj
  Tensor proj;       // [C, D] o_proj or down_proj output, added to x
  Tensor gate;       // [C, F]
  Tensor up;         // [C, F]
  Tensor h;          // [C, F] silu(gate) * up
  Tensor norm_w;     // [D] f32 copy of model.norm.weight (bf16 params)
  Tensor logits;     // [1, V]
};

namespace {

std::vector<TensorSpec> chunk_specs(const ModelConfig& cfg, int64_t C) {
  const DType f32 = DType::kF32;
  const int64_t D = cfg.dim, F = cfg.ffn_dim, qd = cfg.q_dim();
  return {{"tokens", DType::kI32, {C}},
          {"positions", DType::kI32, {C}},
          {"inv_freq", f32, {cfg.head_dim() / 2}},
          {"x", f32, {C, D}},
          {"xn", f32, {C, D}},
          {"rstd", f32, {C}},
          {"q", f32, {C, qd}},
          {"attn", f32, {C, qd}},
          {"proj", f32, {C, D}},
          {"gate", f32, {C, F}},
          {"up", f32, {C, F}},
          {"h", f32, {C, F}},
          {"norm_w", f32, {D}},
          {"logits", f32, {1, cfg.vocab_size}}};
}

}  // namespace

KvDecoder::~KvDecoder() = default;

KvDecoder::KvDecoder(LlamaModel& model, Backend& backend, MemoryLedger& ledger, int64_t max_len,
                     int64_t max_chunk)
    : model_(model),
      be_(backend),
      max_len_(max_len),
      max_chunk_(std::min(max_chunk, max_len)),
      positions_host_(std::max<int64_t>(max_chunk_, 0)),
      chunk_(std::make_unique<Chunk>()) {
  const ModelConfig& cfg = model.config();
  SHARDLM_CHECK(max_len >= 1 && max_len <= std::numeric_limits<int32_t>::max(),
                "KvDecoder: max_len = {} must be in [1, 2^31) (i32 positions)", max_len);
  SHARDLM_CHECK(max_chunk >= 1, "KvDecoder: max_chunk = {} must be >= 1", max_chunk);
  const int64_t kvd = cfg.kv_dim();
  const size_t cache_bytes = static_cast<size_t>(cfg.n_layers * max_len * kvd) * sizeof(float);
  k_cache_ = Buffer(backend, ledger, MemCategory::kActivations, MemPool::kDevice, cache_bytes);
  v_cache_ = Buffer(backend, ledger, MemCategory::kActivations, MemPool::kDevice, cache_bytes);

  const std::vector<TensorSpec> specs = chunk_specs(cfg, max_chunk_);
  scratch_ = Buffer(backend, ledger, MemCategory::kWorkspace, MemPool::kDevice, arena_bytes(specs));
  std::vector<Tensor> v;
  size_t off = 0;
  for (const TensorSpec& s : specs) {
    v.push_back(scratch_.view(s.dtype, s.shape, off));
    off += align_up(s.bytes());
  }
  *chunk_ = {v[0], v[1], v[2], v[3],  v[4],  v[5],  v[6],
             v[7], v[8], v[9], v[10], v[11], v[12], v[13]};

  kernel_ws_ = Buffer(
      backend, ledger, MemCategory::kWorkspace, MemPool::kDevice,
      be_.attention_decode_workspace_bytes(1, max_chunk_, max_len, cfg.n_heads, cfg.head_dim()));
  if (model.options().param_dtype != DType::kF32) {
    const int64_t floats = std::max(model.layout().max_layer, cfg.dim);
    staging_ = Buffer(backend, ledger, MemCategory::kWorkspace, MemPool::kDevice,
                      static_cast<size_t>(floats) * sizeof(float));
  }
  const std::vector<float> inv = rope_inv_freq(cfg);
  be_.copy(
      Tensor(const_cast<float*>(inv.data()), DType::kF32, {int64_t(inv.size())}, MemPool::kHost),
      chunk_->inv_freq);
}

void KvDecoder::reset() { len_ = 0; }

Tensor KvDecoder::k_cache(int l) const {
  const int64_t kvd = model_.config().kv_dim();
  return k_cache_.view(DType::kF32, {max_len_, kvd}, size_t(l) * max_len_ * kvd * sizeof(float));
}
Tensor KvDecoder::v_cache(int l) const {
  const int64_t kvd = model_.config().kv_dim();
  return v_cache_.view(DType::kF32, {max_len_, kvd}, size_t(l) * max_len_ * kvd * sizeof(float));
}

void KvDecoder::stage(int64_t begin, int64_t count) {
  if (staged_begin_ == begin && staged_count_ == count) return;
  be_.convert(model_.params().rows(begin, count), staging_.view(DType::kF32, {count}));
  staged_begin_ = begin;
  staged_count_ = count;
}

Tensor KvDecoder::weight(int64_t offset, Shape shape) const {
  const Tensor params = model_.params();
  if (params.dtype() == DType::kF32) {
    return Tensor(static_cast<float*>(params.data()) + offset, DType::kF32, shape, params.pool());
  }
  SHARDLM_CHECK(offset >= staged_begin_ && offset + shape.numel() <= staged_begin_ + staged_count_,
                "weight at {} ({}) is not in the staged block [{}, {})", offset, shape.str(),
                staged_begin_, staged_begin_ + staged_count_);
  return staging_.view(DType::kF32, shape, size_t(offset - staged_begin_) * sizeof(float));
}

void KvDecoder::append(const int32_t* tokens, int64_t n, std::vector<float>& logits_last) {
  SHARDLM_CHECK(n >= 1, "KvDecoder::append: needs at least one token, got {}", n);
  SHARDLM_CHECK(len_ + n <= max_len_,
                "KvDecoder::append: {} tokens after {} cached exceed max_len = {}; reset() and "
                "re-append a shorter window",
                n, len_, max_len_);
  const int64_t V = model_.config().vocab_size;
  for (int64_t i = 0; i < n; ++i) {
    SHARDLM_CHECK_KIND(ErrorKind::kData, tokens[i] >= 0 && tokens[i] < V,
                       "KvDecoder::append: token id {} at {} is outside the vocabulary [0, {})",
                       tokens[i], i, V);
  }
  int64_t last = 0;
  for (int64_t begin = 0; begin < n; begin += max_chunk_) {
    last = std::min(max_chunk_, n - begin);
    run_chunk(tokens + begin, last);
  }
  last_logits(last, logits_last);
}

void KvDecoder::run_chunk(const int32_t* tokens, int64_t n) {
  const Chunk& c = *chunk_;
  for (int64_t i = 0; i < n; ++i) positions_host_[i] = static_cast<int32_t>(len_ + i);
  be_.copy(Tensor(positions_host_.data(), DType::kI32, {n}, MemPool::kHost),
           c.positions.rows(0, n));
  embed(tokens, n);
  for (int l = 0; l < model_.config().n_layers; ++l) layer_forward(l, n);
  len_ += n;
}

// x [n, D] = rows of the embedding table. bf16 tables are converted row by row: exact, and
// much less than staging all V rows for a few tokens.
void KvDecoder::embed(const int32_t* tokens, int64_t n) {
  const Chunk& c = *chunk_;
  const int64_t V = model_.config().vocab_size, D = model_.config().dim;
  const int64_t embed = model_.layout().embed;
  const Tensor params = model_.params();
  if (params.dtype() == DType::kF32) {
    be_.copy(Tensor(const_cast<int32_t*>(tokens), DType::kI32, {n}, MemPool::kHost),
             c.tokens.rows(0, n));
    be_.embedding_forward(c.tokens.rows(0, n), weight(embed, {V, D}), c.x.rows(0, n));
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    be_.convert(params.rows(embed + int64_t(tokens[i]) * D, D), c.x.rows(i, 1).view({D}));
  }
}

void KvDecoder::layer_forward(int l, int64_t n) {
  const ModelConfig& cfg = model_.config();
  const LayerParamOffsets& o = model_.layout().layers[l];
  const int64_t D = cfg.dim, F = cfg.ffn_dim, qd = cfg.q_dim(), kvd = cfg.kv_dim();
  const int64_t Hq = cfg.n_heads, Hkv = cfg.n_kv_heads, Dh = cfg.head_dim();
  const float eps = float(cfg.norm_eps);
  if (model_.params().dtype() != DType::kF32) stage(o.begin, o.end - o.begin);
  auto bias = [&](int64_t off, int64_t size) { return off < 0 ? Tensor() : weight(off, {size}); };

  const Chunk& c = *chunk_;
  const Tensor x = c.x.rows(0, n);                // [n, D]
  const Tensor xn = c.xn.rows(0, n);              // [n, D]
  const Tensor rstd = c.rstd.rows(0, n);          // [n]
  const Tensor q = c.q.rows(0, n);                // [n, Hq*Dh]
  const Tensor attn = c.attn.rows(0, n);          // [n, Hq*Dh]
  const Tensor proj = c.proj.rows(0, n);          // [n, D]
  const Tensor k_new = k_cache(l).rows(len_, n);  // [n, Hkv*Dh]
  const Tensor v_new = v_cache(l).rows(len_, n);  // [n, Hkv*Dh]
  const Tensor positions = c.positions.rows(0, n);

  be_.rmsnorm_forward(x, weight(o.attn_norm, {D}), eps, xn, rstd);
  be_.linear_forward(xn, weight(o.wq, {qd, D}), bias(o.bq, qd), q);
  be_.linear_forward(xn, weight(o.wk, {kvd, D}), bias(o.bk, kvd), k_new);
  be_.linear_forward(xn, weight(o.wv, {kvd, D}), bias(o.bv, kvd), v_new);
  be_.rope_forward(q.view({n, Hq, Dh}), positions, c.inv_freq);
  be_.rope_forward(k_new.view({n, Hkv, Dh}), positions, c.inv_freq);
  be_.attention_decode(q.view({1, n, Hq, Dh}), k_cache(l).view({1, max_len_, Hkv, Dh}),
                       v_cache(l).view({1, max_len_, Hkv, Dh}), len_, attn.view({1, n, Hq, Dh}),
                       {kernel_ws_.data(), kernel_ws_.bytes()});
  be_.linear_forward(attn, weight(o.wo, {D, qd}), Tensor(), proj);
  be_.add(x, proj, x);

  const Tensor gate = c.gate.rows(0, n), up = c.up.rows(0, n), h = c.h.rows(0, n);  // [n, F]
  be_.rmsnorm_forward(x, weight(o.ffn_norm, {D}), eps, xn, rstd);
  be_.linear_forward(xn, weight(o.w_gate, {F, D}), Tensor(), gate);
  be_.linear_forward(xn, weight(o.w_up, {F, D}), Tensor(), up);
  be_.swiglu_forward(gate, up, h);
  be_.linear_forward(h, weight(o.w_down, {D, F}), Tensor(), proj);
  be_.add(x, proj, x);
}

// Final norm and LM head of row n-1 of the last chunk. bf16 heads are staged a block of rows
// at a time through the layer staging buffer, so no [V, D] f32 copy is ever held.
void KvDecoder::last_logits(int64_t n, std::vector<float>& logits) {
  const ModelConfig& cfg = model_.config();
  const ParamLayout& layout = model_.layout();
  const int64_t D = cfg.dim, V = cfg.vocab_size;
  const Chunk& c = *chunk_;
  const Tensor params = model_.params();
  const bool f32 = params.dtype() == DType::kF32;
  const Tensor xn_last = c.xn.rows(0, 1);  // [1, D]
  Tensor norm_w = c.norm_w;                // [D]
  if (f32) {
    norm_w = weight(layout.final_norm, {D});
  } else {
    be_.convert(params.rows(layout.final_norm, D), norm_w);
  }
  be_.rmsnorm_forward(c.x.rows(n - 1, 1), norm_w, float(cfg.norm_eps), xn_last, c.rstd.rows(0, 1));
  if (f32) {
    be_.linear_forward(xn_last, weight(layout.lm_head, {V, D}), Tensor(), c.logits);
  } else {
    const int64_t block = staging_.bytes() / sizeof(float) / D;  // rows per staged block
    float* out = c.logits.f32();
    for (int64_t r0 = 0; r0 < V; r0 += block) {
      const int64_t rows = std::min(block, V - r0);
      stage(layout.lm_head + r0 * D, rows * D);
      be_.linear_forward(xn_last, weight(layout.lm_head + r0 * D, {rows, D}), Tensor(),
                         Tensor(out + r0, DType::kF32, {1, rows}, c.logits.pool()));
    }
  }
  logits.resize(V);
  be_.copy(c.logits, Tensor(logits.data(), DType::kF32, {1, V}, MemPool::kHost));
}

}  // namespace shardlm
