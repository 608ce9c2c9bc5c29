// The PEFT adapter export (peft_adapter.h): one tensor per adapter under PEFT's names, except on
// a base that fuses the gate and up projections (GLM). There PEFT can only adapt gate_up_proj
// [2F, D] (gate rows first) as a whole, and the exact equivalent of shardlm's separate gate and
// up adapters (A_g [r, D], B_g [F, r], A_u, B_u, each scaled by alpha / r) is one adapter of
// rank r' = r per adapter present:
//   A = [A_g; A_u]            [r', D]
//   B = blockdiag(B_g, B_u)   [2F, r']   (a missing adapter's half of the rows is zero)
// since B A x = [B_g A_g x; B_u A_u x]; PEFT scales it by alpha' / r', so alpha' = alpha r' / r,
// written as rank_pattern / alpha_pattern {"gate_up_proj": ...} (PEFT matches a pattern key
// against the end of a module's name, after a dot).
#include "peft_adapter.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <vector>

#include "io/posix_file.h"
#include "shardlm/core/check.h"
#include "shardlm/hf/hf.h"
#include "shardlm/io/safetensors.h"

namespace shardlm {

using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

constexpr int kGate = int(LoraTarget::kGate), kUp = int(LoraTarget::kUp);
constexpr const char* kFusedModule = "gate_up_proj";

// One tensor of the adapter file and how its f32 values are gathered from the adapters' arena.
struct AdapterTensor {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = -1;   // a layout entry's values as they are; -1: GLM's fused gate_up adapter
  int layer = -1;        // the fused adapter's layer
  bool fused_b = false;  // the fused B (else the fused A)
};

// "base_model.model.model.layers.L.mlp.gate_up_proj.lora_A.weight" (or lora_B).
std::string fused_name(int layer, char which) {
  return fmt::format("base_model.model.model.layers.{}.mlp.{}.lora_{}.weight", layer, kFusedModule,
                     which);
}

// The adapters present on the gate and up projections (0, 1 or 2).
int gate_up_adapters(const LoraConfig& lora) {
  return int(lora.has(LoraTarget::kGate)) + int(lora.has(LoraTarget::kUp));
}

// The file's tensors: the layout's entries, each layer's gate and up ones replaced (fuse) by
// the fused A [r', D] and B [2F, r'] where the layer's gate adapter (or up adapter) stood.
std::vector<AdapterTensor> adapter_tensors(const StoredModel& stored, const LoraLayout& A,
                                           bool fuse) {
  const LoraConfig& lora = stored.lora;
  const int64_t r2 = lora.rank * gate_up_adapters(lora);
  const int64_t D = stored.config.dim, F = stored.config.ffn_dim;
  std::vector<AdapterTensor> out;
  for (const ParamEntry& e : A.params.entries) {
    const int l = e.layer;
    const bool gate_up = l >= 0 && [&] {
      for (int t : {kGate, kUp})
        if (A.a[size_t(l)][size_t(t)] == e.offset || A.b[size_t(l)][size_t(t)] == e.offset)
          return true;
      return false;
    }();
    if (!fuse || !gate_up) {
      std::vector<int64_t> shape;
      for (int d = 0; d < e.shape.rank(); ++d) shape.push_back(e.shape[d]);
      out.push_back({e.name, shape, e.offset});
      continue;
    }
    // The layer's first gate/up entry is its first A (targets in order, A then B each): the
    // fused pair goes there, the other entries are covered by it.
    const int first = lora.has(LoraTarget::kGate) ? kGate : kUp;
    if (e.offset != A.a[size_t(l)][size_t(first)]) continue;
    out.push_back({fused_name(l, 'A'), {r2, D}, -1, l, false});
    out.push_back({fused_name(l, 'B'), {2 * F, r2}, -1, l, true});
  }
  return out;
}

// out: the fused A [r', D] or B [2F, r'] of tensor t, from the layer's gate and up adapters.
void gather_fused(const CheckpointReader& ckpt, const StoredModel& stored, const LoraLayout& A,
                  const AdapterTensor& t, std::vector<float>& out) {
  const int64_t r = stored.lora.rank, r2 = t.shape[t.fused_b ? 1 : 0];
  const int64_t D = stored.config.dim, F = stored.config.ffn_dim;
  out.assign(size_t(t.shape[0] * t.shape[1]), 0.f);
  std::vector<float> b;  // [F, r] one adapter's B
  int64_t col = 0;       // the adapter's first rank column in the fused rank r'
  for (int target : {kGate, kUp}) {
    if (!stored.lora.has(LoraTarget(target))) continue;
    const size_t l = size_t(t.layer);
    if (!t.fused_b) {  // its A's rows [col, col + r) of A
      ckpt.read_vector("params", uint64_t(A.a[l][size_t(target)]) * 4, out.data() + col * D,
                       size_t(r * D) * 4);
    } else {  // its B in rows [half, half + F) and columns [col, col + r) of B
      b.resize(size_t(F * r));
      ckpt.read_vector("params", uint64_t(A.b[l][size_t(target)]) * 4, b.data(), b.size() * 4);
      const int64_t half = target == kGate ? 0 : F;
      for (int64_t i = 0; i < F; ++i)
        std::copy_n(b.data() + i * r, r, out.data() + (half + i) * r2 + col);
    }
    col += r;
  }
}

json adapter_config(const StoredModel& stored, bool fuse) {
  const LoraConfig& lora = stored.lora;
  json modules = json::array();
  for (int t = 0; t < kNumLoraTargets; ++t) {
    if (!lora.has(LoraTarget(t))) continue;
    if (!fuse || (t != kGate && t != kUp))
      modules.push_back(lora_module_name(LoraTarget(t)));
    else if (t == (lora.has(LoraTarget::kGate) ? kGate : kUp))
      modules.push_back(kFusedModule);
  }
  json config = {{"peft_type", "LORA"},
                 {"task_type", "CAUSAL_LM"},
                 {"r", lora.rank},
                 {"lora_alpha", lora.alpha},
                 {"lora_dropout", lora.dropout},
                 {"target_modules", modules},
                 {"bias", "none"},
                 {"fan_in_fan_out", false},
                 {"inference_mode", true},
                 {"use_rslora", false},
                 {"base_model_name_or_path", stored.lora_base.hf_dir}};
  if (fuse) {
    const int n = gate_up_adapters(lora);
    config["rank_pattern"] = {{kFusedModule, lora.rank * n}};
    config["alpha_pattern"] = {{kFusedModule, lora.alpha * n}};
  }
  return config;
}

}  // namespace

