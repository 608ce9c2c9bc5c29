// `shardlm convert hf-import` streams (checkpoint/hf_import.cpp): the checkpoint it writes unit by
// unit is byte for byte the one the import wrote before from a whole LlamaModel (that path is
// kept here as the reference: the model filled unit by unit, write_model, hf_config.json), in
// f32 and bf16, from f32 or bf16 tensors in one safetensors file or in shards, with tied
// embeddings, and from a bitsandbytes NF4 directory (with the venv); and the import's peak
// resident memory does not grow with the model: the same for a model of one layer and one of
// six times the parameters, and below the larger model's size.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "measured_child.h"
#include "shardlm/backend/backend.h"
#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/checkpoint/hf_convert.h"
#include "shardlm/checkpoint/model_io.h"
#include "shardlm/core/ledger.h"
#include "shardlm/hf/hf.h"
#include "shardlm/model/llama.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;

fs::path scratch(const std::string& name) {
  return test::scratch_root() / ("shardlm_hf_import_" + name);
}

ModelConfig small_llama(int64_t dim, int64_t layers, int64_t ffn, bool tied) {
  ModelConfig c;
  c.name = "import-test";
  c.dim = dim;
  c.n_layers = layers;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.ffn_dim = ffn;
  c.vocab_size = 256;
  c.tie_embeddings = tied;
  return c;
}

// A Hugging Face directory of `cfg` with its tensors in `dtype`, sharded at `shard_bytes`:
// element i of the arena is a value of a few hundredths whose low mantissa bits vary (so that
// bf16 rounding matters).
fs::path make_hf_dir(const std::string& name, const ModelConfig& cfg, DType dtype,
                     size_t shard_bytes) {
  const fs::path dir = scratch(name);
  fs::remove_all(dir);
  const ParamLayout L = make_param_layout(cfg);
  write_hf_dir(dir.string(), L, dtype, hf_config_json(cfg, "LlamaForCausalLM", dtype), shard_bytes,
               [&](int u, float* out) {
                 for (int64_t i = L.units[u].begin; i < L.units[u].end; ++i)
                   out[i - L.units[u].begin] = 0.05f * std::sin(0.37f * float(i % 100003) + 1.f);
               });
  return dir;
}

// The import as it was: the whole model in `dtype` in memory, then written.
std::string import_whole_model(const fs::path& hf, const fs::path& out, DType dtype) {
  const HfModelInfo info = read_hf_config(hf.string());
  const SafetensorsDir st(hf.string());
  const std::unique_ptr<Backend> backend = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  ModelOptions mopt;
  mopt.param_dtype = dtype;
  mopt.activations = false;
  LlamaModel model(info.config, mopt, *backend, ledger);
  const ParamLayout& L = model.layout();
  std::vector<float> values(size_t(L.max_unit));
  for (int u = 0; u < int(L.units.size()); ++u) {
    const int64_t n = L.unit_size(u);
    read_hf_unit(st, L, u, values.data());
    const Tensor src(values.data(), DType::kF32, {n}, MemPool::kHost);
    const Tensor dst = model.params().rows(L.units[u].begin, n);
    if (dtype == DType::kF32)
      backend->copy(src, dst);
    else
      backend->convert(src, dst);
  }
  CheckpointWriter w(out.string(), 0);
  write_model(w, model, *backend, "byte");  // the test's directories have no tokenizer
  w.add_json("hf_config.json", info.raw);
  return w.commit(0);
}

// Both imports of `hf` in `dtype`: the same files (manifest included) with the same bytes.
void expect_same_import(const fs::path& hf, DType dtype, const std::string& name) {
  SCOPED_TRACE(name);
  const fs::path want = scratch(name + "_whole"), got = scratch(name + "_streamed");
  fs::remove_all(want);
  fs::remove_all(got);
  const std::string want_step = import_whole_model(hf, want, dtype);
  const std::string got_step = hf_import(hf.string(), got.string(), dtype);
  test::expect_same_files(want_step, got_step);
}

