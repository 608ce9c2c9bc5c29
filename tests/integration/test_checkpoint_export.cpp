// What a sharded checkpoint gives outside training, through the binary: the Hugging Face
// export, `shardlm generate` and the end-of-run samples of a checkpoint written by 2 and 4 ranks
// (ZeRO-3, tp x ZeRO-3, tp x pp) are the one-rank checkpoint's, byte for byte and token for
// token; export and generate verify the parameters they read and nothing else; and the export
// streams the parameters, so that its peak resident memory does not grow with the model.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "measured_child.h"
#include "tiny_runs.h"

namespace {

namespace fs = std::filesystem;
using shardlm::test::slurp;

constexpr int64_t kMiB = int64_t(1) << 20;

fs::path scratch(const std::string& name) {
  return shardlm::test::scratch_root() / ("shardlm_export_" + name);
}

fs::path step_dir(const fs::path& run, int step) {
  return run / "checkpoints" / fmt::format("step_{:08d}", step);
}

using Child = shardlm::test::MeasuredChild;
using shardlm::test::run_measured;

Child export_hf(const fs::path& checkpoint, const fs::path& to, const std::string& dtype,
                const std::string& max_shard_gb = "5") {
  fs::remove_all(to);
  const Child c = run_measured({"convert", "hf-export", checkpoint.string(), "--output",
                                to.string(), "--dtype", dtype, "--max-shard-size", max_shard_gb},
                               to.string() + ".txt");
  EXPECT_EQ(c.code, 0) << slurp(to.string() + ".txt");
  return c;
}

// The same files with the same bytes in both directories.
void expect_same_dir(const fs::path& got, const fs::path& want) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(want)) names.push_back(e.path().filename());
  ASSERT_FALSE(names.empty()) << want;
  size_t got_files = 0;
  for (const auto& e : fs::directory_iterator(got)) got_files += e.is_regular_file() ? 1 : 0;
  EXPECT_EQ(got_files, names.size()) << got;
  for (const std::string& name : names)
    EXPECT_TRUE(slurp(got / name) == slurp(want / name)) << got / name << " differs from " << want;
}

std::string generate(const fs::path& checkpoint, const fs::path& out) {
  const Child c = run_measured({"generate", "--checkpoint", checkpoint.string(), "--prompt",
                                "And God", "--max-new-tokens", "32", "--seed", "7"},
                               out);
  EXPECT_EQ(c.code, 0) << slurp(out);
  return slurp(out);
}

// The end-of-run samples of a run's output (rank 0 prints them last).
std::string samples_of(const fs::path& out) {
  const std::string text = slurp(out);
  const size_t at = text.find("\n--- sample 1 ---");
  EXPECT_NE(at, std::string::npos) << text;
  return at == std::string::npos ? "" : text.substr(at);
}

// The end-of-run sample ran in the memory its plan gave it, on rank 0 with the training buffers
// released (memory_rank0.json's "sample").
void expect_sample_as_planned(const fs::path& run) {
  const nlohmann::json report = nlohmann::json::parse(slurp(run / "memory_rank0.json"));
  ASSERT_TRUE(report.contains("sample")) << run;
  const nlohmann::json& sample = report["sample"];
  EXPECT_EQ(sample["peak_by_category"], sample["planned"]["peak_by_category"]);
  EXPECT_EQ(sample["peak_bytes"], sample["planned"]["peak_bytes"]);
  EXPECT_GT(sample["peak_bytes"]["device"].get<int64_t>(), 0);
  EXPECT_EQ(sample["training_device_bytes_held"].get<int64_t>(), 0);
}

struct Grid {
  std::string name;
  int ranks, micro, accum;
  std::string sets;
};