void write_peft_adapter(const CheckpointReader& ckpt, const StoredModel& stored,
                        const LoraLayout& A, const std::string& dir, DType dtype) {
  const bool fuse = hf_architecture_fuses_gate_up(default_hf_architecture(stored.config)) &&
                    gate_up_adapters(stored.lora) > 0;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) SHARDLM_FAIL(ErrorKind::kConfig, "--output: cannot create '{}': {}", dir, ec.message());
  const std::vector<AdapterTensor> tensors = adapter_tensors(stored, A, fuse);
  const StDType st_dtype = dtype == DType::kBF16 ? StDType::kBF16 : StDType::kF32;
  std::vector<SafetensorsWriter::Decl> decls;
  for (const AdapterTensor& t : tensors) decls.push_back({t.name, st_dtype, t.shape});
  SafetensorsWriter w((fs::path(dir) / "adapter_model.safetensors").string(), decls,
                      {{"format", "pt"}});
  std::vector<float> v;
  std::vector<uint16_t> conv;
  for (const AdapterTensor& t : tensors) {
    if (t.offset >= 0) {
      int64_t n = 1;
      for (int64_t s : t.shape) n *= s;
      v.resize(size_t(n));
      ckpt.read_vector("params", uint64_t(t.offset) * 4, v.data(), v.size() * 4);
    } else {
      gather_fused(ckpt, stored, A, t, v);
    }
    if (dtype == DType::kF32) {
      w.write(t.name, v.data(), v.size() * 4);
    } else {
      conv.resize(v.size());
      for (size_t j = 0; j < v.size(); ++j) conv[j] = f32_to_bf16(v[j]);
      w.write(t.name, conv.data(), conv.size() * 2);
    }
  }
  w.commit();
  posix::replace_file((fs::path(dir) / "adapter_config.json").string(),
                      adapter_config(stored, fuse).dump(2) + "\n");
}

}  // namespace shardlm
