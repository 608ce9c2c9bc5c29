// LoRA adapters' size tables, target names and PEFT initialisation (see lora.h).
#include "shardlm/model/lora.h"

#include <algorithm>
#include <cmath>
#include <random>

#include "shardlm/core/check.h"
#include "shardlm/model/tensor_shard.h"

namespace shardlm {
namespace {

constexpr const char* kTargetNames[kNumLoraTargets] = {"q", "k", "v", "o", "gate", "up", "down"};
constexpr const char* kModulePaths[kNumLoraTargets] = {
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj",    "mlp.up_proj",      "mlp.down_proj"};

std::string trim(const std::string& s) {
  const size_t a = s.find_first_not_of(" \t"), b = s.find_last_not_of(" \t");
  return a == std::string::npos ? "" : s.substr(a, b - a + 1);
}

}  // namespace

std::string lora_target_name(LoraTarget t) { return kTargetNames[int(t)]; }
std::string lora_module_name(LoraTarget t) { return lora_target_name(t) + "_proj"; }
std::string lora_module_path(LoraTarget t) { return kModulePaths[int(t)]; }

uint32_t lora_targets_from_string(const std::string& text) {
  uint32_t mask = 0;
  size_t at = 0;
  while (at <= text.size()) {
    const size_t comma = std::min(text.find(',', at), text.size());
    const std::string name = trim(text.substr(at, comma - at));
    at = comma + 1;
    if (name.empty()) continue;
    if (name == "all" || name == "all-linear") {
      mask |= (1u << kNumLoraTargets) - 1;
      continue;
    }
    int found = -1;
    for (int t = 0; t < kNumLoraTargets; ++t)
      if (name == kTargetNames[t] || name == lora_module_name(LoraTarget(t))) found = t;
    if (found < 0)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "lora.targets: unknown projection '{}'; use names from q, k, v, o, gate, up, "
                   "down (or PEFT's q_proj, ..., down_proj, or \"all\"), separated by commas, "
                   "e.g. \"q,k,v,o\"",
                   name);
    mask |= 1u << found;
  }
  return mask;
}

std::string lora_targets_string(uint32_t targets) {
  std::string out;
  for (int t = 0; t < kNumLoraTargets; ++t) {
    if (!((targets >> t) & 1u)) continue;
    if (!out.empty()) out += ',';
    out += kTargetNames[t];
  }
  return out;
}

int64_t lora_in_features(const ModelConfig& c, LoraTarget t) {
  switch (t) {
    case LoraTarget::kO:
      return c.q_dim();
    case LoraTarget::kDown:
      return c.ffn_dim;
    default:
      return c.dim;
  }
}

int64_t lora_out_features(const ModelConfig& c, LoraTarget t) {
  switch (t) {
    case LoraTarget::kQ:
      return c.q_dim();
    case LoraTarget::kK:
    case LoraTarget::kV:
      return c.kv_dim();
    case LoraTarget::kGate:
    case LoraTarget::kUp:
      return c.ffn_dim;
    default:
      return c.dim;
  }
}

LoraLayout make_lora_layout(const ModelConfig& c, const LoraConfig& lora) {
  SHARDLM_CHECK(lora.rank > 0 && lora.targets != 0, "make_lora_layout: LoRA is off");
  LoraLayout out;
  ParamLayout& L = out.params;
  const int64_t r = lora.rank;
  int64_t off = 0;
  for (int l = 0; l < c.n_layers; ++l) {
    std::array<int64_t, kNumLoraTargets> a, b;
    a.fill(-1);
    b.fill(-1);
    const int64_t begin = off;
    const std::string p = "base_model.model.model.layers." + std::to_string(l) + ".";
    for (int t = 0; t < kNumLoraTargets; ++t) {
      // A pipeline stage's adapters: its own layers', the others' units empty.
      if (!lora.has(LoraTarget(t)) || !c.holds_layer(l)) continue;
      const int64_t in = lora_in_features(c, LoraTarget(t)),
                    o = lora_out_features(c, LoraTarget(t));
      const std::string m = p + kModulePaths[t];
      a[t] = off;
      L.entries.push_back({m + ".lora_A.weight", Shape{r, in}, off, l, true});
      off += r * in;
      b[t] = off;
      L.entries.push_back({m + ".lora_B.weight", Shape{o, r}, off, l, true});
      off += o * r;
    }
    L.units.push_back({begin, off});
    L.max_layer = std::max(L.max_layer, off - begin);
    out.a.push_back(a);
    out.b.push_back(b);
  }
  L.total = off;
  L.head_unit = int(L.units.size()) - 1;
  L.lm_head_unit = -1;
  L.adapters = true;
  for (int u = 0; u < int(L.units.size()); ++u) L.max_unit = std::max(L.max_unit, L.unit_size(u));
  return out;
}

std::vector<ShardPiece> lora_stage_pieces(const LoraLayout& whole, const LoraLayout& stage) {
  const ParamLayout &W = whole.params, &S = stage.params;
  SHARDLM_CHECK(W.units.size() == S.units.size(),
                "lora_stage_pieces: the stage's adapter arena has {} units, the whole model's {}",
                S.units.size(), W.units.size());
  std::vector<ShardPiece> pieces;
  for (int u = 0; u < int(S.units.size()); ++u) {
    if (S.unit_size(u) == 0) continue;  // another stage's layer
    SHARDLM_CHECK(S.unit_size(u) == W.unit_size(u),
                  "lora_stage_pieces: layer {}'s adapters hold {} elements on the stage, {} whole",
                  u, S.unit_size(u), W.unit_size(u));
    pieces.push_back({W.units[u].begin, S.units[u].begin, S.unit_size(u)});
  }
  return pieces;
}

std::vector<TensorSpec> lora_transients(const ModelConfig& c, const LoraConfig& lora, int64_t B,
                                        int64_t T, DType act) {
  const int64_t N = B * T;
  int64_t max_in = 0;
  for (int t = 0; t < kNumLoraTargets; ++t)
    if (lora.has(LoraTarget(t))) max_in = std::max(max_in, lora_in_features(c, LoraTarget(t)));
  // The update's [N, out] output and [N, in] input gradient are accumulated into the base
  // projection's y and dx by the GEMMs themselves; only with dropout is the input gradient
  // masked before it is added.
  std::vector<TensorSpec> s;
  s.push_back({"lora_u", act, {N, lora.rank}});   // alpha/r * dropout(x) A^T
  s.push_back({"lora_du", act, {N, lora.rank}});  // its gradient
  if (lora.dropout > 0) {
    s.push_back({"lora_dx", act, {N, max_in}});  // the update's input gradient, before its mask
    s.push_back({"lora_x", act, {N, max_in}});   // the dropped-out input
  }
  return s;
}

void initial_lora_weights(const ModelConfig& c, const LoraConfig& lora, const LoraLayout& layout,
                          uint64_t seed,
                          const std::function<void(int unit, const float* values)>& sink) {
  std::mt19937_64 rng(seed);
  const ParamLayout& L = layout.params;
  std::vector<float> host(size_t(L.max_unit));
  for (int u = 0; u < int(L.units.size()); ++u) {
    std::fill(host.begin(), host.end(), 0.f);
    for (int t = 0; t < kNumLoraTargets; ++t) {
      if (layout.a[u][t] < 0) continue;
      const int64_t in = lora_in_features(c, LoraTarget(t));
      const float bound = float(1.0 / std::sqrt(double(in)));
      std::uniform_real_distribution<float> dist(-bound, bound);
      float* a = host.data() + (layout.a[u][t] - L.units[u].begin);
      for (int64_t i = 0; i < lora.rank * in; ++i) a[i] = dist(rng);
    }
    sink(u, host.data());
  }
}

void merge_lora_layer(const ModelConfig& c, const LoraConfig& lora, const LoraLayout& layout,
                      const ParamLayout& base, int l, const float* adapters, float* base_unit) {
  const LayerParamOffsets& o = base.layers[l];
  const int64_t w_off[kNumLoraTargets] = {o.wq, o.wk, o.wv, o.wo, o.w_gate, o.w_up, o.w_down};
  const int64_t r = lora.rank, a_begin = layout.params.units[l].begin;
  const double s = lora.alpha / double(lora.rank);
  for (int t = 0; t < kNumLoraTargets; ++t) {
    if (layout.a[l][t] < 0) continue;
    const int64_t in = lora_in_features(c, LoraTarget(t)),
                  out = lora_out_features(c, LoraTarget(t));
    const float* A = adapters + (layout.a[l][t] - a_begin);   // [r, in]
    const float* Bm = adapters + (layout.b[l][t] - a_begin);  // [out, r]
    float* W = base_unit + (w_off[t] - o.begin);              // [out, in]
    for (int64_t i = 0; i < out; ++i)
      for (int64_t j = 0; j < in; ++j) {
        double acc = 0;
        for (int64_t k = 0; k < r; ++k) acc += double(Bm[i * r + k]) * A[k * in + j];
        W[i * in + j] = float(double(W[i * in + j]) + s * acc);
      }
  }
}

}  // namespace shardlm