// The one-rank run's step-10 checkpoint, resumed on each grid for one step at a vanishing
// learning rate: the step-11 checkpoint the grid's ranks write holds the step-10 parameters bit
// for bit (test_sharded_checkpoint), so everything read from it must be what the one-rank
// checkpoint gives. The global batch is 8 sequences throughout.
TEST(CheckpointExport, ShardedCheckpointsExportGenerateAndSampleAsOneRank) {
  const fs::path one = shardlm::test::train_tiny(1, 4, 2, "shardlm_export_one", 10);
  const fs::path one_ck = step_dir(one, 10);
  const std::string still = " --set train.lr=1e-30 --set train.min_lr=0 --set sample.count=1 ";
  // The reference samples: the same resumed step on one rank, from its final checkpoint.
  const auto resume = [&](const Grid& g, const std::string& more) {
    const fs::path dir = shardlm::test::scratch_root() / ("shardlm_export_" + g.name);
    fs::remove_all(dir);
    fs::create_directories(dir);
    fs::copy(one, dir / "run", fs::copy_options::recursive);
    return shardlm::test::train_tiny(g.ranks, g.micro, g.accum, "shardlm_export_" + g.name, 11,
                                     false, g.sets + still + more);
  };
  const fs::path ref = resume({"ref", 1, 4, 2, ""}, "");
  const std::string ref_samples = samples_of(ref.parent_path() / "out.txt");
  expect_sample_as_planned(ref);

  // Several safetensors shards (and the index) as well as one file.
  export_hf(one_ck, scratch("one_f32"), "fp32");
  export_hf(one_ck, scratch("one_bf16"), "bf16", "0.0002");
  const std::string one_text = generate(one_ck, scratch("one_generate.txt"));
  for (const Grid& g : {Grid{"dp2z3", 2, 2, 2, "--set zero.stage=3 "},
                        Grid{"tp2dp2z3", 4, 2, 2, "--set parallel.tp=2 --set zero.stage=3 "},
                        Grid{"tp2pp2", 4, 4, 2, "--set parallel.tp=2 --set parallel.pp=2 "}}) {
    SCOPED_TRACE(g.name);
    const fs::path run = resume(g, "");
    const fs::path ck = step_dir(run, 11);
    const nlohmann::json manifest = nlohmann::json::parse(slurp(ck / "manifest.json"));
    EXPECT_EQ(manifest["layout"]["world"].get<int>(), g.ranks);

    export_hf(ck, scratch(g.name + "_f32"), "fp32");
    expect_same_dir(scratch(g.name + "_f32"), scratch("one_f32"));
    export_hf(ck, scratch(g.name + "_bf16"), "bf16", "0.0002");
    expect_same_dir(scratch(g.name + "_bf16"), scratch("one_bf16"));

    EXPECT_EQ(generate(ck, scratch(g.name + "_generate.txt")), one_text);

    const std::string out = slurp(run.parent_path() / "out.txt");
    EXPECT_NE(out.find("sample: the parameters of " + ck.string()), std::string::npos) << out;
    EXPECT_EQ(samples_of(run.parent_path() / "out.txt"), ref_samples);
    expect_sample_as_planned(run);
  }
  EXPECT_GT(fs::file_size(scratch("one_bf16") / "model.safetensors.index.json"), 0u);
}

// Flips a byte of `file` and returns its original contents.
std::string damage(const fs::path& file) {
  const std::string good = slurp(file);
  std::string bad = good;
  bad[8] = char(bad[8] ^ 0x5a);
  std::ofstream(file, std::ios::binary | std::ios::trunc) << bad;
  return good;
}