TEST(HfImport, WritesTheCheckpointTheWholeModelImportWrote) {
  const ModelConfig untied = small_llama(64, 2, 160, false), tied = small_llama(64, 3, 96, true);
  const fs::path f32 = make_hf_dir("f32", untied, DType::kF32, size_t{5} << 30);
  const fs::path shards = make_hf_dir("f32_shards", untied, DType::kF32, 40000);
  const fs::path bf16 = make_hf_dir("bf16_tied", tied, DType::kBF16, size_t{5} << 30);
  ASSERT_TRUE(fs::exists(shards / "model.safetensors.index.json"));
  expect_same_import(f32, DType::kF32, "f32_to_f32");
  expect_same_import(f32, DType::kBF16, "f32_to_bf16");
  expect_same_import(shards, DType::kBF16, "shards_to_bf16");
  expect_same_import(bf16, DType::kF32, "bf16_to_f32");
  expect_same_import(bf16, DType::kBF16, "bf16_to_bf16");
}

// A directory bitsandbytes saved in 4 bits imports dequantized, as before.
TEST(HfImport, ABitsandbytesDirectoryImportsAsBefore) {
  const std::string python = test::venv_python("bitsandbytes");
  if (python.empty()) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("bitsandbytes"));
  const fs::path d = scratch("bnb4bit");
  fs::create_directories(d);
  test::run_command(python + " " + test::source_dir() +
                        "/tests/integration/bnb4bit_reference.py make " + d.string(),
                    d / "log.txt", true);
  for (const char* sub : {"nf4", "nf4_dq"}) {
    ASSERT_TRUE(read_hf_config((d / sub).string()).bnb_4bit) << sub;
    expect_same_import(d / sub, DType::kF32, std::string("bnb_") + sub);
  }
}

// `shardlm convert hf-import` in a child process: its exit code and peak resident set.
using Child = test::MeasuredChild;

Child import_measured(const fs::path& hf, const fs::path& out, const fs::path& log) {
  fs::remove_all(out);
  return test::run_measured(
      {"convert", "hf-import", hf.string(), "--output", out.string(), "--dtype", "fp32"}, log);
}

// The import holds one unit in f32 (and, for bf16, converted) plus the safetensors pages of the
// unit it reads, whatever the model. One layer of dim 512 and MLP width 1536 (3.1M parameters)
// against six of width 6144 (63M, 240 MiB in f32): the same peak resident set within kSlack
// (the larger unit, 40 MiB, and its mapped pages add 2 x 30 MiB), where holding the model would
// add its 240 MiB and the previous import's whole model and mapped files more.
TEST(HfImport, PeakMemoryDoesNotGrowWithTheModel) {
  constexpr int64_t kMiB = int64_t{1} << 20;
  constexpr int64_t kSlack = 96 * kMiB;
  const fs::path small =
      make_hf_dir("rss_small", small_llama(512, 1, 1536, false), DType::kF32, size_t{5} << 30);
  const fs::path large =
      make_hf_dir("rss_large", small_llama(512, 6, 6144, false), DType::kF32, size_t{5} << 30);
  const Child a = import_measured(small, scratch("rss_small_ck"), scratch("rss_small.txt"));
  const Child b = import_measured(large, scratch("rss_large_ck"), scratch("rss_large.txt"));
  ASSERT_EQ(a.code, 0) << test::slurp(scratch("rss_small.txt"));
  ASSERT_EQ(b.code, 0) << test::slurp(scratch("rss_large.txt"));
  const int64_t model_bytes = make_param_layout(small_llama(512, 6, 6144, false)).total * 4;
  ::testing::Test::RecordProperty("peak_rss_small_mib", std::to_string(a.peak_rss / kMiB));
  ::testing::Test::RecordProperty("peak_rss_large_mib", std::to_string(b.peak_rss / kMiB));
  EXPECT_LE(b.peak_rss - a.peak_rss, kSlack)
      << b.peak_rss / kMiB << " MiB against " << a.peak_rss / kMiB << " MiB";
  EXPECT_LT(b.peak_rss, model_bytes) << "the import held a whole model's worth";
  const CheckpointReader r(scratch("rss_large_ck").string());
  EXPECT_EQ(r.size("params.bin"), size_t(model_bytes));
  fs::remove_all(scratch("rss_large_ck"));
  fs::remove_all(large);
}

}  // namespace
}  // namespace shardlm
