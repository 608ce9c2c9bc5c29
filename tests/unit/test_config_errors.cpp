// Tests of the JSON run-config loader (src/config/config.cpp) on malformed input: one case per
// kind of malformed config (kConfig naming the key), and a seeded mutation test that only
// shardlm::Error ever comes out.
#include <gtest/gtest.h>

#include <algorithm>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "shardlm/config/config.h"
#include "shardlm/core/check.h"
#include "unit/run_config_samples.h"

namespace shardlm {
namespace {

using test::kFullConfig;
using test::kMinimalConfig;
using test::parse;
using test::with;

// ---- malformed configs: each is kConfig, and the message names the key ----------------------

struct BadCase {
  const char* name;
  std::string text;
  std::vector<std::string> overrides;
  std::vector<std::string> expect;  // substrings of the message
};

std::vector<BadCase> bad_cases() {
  return {
      {"UnknownKeySuggests",
       with(R"({"train": {"learning_rate": 0.1}})"),
       {},
       {"unknown key 'train.learning_rate'", "did you mean 'train.lr'?"}},
      {"UnknownKeyTypo",
       with(R"({"train": {"micro_bach": 2}})"),
       {},
       {"'train.micro_bach'", "did you mean 'train.micro_batch'?"}},
      {"UnknownKeyOtherSection",
       with(R"({"train": {"seq_len": 2}})"),
       {},
       {"'train.seq_len'", "did you mean 'data.seq_len'?"}},
      {"UnknownKeyAlias",
       with(R"({"model": {"num_hidden_layers": 2}})"),
       {},
       {"'model.num_hidden_layers'", "did you mean 'model.n_layers'?"}},
      {"UnknownNestedKey",
       with(R"({"model": {"rope_scaling": {"facter": 2}}})"),
       {},
       {"'model.rope_scaling.facter'", "did you mean 'model.rope_scaling.factor'?"}},
      {"UnknownKeyHuge",
       with("{\"train\": {\"" + std::string(100000, 'x') + "\": 1}}"),
       {},
       {"unknown key 'train.xxxx", "valid keys in 'train'"}},
      {"UnknownKeyFarListsValid",
       with(R"({"train": {"zzzzzzzz": 1}})"),
       {},
       {"unknown key 'train.zzzzzzzz'", "valid keys in 'train'", "micro_batch"}},
      {"UnknownSectionSuggests",
       with(R"({"trian": {"lr": 1}})"),
       {},
       {"unknown section 'trian'", "did you mean 'train'?"}},
      {"UnknownSectionFar",
       with(R"({"qqqqqqqqq": {}})"),
       {},
       {"unknown section 'qqqqqqqqq'", "valid sections", "model"}},
      {"PlannedKey",
       with(R"({"lora": {"rank": 8, "bias": "all"}})"),
       {},
       {"'lora.bias'", "not supported"}},
      {"LoraTargets",
       with(R"({"lora": {"rank": 8, "targets": "q,qkv"}})"),
       {},
       {"lora.targets", "'qkv'", "q, k, v, o, gate, up, down"}},
      {"LoraRank", with(R"({"lora": {"rank": -2}})"), {}, {"lora.rank", ">= 0"}},
      {"LoraDropout",
       with(R"({"lora": {"rank": 4, "dropout": 1.5}})"),
       {},
       {"lora.dropout", "[0, 1)"}},
      {"ZeroStageRange", with(R"({"zero": {"stage": 4}})"), {}, {"zero.stage", "0, 1, 2 or 3"}},
      {"OffloadParamsNeedsOptimizerOffload",
       with(R"({"zero": {"stage": 3, "offload_params": "cpu"}})"),
       {},
       {"zero.offload_params \"cpu\" requires zero.offload_optimizer = \"cpu\""}},
      {"OffloadNvme",
       with(R"({"zero": {"offload_optimizer": "nvme"}})"),
       {},
       {"zero.offload_optimizer must be one of \"none\", \"cpu\"", "\"nvme\""}},
      {"OffloadParamsNeedsStage3",
       with(R"({"zero": {"stage": 2, "offload_params": "cpu"}})"),
       {},
       {"zero.offload_params \"cpu\" requires zero.stage = 3 (got 2)"}},
      {"NegativePrefetch",
       with(R"({"zero": {"prefetch_layers": -1}})"),
       {},
       {"zero.prefetch_layers must be >= 0"}},
      {"ZeroBucket",
       with(R"({"zero": {"reduce_bucket_bytes": 0}})"),
       {},
       {"zero.reduce_bucket_bytes must be >= 1"}},
      {"ReduceDtype",
       with(R"({"zero": {"stage": 2, "reduce_dtype": "fp16"}})"),
       {},
       {"zero.reduce_dtype must be one of \"fp32\", \"bf16\"", "\"fp16\""}},
      {"Bf16ReductionsNeedStage2",
       with(R"({"zero": {"stage": 1, "reduce_dtype": "bf16"}})"),
       {},
       {"zero.reduce_dtype \"bf16\" requires zero.stage >= 2 (got 1)"}},
      {"OverlapCommNotBool",
       with(R"({"zero": {"overlap_comm": "yes"}})"),
       {},
       {"zero.overlap_comm must be true or false"}},
      {"TensorParallelHeadsDoNotSplit",
       with(R"({"parallel": {"tp": 3}})"),
       {},
       {"parallel.tp = 3 does not divide model.n_heads"}},
      {"SequenceParallelRowsDoNotSplit",
       with(R"({"parallel": {"tp": 2}, "train": {"micro_batch": 1}, "data": {"seq_len": 101}})"),
       {},
       {"1 x 101 / 1 = 101 rows across parallel.tp = 2", "train.micro_batch or data.seq_len",
        "parallel.sequence_parallel = false"}},
      {"PipelineMoreStagesThanLayers",
       with(R"({"model": {"n_layers": 2}, "parallel": {"pp": 4}})"),
       {},
       {"parallel.pp = 4", "model.n_layers = 2"}},
      {"ContextParallelSeqLenNotSplittable",
       with(R"({"parallel": {"cp": 8, "cp_kind": "ring"}, "data": {"seq_len": 100}})"),
       {},
       {"data.seq_len (100) must be a multiple of 2 x parallel.cp = 16"}},
      {"UlyssesHeadsDoNotSplit",
       with(R"({"parallel": {"cp": 8, "cp_kind": "ulysses"}, "data": {"seq_len": 256}})"),
       {},
       {"model.n_heads", "parallel.cp_kind = \"ring\""}},
      {"ZeroTp", with(R"({"parallel": {"tp": 0}})"), {}, {"parallel.tp must be in [1,"}},
      {"BadCpKind",
       with(R"({"parallel": {"cp_kind": "star"}})"),
       {},
       {"parallel.cp_kind must be one of \"ulysses\", \"ring\", \"hybrid\"", "\"star\""}},
      {"BadDeviceComm",
       with(R"({"parallel": {"device_comm": "gloo"}})"),
       {},
       {"parallel.device_comm must be one of \"nccl\", \"host\", \"mpi\"", "\"gloo\""}},
      {"NoStagingMemory",
       with(R"({"parallel": {"device_comm": "mpi", "device_comm_staging_kib": 0}})"),
       {},
       {"parallel.device_comm_staging_kib must be in [1, 4194304]"}},
      {"CpUlyssesWithoutHybrid",
       with(R"({"parallel": {"cp_ulysses": 2}})"),
       {},
       {"parallel.cp_ulysses (2) only applies to parallel.cp_kind \"hybrid\""}},
      {"CpKeepGatheredOnARing",
       with(R"({"parallel": {"cp": 2, "cp_kind": "ring", "cp_keep_gathered": true}})"),
       {},
       {"parallel.cp_keep_gathered", "\"ring\" has no all-to-all"}},
      {"CpUlyssesNotDividing",
       with(R"({"parallel": {"cp": 6, "cp_kind": "hybrid", "cp_ulysses": 4}})"),
       {},
       {"parallel.cp_ulysses (4) must divide parallel.cp (6)"}},
      {"DpIsNotAKey",
       with(R"({"parallel": {"dp": 2}})"),
       {},
       {"'parallel.dp' is not a key", "derived"}},
      {"ZeroKeySuggests",
       with(R"({"zero": {"offload_param": "cpu"}})"),
       {},
       {"'zero.offload_param'", "did you mean 'zero.offload_params'?"}},
      {"HfDirMissing",
       with(R"({"model": {"hf_dir": "/nonexistent-hf-dir"}})"),
       {},
       {"/nonexistent-hf-dir/config.json", "cannot read"}},
      {"StringForInt",
       with(R"({"train": {"micro_batch": "8"}})"),
       {},
       {R"(train.micro_batch must be an integer, got "8" (string))"}},
      {"FloatForInt",
       with(R"({"train": {"micro_batch": 8.5}})"),
       {},
       {"train.micro_batch must be an integer, got 8.5"}},
      {"IntOutOfRange",
       with(R"({"train": {"max_steps": 1e30}})"),
       {},
       {"train.max_steps", "out of range"}},
      {"UnsignedOverflowsInt",
       with(R"({"train": {"max_steps": 18446744073709551615}})"),
       {},
       {"train.max_steps", "out of range"}},
      {"StringForDouble",
       with(R"({"train": {"lr": "fast"}})"),
       {},
       {"train.lr must be a number", "\"fast\""}},
      {"IntForBool",
       with(R"({"model": {"tie_embeddings": 1}})"),
       {},
       {"model.tie_embeddings must be true or false"}},
      {"NumberForString",
       with(R"({"precision": {"param": 16}})"),
       {},
       {"precision.param must be a string"}},
      {"NullForString",
       R"({"data": {"train": null}, "train": {"max_steps": 1}})",
       {},
       {"data.train must be a string"}},
      {"NegativeGradAccum", with(R"({"train": {"grad_accum": -1}})"), {}, {"train.grad_accum"}},
      {"NegativeSeed",
       with(R"({"train": {"seed": -1}})"),
       {},
       {"train.seed must be a non-negative integer"}},
      {"NegativeTemperature",
       with(R"({"sample": {"temperature": -0.5}})"),
       {},
       {"sample.temperature"}},
      {"ZeroLr", with(R"({"train": {"lr": 0}})"), {}, {"train.lr must be > 0"}},
      {"SampleWithoutFinalCheckpoint",
       with(R"({"sample": {"prompt": "In the", "count": 1}, "checkpoint": {"at_end": false}})"),
       {},
       {"sample.prompt", "checkpoint.at_end = false", "sample.count = 0"}},
      {"MinLrAboveLr",
       with(R"({"train": {"lr": 0.001, "min_lr": 0.01}})"),
       {},
       {"train.min_lr", "train.lr"}},
      {"BetaOne", with(R"({"train": {"beta2": 1.0}})"), {}, {"train.beta2"}},
      {"SeqLenOne", with(R"({"data": {"seq_len": 1}})"), {}, {"data.seq_len"}},
      {"ZeroLossChunk",
       with(R"({"memory": {"loss_chunk_tokens": 0}})"),
       {},
       {"memory.loss_chunk_tokens"}},
      {"BadPrecisionEnum",
       with(R"({"precision": {"param": "fp16"}})"),
       {},
       {"precision.param", "\"fp32\"", "\"bf16\"", "fp16"}},
      {"CheckpointingUnknown",
       with(R"({"memory": {"checkpointing": "some"}})"),
       {},
       {"memory.checkpointing", "\"none\"", "\"selective\"", "\"full\"", "some"}},
      {"OffloadCheckpointsNeedsCheckpointing",
       with(R"({"memory": {"offload_checkpoints": true}})"),
       {},
       {"memory.offload_checkpoints", "memory.checkpointing", "\"selective\" or \"full\""}},
      {"OffloadCheckpointsNotBool",
       with(R"({"memory": {"checkpointing": "full", "offload_checkpoints": "yes"}})"),
       {},
       {"memory.offload_checkpoints", "true, false, a fraction in [0, 1] or \"auto\"", "yes"}},
      {"OffloadCheckpointsFractionOutOfRange",
       with(R"({"memory": {"checkpointing": "full", "offload_checkpoints": 1.5}})"),
       {},
       {"memory.offload_checkpoints", "a fraction in [0, 1]", "1.5"}},
      {"CheckpointEveryNeedsFull",
       with(R"({"memory": {"checkpointing": "selective", "checkpoint_every": 2}})"),
       {},
       {"memory.checkpoint_every", "memory.checkpointing = \"full\"", "selective"}},
      {"OffloadBaseWithoutLora",
       with(R"({"lora": {"offload_base": true}})"),
       {},
       {"lora.offload_base", "lora.rank > 0"}},
      {"CheckpointEveryZero",
       with(R"({"memory": {"checkpointing": "full", "checkpoint_every": 0}})"),
       {},
       {"memory.checkpoint_every", ">= 1"}},
      {"ZeroMlpChunk",
       with(R"({"memory": {"mlp_chunk_tokens": 0}})"),
       {},
       {"memory.mlp_chunk_tokens", ">= 1"}},
      {"BadRopeType",
       with(R"({"model": {"rope_scaling": {"type": "yarn"}}})"),
       {},
       {"model.rope_scaling.type"}},
      {"RopeFreqFactorsEqual",
       with(R"({"model": {"rope_scaling": {"type": "llama3", "high_freq_factor": 1.0}}})"),
       {},
       {"model.rope_scaling.high_freq_factor", "model.rope_scaling.low_freq_factor"}},
      {"BadPreset",
       with(R"({"model": {"preset": "gpt5"}})"),
       {},
       {"model.preset", "gpt5", "tiny", "llama3.1-8b", "qwen2.5-0.5b"}},
      {"HeadsNotDividingDim",
       with(R"({"model": {"n_heads": 3}})"),
       {},
       {"model.dim", "model.n_heads"}},
      {"OddHeadDim", with(R"({"model": {"head_dim": 15}})"), {}, {"model.head_dim", "15"}},
      {"NegativeHeadDim", with(R"({"model": {"head_dim": -2}})"), {}, {"model.head_dim", "-2"}},
      {"KvHeadsNotDividingHeads",
       with(R"({"model": {"n_kv_heads": 3}})"),
       {},
       {"model.n_kv_heads"}},
      {"ZeroVocab", with(R"({"model": {"vocab_size": 0}})"), {}, {"model.vocab_size"}},
      {"BadDevice", with(R"({"train": {"device": "gpu"}})"), {}, {"train.device", "cuda"}},
      {"BadAttention",
       with(R"({"train": {"attention": "flash"}})"),
       {},
       {"train.attention", "auto", "cudnn", "own"}},
      {"BothEpochsAndSteps",
       with(R"({"train": {"epochs": 2, "max_steps": 10}})"),
       {},
       {"train.epochs", "train.max_steps", "only one"}},
      {"NeitherEpochsNorSteps",
       with(R"({"train": {"max_steps": 0}})"),
       {},
       {"train.epochs", "train.max_steps"}},
      {"NoTrainData",
       R"({"train": {"max_steps": 1}})",
       {},
       {"data.train is required: the text file to train on"}},
      {"SyntaxError", R"({"train": {"lr": }})", {}, {"<config text>", "invalid JSON at byte 18"}},
      {"TrailingComma", R"({"train": {"lr": 1},})", {}, {"invalid JSON at byte"}},
      {"NumberOverflow", R"({"train": {"lr": 1e999}})", {}, {"<config text>", "number overflow"}},
      {"EmptyText", "", {}, {"invalid JSON at byte"}},
      {"TopLevelArray", "[1, 2]", {}, {"must be a JSON object", "array"}},
      {"SectionNotObject", with(R"({"train": 5})"), {}, {"'train' must be a JSON object"}},
      {"RopeScalingNotObject",
       with(R"({"model": {"rope_scaling": "llama3"}})"),
       {},
       {"'model.rope_scaling' must be a JSON object"}},
      {"DottedKeyInFile", with(R"({"train.lr": 1})"), {}, {"'train.lr'", "nest it"}},
      {"SetMissingEquals", kMinimalConfig, {"train.lr"}, {"train.lr", "key.path=value"}},
      {"SetEmptyKey", kMinimalConfig, {"=3"}, {"'=3'"}},
      {"SetDoubleDot", kMinimalConfig, {"train..lr=3"}, {"train..lr"}},
      {"SetUnknownKey",
       kMinimalConfig,
       {"train.lrr=0.1"},
       {"--set train.lrr=0.1", "unknown key 'train.lrr'", "did you mean 'train.lr'?"}},
      {"SetUnknownSection", kMinimalConfig, {"foo=1"}, {"--set foo=1", "'foo'"}},
      {"SetWrongType",
       kMinimalConfig,
       {"train.micro_batch=abc"},
       {"--set train.micro_batch=abc", R"(train.micro_batch must be an integer, got "abc")"}},
      {"SetSectionWithNumberForString",
       kMinimalConfig,
       {R"(data={"train": 5})"},
       {"data.train must be a string, got 5"}},
      {"SetSectionToScalar", kMinimalConfig, {"train=3"}, {"'train' must be a JSON object"}},
      {"SetNegative", kMinimalConfig, {"train.micro_batch=0"}, {"train.micro_batch"}},
  };
}

void PrintTo(const BadCase& bc, std::ostream* os) { *os << bc.name; }

class BadConfig : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadConfig, IsConfigErrorNamingTheKey) {
  const BadCase& bc = GetParam();
  try {
    parse(bc.text, bc.overrides);
    FAIL() << "accepted: " << bc.text;
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kConfig) << e.what();
    for (const auto& s : bc.expect)
      EXPECT_NE(std::string(e.what()).find(s), std::string::npos)
          << "message: " << e.what() << "\nmissing: " << s;
  }
}