// Export and generate verify the CRC-32s of what they read, the parameters' files: a corrupt
// one is an error naming the file and its elements (exit 3), a corrupt optimizer file, which
// neither reads, is not read through.
TEST(CheckpointExport, ExportAndGenerateVerifyTheParametersTheyRead) {
  const fs::path run =
      shardlm::test::train_tiny(2, 2, 2, "shardlm_export_damage", 10, true, "--set zero.stage=3");
  const fs::path ck = step_dir(run, 10);
  const std::vector<std::string> gen = {"generate", "--checkpoint",     ck.string(), "--prompt",
                                        "And",      "--max-new-tokens", "4"};
  const std::vector<std::string> exp = {"convert", "hf-export", ck.string(), "--output",
                                        scratch("damaged").string()};
  const fs::path out = scratch("damage.txt");
  {
    const fs::path adam = ck / "adam_v-00001-of-00002.bin";
    const std::string good = damage(adam);
    EXPECT_EQ(run_measured(gen, out).code, 0) << slurp(out);
    EXPECT_EQ(run_measured(exp, out).code, 0) << slurp(out);
    std::ofstream(adam, std::ios::binary | std::ios::trunc) << good;
  }
  const nlohmann::json m = nlohmann::json::parse(slurp(ck / "manifest.json"));
  const nlohmann::json& range = m["files"]["params-00001-of-00002.bin"]["ranges"][0];
  const int64_t begin = range[0].get<int64_t>(), end = begin + range[1].get<int64_t>();
  damage(ck / "params-00001-of-00002.bin");
  const std::string named = fmt::format(
      "params-00001-of-00002.bin: checksum mismatch in params elements [{}, {})", begin, end);
  for (const auto& args : {gen, exp}) {
    SCOPED_TRACE(args[0]);
    EXPECT_EQ(run_measured(args, out).code, 3);
    EXPECT_NE(slurp(out).find(named), std::string::npos) << slurp(out);
  }
}

// A 2-rank ZeRO-3 checkpoint of a model of dim 512 with `layers` decoder layers of MLP width
// `ffn`, written after one step; returns its checkpoints directory.
fs::path wide_checkpoint(int layers, int ffn) {
  const std::string name = fmt::format("shardlm_export_wide{}x{}", layers, ffn);
  const fs::path run = shardlm::test::train_tiny(
      2, 1, 1, name, 1, true,
      fmt::format("--set model.dim=512 --set model.n_heads=8 --set model.n_kv_heads=8 "
                  "--set zero.stage=3 --set model.n_layers={} --set model.ffn_dim={}",
                  layers, ffn));
  return run / "checkpoints";
}

// The export holds one chunk of a tensor (kHfExportChunk elements, in f32 and bf16: 6 MiB) on
// top of the process's own memory, whatever the model. One layer of MLP width 1536 (a layer of
// 3.1M parameters) against three of width 6144 (10.5M each, 88 MiB more parameters in all):
// the same peak resident set within kSlack, where holding a layer at a time would add twice
// the layers' difference (80 MiB) and assembling the model far more, and below the larger
// model's parameters' size.
TEST(CheckpointExport, PeakMemoryDoesNotGrowWithTheModel) {
  constexpr int64_t kSlack = 6 * kMiB;  // page rounding, the larger manifest and model.json
  const fs::path small = wide_checkpoint(1, 1536), large = wide_checkpoint(3, 6144);
  const shardlm::CheckpointReader small_ck(small.string()), large_ck(large.string());
  const int64_t small_params = int64_t(small_ck.vector_bytes("params"));
  const int64_t large_params = int64_t(large_ck.vector_bytes("params"));
  ASSERT_GT(large_params - small_params, 80 * kMiB);
  for (const char* dtype : {"fp32", "bf16"}) {
    SCOPED_TRACE(dtype);
    const Child s = export_hf(small, scratch(std::string("small_") + dtype), dtype);
    const Child l = export_hf(large, scratch(std::string("large_") + dtype), dtype);
    ASSERT_GT(s.peak_rss, 0);
    RecordProperty(std::string("peak_rss_") + dtype, std::to_string(s.peak_rss) + " (small), " +
                                                         std::to_string(l.peak_rss) + " (large)");
    EXPECT_LE(l.peak_rss - s.peak_rss, kSlack)
        << "peak " << l.peak_rss / kMiB << " MiB against " << s.peak_rss / kMiB << " MiB";
    EXPECT_LT(l.peak_rss, large_params);
  }
}

}  // namespace
