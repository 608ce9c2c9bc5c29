// `shardlm convert hf-import` (hf_convert.h): a Hugging Face directory -> a shardlm checkpoint.
#include "shardlm/checkpoint/hf_convert.h"

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "shardlm/backend/backend.h"
#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/checkpoint/model_io.h"
#include "shardlm/core/check.h"
#include "shardlm/hf/hf.h"
#include "shardlm/io/tokenize.h"
#include "shardlm/model/llama.h"

namespace shardlm {

namespace fs = std::filesystem;

std::string hf_import(const std::string& hf_dir, const std::string& checkpoints_dir, DType dtype) {
  const HfModelInfo info = read_hf_config(hf_dir);
  const SafetensorsDir st(hf_dir);
  const std::unique_ptr<Backend> backend = make_backend(DeviceKind::kCpu);
  ModelOptions mopt;
  mopt.param_dtype = dtype;
  const ParamLayout L = make_param_layout(info.config);
  CheckpointWriter w(checkpoints_dir, 0);
  // The directory's tokenizer, when it has one, is the model's (generate decodes with it).
  const std::string tokenizer = find_tokenizer(hf_dir);
  w.add_json("model.json",
             model_to_json(
                 info.config, L, mopt,
                 tokenizer.empty() ? "byte" : fs::absolute(tokenizer).lexically_normal().string()));
  // params.bin unit by unit, in layout order (the units tile the arena): one unit in f32 and,
  // for another dtype, the same unit converted, never the model.
  std::vector<float> values(size_t(L.max_unit));
  std::vector<std::byte> converted(dtype == DType::kF32 ? 0
                                                        : size_t(L.max_unit) * dtype_size(dtype));
  w.begin_file("params.bin");
  int64_t at = 0;
  for (int u = 0; u < int(L.units.size()); ++u) {
    const int64_t n = L.unit_size(u);
    SHARDLM_CHECK(L.units[u].begin == at, "hf-import: {} begins at element {}, not {}",
                  L.unit_name(u), L.units[u].begin, at);
    at += n;
    read_hf_unit(st, L, u, values.data());  // values [n] f32
    st.release_pages();  // the unit's tensors are in `values`: not resident twice over
    if (dtype == DType::kF32) {
      w.append(values.data(), size_t(n) * sizeof(float));
      continue;
    }
    const Tensor dst(converted.data(), dtype, {n}, MemPool::kHost);  // dst [n] in dtype
    backend->convert(Tensor(values.data(), DType::kF32, {n}, MemPool::kHost), dst);
    w.append(dst.data(), dst.bytes());
  }
  SHARDLM_CHECK(at == L.total, "hf-import: the units hold {} of {} elements", at, L.total);
  w.end_file();
  w.add_json("hf_config.json", info.raw);
  return w.commit(0);
}

}  // namespace shardlm
