// shardlm export: a checkpoint as a Hugging Face model directory, or a LoRA checkpoint as a
// PEFT adapter directory or merged into its base model (hf_convert.h).
#include "shardlm/checkpoint/hf_convert.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <vector>

#include "export_source.h"
#include "io/posix_file.h"
#include "peft_adapter.h"
#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/checkpoint/model_io.h"
#include "shardlm/core/check.h"
#include "shardlm/hf/hf.h"
#include "shardlm/model/llama.h"
#include "shardlm/model/lora.h"
#include "shardlm/model/nf4_base.h"

namespace shardlm {

using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

// Where and how the export writes: the directory, the weights' dtype, the architecture asked
// for ("" = the original's or the default) and the safetensors shard size.
struct ExportTarget {
  const std::string& hf_dir;
  DType dtype;
  const std::string& architecture;
  size_t max_shard_bytes;
};

// The base's tokenizer goes with the merged model, so the directory loads on its own.
void copy_base_tokenizer(const std::string& base_dir, const std::string& hf_dir) {
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                           "vocab.json", "merges.txt", "tokenizer.model"}) {
    const fs::path from = fs::path(base_dir) / name;
    std::error_code ec;
    if (fs::exists(from, ec))
      posix::copy_small_file(from.string(), (fs::path(hf_dir) / name).string());
  }
}

void export_merged_lora(const CheckpointReader& ckpt, const StoredModel& stored,
                        const ParamLayout& L, const ExportTarget& target) {
  MergedLoraUnits merged(ckpt, stored, L);
  const std::string arch =
      export_architecture(target.architecture, merged.base().config, stored.config);
  const json config = hf_config_json(stored.config, arch, target.dtype, merged.base().config);
  write_hf_dir(target.hf_dir, L, target.dtype, config, target.max_shard_bytes,
               [&](int u, float* out) { merged.unit(u, out); });
  if (!stored.lora_base.hf_dir.empty()) copy_base_tokenizer(stored.lora_base.hf_dir, target.hf_dir);
}

// A LoRA checkpoint's parameters are the f32 adapters only: a PEFT adapter directory, or
// merged into the base.
void export_lora(const CheckpointReader& ckpt, const StoredModel& stored, const ParamLayout& L,
                 const ExportTarget& target, bool merge) {
  const LoraLayout A = make_lora_layout(stored.config, stored.lora);
  if (ckpt.vector_bytes("params") != size_t(A.params.total) * 4)
    SHARDLM_FAIL(ErrorKind::kData, "{}: the parameters hold {} bytes but the adapters need {}",
                 ckpt.dir(), ckpt.vector_bytes("params"), size_t(A.params.total) * 4);
  if (!merge) {
    write_peft_adapter(ckpt, stored, A, target.hf_dir, target.dtype);
    return;
  }
  export_merged_lora(ckpt, stored, L, target);
}

// The whole model from the parameters (in the checkpoint's param dtype), with the config.json it
// was imported from when it has one.
void export_full_model(const CheckpointReader& ckpt, const StoredModel& stored,
                       const ParamLayout& L, const ExportTarget& target) {
  const size_t psize = dtype_size(stored.param_dtype);
  const size_t want = size_t(L.total) * psize;
  if (ckpt.vector_bytes("params") != want)
    SHARDLM_FAIL(ErrorKind::kData, "{}: the parameters hold {} bytes but the model needs {}",
                 ckpt.dir(), ckpt.vector_bytes("params"), want);
  json original = json::object();
  if (ckpt.has("hf_config.json")) original = ckpt.read_json("hf_config.json");
  const std::string arch = export_architecture(target.architecture, original, stored.config);
  const json config = hf_config_json(stored.config, arch, target.dtype, original);
  std::vector<std::byte> raw;  // [<= kHfExportChunk] stored values of one tensor
  write_hf_dir_streamed(target.hf_dir, L, target.dtype, config, target.max_shard_bytes,
                        [&](const ParamEntry& e, int64_t at, int64_t n, float* out) {
                          read_params_as_f32(ckpt, stored.param_dtype, e.offset + at, n, raw, out);
                        });
}

}  // namespace

void hf_export(const std::string& checkpoint, const std::string& hf_dir, DType dtype,
               const std::string& architecture, size_t max_shard_bytes, bool merge) {
  // The export reads the parameters only: their files and the metadata are verified, the
  // optimizer's state (three times the parameters' bytes with Adam) is not read through.
  const CheckpointReader ckpt(checkpoint, CheckpointReader::Verify::kSizesOnly);
  ckpt.verify_contents_for({"params"});
  const StoredModel stored = read_stored_model(ckpt);
  const ParamLayout L = make_param_layout(stored.config);
  if (merge && !stored.lora.enabled())
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "--merge: {} is not a LoRA checkpoint (it holds the whole model); export it "
                 "without --merge",
                 ckpt.dir());
  const ExportTarget target{hf_dir, dtype, architecture, max_shard_bytes};
  if (stored.lora.enabled())
    export_lora(ckpt, stored, L, target, merge);
  else
    export_full_model(ckpt, stored, L, target);
}

void read_merged_lora_params(const CheckpointReader& ckpt, LlamaModel& model, Backend& backend) {
  const StoredModel stored = read_stored_model(ckpt);
  const ParamLayout& L = model.layout();
  SHARDLM_CHECK(stored.lora.enabled() && !model.lora(),
                "read_merged_lora_params: {} into a model {}", ckpt.dir(),
                stored.lora.enabled() ? "with adapters of its own" : "(not a LoRA checkpoint)");
  const int64_t stored_total = make_param_layout(stored.config).total;
  SHARDLM_CHECK(L.total == stored_total, "{}: its model has {} parameters, the model read into {}",
                ckpt.dir(), stored_total, L.total);
  MergedLoraUnits merged(ckpt, stored, L);
  std::vector<float> unit;  // [one unit] f32
  for (int u = 0; u < int(L.units.size()); ++u) {
    const int64_t n = L.unit_size(u), begin = L.units[u].begin;
    unit.resize(size_t(n));
    merged.unit(u, unit.data());
    backend.convert(Tensor(unit.data(), DType::kF32, {n}, MemPool::kHost),
                    model.params().rows(begin, n));
  }
}

}  // namespace shardlm