INSTANTIATE_TEST_SUITE_P(RunConfig, BadConfig, ::testing::ValuesIn(bad_cases()),
                         [](const auto& info) { return std::string(info.param.name); });

// ---- robustness: no input may produce anything but shardlm::Error ----------------------------

TEST(RunConfig, RandomMutationsOnlyThrowConfigErrors) {
  const std::string base = kFullConfig;
  const std::vector<std::string> base_sets = {"train.lr=0.002", "model.rope_scaling.factor=2",
                                              "data.train=x.txt"};
  const std::string structural = "{}[]\":,.-+eE0123456789 tfnul\\";
  std::mt19937_64 rng(20240611);
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % std::max<size_t>(n, 1)); };
  auto mutate = [&](std::string s) {
    const int edits = 1 + static_cast<int>(pick(4));
    for (int e = 0; e < edits; ++e) {
      const size_t pos = pick(s.size() + 1);
      const char byte = pick(2) ? structural[pick(structural.size())] : static_cast<char>(rng());
      switch (pick(5)) {
        case 0:
          if (pos < s.size()) s[pos] = byte;
          break;
        case 1:
          s.insert(s.begin() + pos, byte);
          break;
        case 2:
          if (pos < s.size()) s.erase(pos, 1 + pick(8));
          break;
        case 3:
          s.resize(pos);
          break;
        default:
          if (pos < s.size()) s.insert(pos, s.substr(pick(s.size()), pick(16)));
          break;
      }
    }
    return s;
  };
  int accepted = 0, rejected = 0;
  for (int i = 0; i < 2000; ++i) {
    const bool mutate_sets = i % 4 == 3;
    const std::string text = mutate_sets ? base : mutate(base);
    std::vector<std::string> sets = base_sets;
    if (mutate_sets) sets[pick(sets.size())] = mutate(sets[pick(sets.size())]);
    try {
      const RunConfig c = parse(text, sets);
      (void)run_config_to_json(c).dump();
      ++accepted;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kConfig) << e.what();
      ++rejected;
    } catch (const std::exception& e) {
      ADD_FAILURE() << "non-shardlm exception " << e.what() << " for input:\n" << text;
    } catch (...) {
      ADD_FAILURE() << "unknown exception for input:\n" << text;
    }
  }
  EXPECT_EQ(accepted + rejected, 2000);
  EXPECT_GT(rejected, 500);  // the mutations do reach the error paths
}

}  // namespace
}  // namespace shardlm
