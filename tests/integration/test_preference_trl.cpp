// The preference objectives against TRL (trl 1.x in the venv): a random Llama made by
// transformers with a PEFT adapter (random A and B on every projection) trains one step of DPO
// (sigmoid, ipo, and label smoothing) and of SimPO on three pre-tokenized pairs, two of them
// sharing a row, through shardlm's preference runner; DPOTrainer (the reference: the base with
// the adapter off) and CPOTrainer (loss_type "simpo", cpo_alpha 0) on the same pairs give the
// loss, TRL's rewards and logps metrics and the adapter's gradients within a bound. cDPO is
// checked against TRL 1.x's loss combination that equals it: 2 (1 - e) sigmoid - (1 - 2 e)
// robust (trl 1.x's sigmoid loss no longer reads label_smoothing). Full fine-tuning DPO: the
// policy is the base with the adapter merged into its weights, its reference the base's sums as
// shardlm's start-up pass computes them, against DPOTrainer with the base as ref_model and
// precompute_ref_log_probs=True; every parameter's gradient compared. One DPO case reads text
// records (with "prompt", and without: TRL's implicit prompt) through DPOTrainer's own preparation
// and shardlm's record reader with the same BPE tokenizer: the ids, the prompt boundary, then the
// step.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "shardlm/backend/backend.h"
#include "shardlm/hf/hf.h"
#include "shardlm/io/safetensors.h"
#include "shardlm/io/tokenize.h"
#include "shardlm/model/llama.h"
#include "test_util.h"
#include "tolerance.h"
#include "train/preference.h"
#include "train/preference_eval.h"
#include "train/preference_reference.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using trainer_detail::PreferenceLoss;

constexpr int64_t kT = 32, kB = 2;
constexpr int64_t kTextT = 128;  // the text records' rows (a byte-level BPE of 300 ids)

struct Pair {
  std::vector<int32_t> prompt, chosen, rejected;
};
// Pairs 0 and 1 share a row under best-fit decreasing at T = 32; token 1 is the eos.
const std::vector<Pair> kPairs = {{{5, 77, 123, 9}, {250, 31, 1}, {299, 0, 42, 1}},
                                  {{17, 180}, {42, 17, 8, 1}, {9, 1}},
                                  {{3, 4, 5, 6, 7, 8, 9, 10, 11}, {12, 13, 14, 1}, {15, 16, 1}}};

struct Shared {
  fs::path root, base, adapter, merged, pairs;
  std::string python;
};

const Shared& shared() {
  static const Shared s = [] {
    Shared s;
    s.python = test::venv_python("peft,trl,datasets");
    if (s.python.empty()) return s;
    s.root = test::scratch_root() / "preference_trl";
    fs::remove_all(s.root);
    fs::create_directories(s.root);
    s.base = s.root / "base";
    s.adapter = s.root / "adapter";
    s.merged = s.root / "merged";
    s.pairs = s.root / "pairs.json";
    const std::string src = std::string(SHARDLM_SOURCE_DIR) + "/tests/integration/";
    // One process for the model, its adapter, tokenizer and merged weights: each Python start
    // (torch, transformers, peft) costs seconds, and every test of this file makes them.
    test::run_command(s.python + " " + src + "preference_reference.py setup " + s.base.string() +
                          " " + s.adapter.string() + " " + s.merged.string() + " " +
                          SHARDLM_SOURCE_DIR + "/tests/data/genesis_1_12.txt",
                      s.root / "setup.txt", true);
    json pairs = json::array();
    for (const Pair& p : kPairs)
      pairs.push_back(
          {{"prompt_ids", p.prompt}, {"chosen_ids", p.chosen}, {"rejected_ids", p.rejected}});
    std::ofstream(s.pairs) << pairs.dump();
    return s;
  }();
  return s;
}

json reference(const std::string& kind, const json& config, const fs::path& data = {}) {
  const Shared& s = shared();
  // dpo_full's second model is the policy (the merged weights), the others' the adapter.
  const fs::path second = kind == "dpo_full" ? s.merged : s.adapter;
  const std::string out = test::run_command(
      s.python + " " + SHARDLM_SOURCE_DIR + "/tests/integration/preference_reference.py " + kind +
          " " + s.base.string() + " " + second.string() + " " +
          (data.empty() ? s.pairs : data).string() + " '" + config.dump() + "' 2>/dev/null",
      s.root / (kind + ".txt"), false);
  return json::parse(
      out.substr(out.rfind("\n{") == std::string::npos ? out.find('{') : out.rfind("\n{") + 1));
}

// The pairs as a paired source: chosen then rejected, the loss mask on the completions.
std::shared_ptr<TokenSource> pair_source() {
  std::vector<int32_t> tokens;
  std::vector<int64_t> docs;
  std::vector<uint8_t> mask;
  for (const Pair& p : kPairs)
    for (const auto* completion : {&p.chosen, &p.rejected}) {
      docs.push_back(int64_t(tokens.size()));
      tokens.insert(tokens.end(), p.prompt.begin(), p.prompt.end());
      tokens.insert(tokens.end(), completion->begin(), completion->end());
      mask.insert(mask.end(), p.prompt.size(), 0);
      mask.insert(mask.end(), completion->size(), 1);
    }
  return make_memory_source(tokens, docs, "pairs", mask, /*paired=*/true);
}

struct Ours {
  int64_t T = kT, pairs = 0;
  double loss = 0;
  trainer_detail::PreferenceSums sums;
  std::map<std::string, std::vector<float>> grads;
  ModelConfig cfg;
};

Dataset id_pairs() {
  Dataset data(pair_source(), kT, 1, 0, -1, {Packing::kSamples, Overlong::kError});
  EXPECT_EQ(data.num_windows(), 2);  // pairs 0 and 1 in one row
  return data;
}

// The pairs of `data`'s windows.
int64_t pairs_of(const Dataset& data) {
  int64_t n = 0;
  for (int64_t w = 0; w < data.num_windows(); ++w)
    n += int64_t(data.window_documents(w).size()) / 2;
  return n;
}

// The base's weights and the adapter in a LoRA model of micro-batches of kB rows of T tokens.
std::unique_ptr<LlamaModel> lora_model(Backend& be, MemoryLedger& ledger, int64_t T,
                                       ModelConfig& cfg) {
  const Shared& s = shared();
  cfg = read_hf_config(s.base.string()).config;
  ModelOptions opt;
  opt.max_batch = kB;
  opt.max_seq = T;
  opt.token_weights = true;
  opt.lora.rank = 4;
  opt.lora.alpha = 8;
  opt.lora.targets = lora_targets_from_string("all");
  auto model = std::make_unique<LlamaModel>(cfg, opt, be, ledger);
  const SafetensorsDir st(s.base.string());
  const ParamLayout& L = model->layout();
  for (int u = 0; u < int(L.units.size()); ++u)
    read_hf_unit(st, L, u, model->params().f32() + L.units[u].begin);
  const SafetensorsFile a((s.adapter / "adapter_model.safetensors").string());
  for (const ParamEntry& e : model->lora_layout().params.entries)
    a.read_f32(e.name, model->lora_params().f32() + e.offset);
  be.zero(model->lora_grads());
  return model;
}

// One LoRA DPO or SimPO step over every window of `data` (at most kB: one micro-batch).
Ours run_ours(const PreferenceLoss& loss, Dataset data) {
  const int64_t T = data.seq_len(), pairs = pairs_of(data);
  EXPECT_LE(data.num_windows(), kB);
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  Ours out;
  const std::unique_ptr<LlamaModel> model = lora_model(*be, ledger, T, out.cfg);

  std::vector<int64_t> order(size_t(data.num_windows()));
  for (size_t i = 0; i < order.size(); ++i) order[i] = int64_t(i);
  trainer_detail::InputStaging staging(*be, ledger, kB * T);
  const trainer_detail::StepParts parts{*model, nullptr, data, *be, staging, kB, T, T, 1, 0};
  const auto runner = trainer_detail::make_preference_runner(parts, ledger, loss);
  const trainer_detail::StepSums sums =
      runner->run({order, 0, 0, 1, data.targets_per_epoch(), pairs});
  out.T = T;
  out.pairs = pairs;
  out.loss = sums.loss_sum / double(pairs);
  out.sums = sums.preference;
  for (const ParamEntry& e : model->lora_layout().params.entries)
    out.grads[e.name].assign(model->lora_grads().f32() + e.offset,
                             model->lora_grads().f32() + e.offset + e.shape.numel());
  return out;
}

// The evaluation of a preference objective (the trainer's held-out pass) over every window of
// `data`, one micro-batch: its loss and metric sums, no gradients.
Ours eval_ours(const PreferenceLoss& loss, Dataset data) {
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  Ours out;
  out.T = data.seq_len();
  const std::unique_ptr<LlamaModel> model = lora_model(*be, ledger, out.T, out.cfg);
  trainer_detail::InputStaging staging(*be, ledger, kB * out.T);
  const trainer_detail::StepParts parts{*model, nullptr, data,  *be, staging,
                                        kB,     out.T,   out.T, 1,   0};
  std::vector<int64_t> order(size_t(data.num_windows()));
  for (size_t i = 0; i < order.size(); ++i) order[i] = int64_t(i);
  const trainer_detail::PreferenceEval eval = trainer_detail::evaluate_preference(
      {parts, loss, nullptr, 0, nullptr, 0, 0, 1, nullptr, nullptr, &order});
  EXPECT_EQ(eval.pairs, pairs_of(data));
  out.pairs = eval.pairs;
  out.loss = eval.sums.loss / double(eval.pairs);
  out.sums = eval.sums;
  return out;
}

// Full fine-tuning DPO: the reference table computed by the pass training runs before its first
// step, with the base's weights; then the policy's weights (the base with the adapter merged)
// loaded and one step's gradients of every parameter taken with the table's sums.
Ours run_ours_full(const PreferenceLoss& loss) {
  const Shared& s = shared();
  const HfModelInfo info = read_hf_config(s.base.string());
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  ModelOptions opt;
  opt.max_batch = kB;
  opt.max_seq = kT;
  opt.token_weights = true;
  LlamaModel model(info.config, opt, *be, ledger);
  const ParamLayout& L = model.layout();
  auto load = [&](const fs::path& dir) {
    const SafetensorsDir st(dir.string());
    for (int u = 0; u < int(L.units.size()); ++u)
      read_hf_unit(st, L, u, model.params().f32() + L.units[u].begin);
  };
  Dataset data(pair_source(), kT, 1, 0, -1, {Packing::kSamples, Overlong::kError});
  trainer_detail::InputStaging staging(*be, ledger, kB * kT);
  trainer_detail::ReferenceTable table = trainer_detail::reference_layout(data);
  EXPECT_EQ(table.pairs(), int64_t(kPairs.size()));
  std::vector<int64_t> order(size_t(data.num_windows()));
  for (size_t i = 0; i < order.size(); ++i) order[i] = int64_t(i);
  load(s.base);
  trainer_detail::compute_reference(
      {.model = model, .data = data, .backend = *be, .staging = staging, .order = order, .B = kB},
      table);
  load(s.merged);
  model.zero_grads();

  const trainer_detail::StepParts parts{model, nullptr, data, *be, staging, kB, kT, kT, 1, 0};
  const auto runner =
      trainer_detail::make_preference_runner(parts, ledger, loss, nullptr, 0, &table);
  const trainer_detail::StepSums sums =
      runner->run({order, 0, 0, 1, data.targets_per_epoch(), int64_t(kPairs.size())});
  Ours out;
  out.pairs = int64_t(kPairs.size());
  out.loss = sums.loss_sum / double(kPairs.size());
  out.sums = sums.preference;
  out.cfg = info.config;
  for (const ParamEntry& e : L.entries)
    out.grads[e.name].assign(model.grads().f32() + e.offset,
                             model.grads().f32() + e.offset + e.shape.numel());
  return out;
}

// The bound: every log-probability sum is a reduction through the decoder, off by at most
// reorder_tolerance(chain) of the magnitude of its terms (the completions' summed |log p|,
// `logps_scale`); the loss, the metrics and each pair's coefficient move by at most `lipschitz`
// times that. Gradients: the coefficient's error times the unweighted gradient plus the chain's
// own error, relative to the largest gradient element.
void compare(const Ours& ours, const json& ref, double lipschitz) {
  const double n = double(ours.pairs);
  const double chain = test::reorder_tolerance(test::reduction_chain(ours.cfg, ours.T, kB));
  const double logps_scale =
      std::max(std::abs(ours.sums.logps_chosen), std::abs(ours.sums.logps_rejected));
  const double tol = chain * (1 + lipschitz) * logps_scale;
  const json& m = ref["metrics"];
  EXPECT_NEAR(ours.loss, ref["loss"].get<double>(), tol) << "loss";
  EXPECT_NEAR(ours.sums.rewards_chosen / n, m["rewards/chosen"].get<double>(), tol);
  EXPECT_NEAR(ours.sums.rewards_rejected / n, m["rewards/rejected"].get<double>(), tol);
  EXPECT_NEAR((ours.sums.rewards_chosen - ours.sums.rewards_rejected) / n,
              m["rewards/margins"].get<double>(), tol);
  // a share of pairs, which TRL averages in f32
  EXPECT_NEAR(ours.sums.accuracies / n, m["rewards/accuracies"].get<double>(),
              test::unit_roundoff(DType::kF32));
  EXPECT_NEAR(ours.sums.logps_chosen / n, m["logps/chosen"].get<double>(), tol);
  EXPECT_NEAR(ours.sums.logps_rejected / n, m["logps/rejected"].get<double>(), tol);
  if (!ref.contains("grads")) return;  // an evaluation
  double largest = 0, moved = 0;
  std::string worst;
  for (const auto& [name, g] : ours.grads) {
    ASSERT_TRUE(ref["grads"].contains(name)) << name;
    for (float x : g) largest = std::max(largest, double(std::abs(x)));
  }
  ASSERT_GT(largest, 0.0);
  for (const auto& [name, g] : ours.grads) {
    const std::vector<double> want = ref["grads"][name].get<std::vector<double>>();
    ASSERT_EQ(want.size(), g.size()) << name;
    double here = 0;
    for (size_t i = 0; i < g.size(); ++i) here = std::max(here, std::abs(double(g[i]) - want[i]));
    if (here > moved) worst = name;
    moved = std::max(moved, here);
  }
  EXPECT_LE(moved, tol * largest + chain * largest)
      << "gradients, largest " << largest << ", most moved " << worst;
}

class PreferenceTrl : public ::testing::Test {
 protected:
  void SetUp() override {
    if (shared().python.empty())
      SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("trl (with peft and datasets)"));
  }
};

TEST_F(PreferenceTrl, DpoSigmoidMatchesDpoTrainer) {
  PreferenceLoss loss;
  loss.beta = 0.1;
  compare(run_ours(loss, id_pairs()), reference("dpo", {{"beta", 0.1}, {"loss_type", {"sigmoid"}}}),
          0.1);
}

// The evaluation under DPO against DPOTrainer.evaluate() on the same pairs as its eval set (one
// batch): eval_loss and TRL's eval_ metrics, the adapter on for the policy, off for the reference.
TEST_F(PreferenceTrl, DpoEvaluationMatchesDpoTrainerEvaluate) {
  PreferenceLoss loss;
  loss.beta = 0.1;
  const Ours ours = eval_ours(loss, id_pairs());
  EXPECT_GT(std::abs(ours.sums.rewards_chosen - ours.sums.rewards_rejected), 0.0);
  compare(ours, reference("dpo_eval", {{"beta", 0.1}, {"loss_type", {"sigmoid"}}}), 0.1);
}

// Full fine-tuning against DPOTrainer with ref_model and precompute_ref_log_probs=True: the
// policy is not the reference (the rewards are not 0), so the table's sums are what both read.
TEST_F(PreferenceTrl, DpoFullFineTuningMatchesDpoTrainerWithPrecomputedReference) {
  PreferenceLoss loss;
  loss.beta = 0.1;
  const Ours ours = run_ours_full(loss);
  EXPECT_GT(std::abs(ours.sums.rewards_chosen - ours.sums.rewards_rejected), 0.0);
  compare(ours, reference("dpo_full", {{"beta", 0.1}, {"loss_type", {"sigmoid"}}}), 0.1);
}

TEST_F(PreferenceTrl, DpoIpoMatchesDpoTrainer) {
  PreferenceLoss loss;
  loss.kind = PreferenceLoss::Kind::kDpoIpo;
  loss.beta = 0.5;
  // (h - 1 / (2 beta))^2 with h an average of log-ratios: Lipschitz 2 |h - 1 / (2 beta)| <= 2 (1 +
  // 1)
  compare(run_ours(loss, id_pairs()), reference("dpo", {{"beta", 0.5}, {"loss_type", {"ipo"}}}),
          4.0);
}

TEST_F(PreferenceTrl, ConservativeDpoMatchesDpoTrainer) {
  PreferenceLoss loss;
  loss.beta = 0.1;
  loss.label_smoothing = 0.2;
  const double e = 0.2;
  compare(run_ours(loss, id_pairs()),
          reference("dpo", {{"beta", 0.1},
                            {"loss_type", {"sigmoid", "robust"}},
                            {"loss_weights", {2 * (1 - e), -(1 - 2 * e)}},
                            {"label_smoothing", e}}),
          0.1);
}

TEST_F(PreferenceTrl, SimpoMatchesCpoTrainer) {
  PreferenceLoss loss;
  loss.kind = PreferenceLoss::Kind::kSimpo;
  loss.beta = 2.0;
  loss.gamma = 0.5;
  compare(run_ours(loss, id_pairs()), reference("simpo", {{"beta", 2.0}, {"simpo_gamma", 0.5}}),
          2.0);
}

// Text records through both tokenizations: DPOTrainer's preparation (the prompt's extraction
// when records have none, eos appended, prompt + completion tokenized whole, the prompt's length
// the shorter common prefix) with the base directory's BPE tokenizer, and shardlm's record
// reader with the same tokenizer.json: the same ids and prompt boundary for every pair, then the
// same loss, metrics and adapter gradients.
void expect_text_records_match(bool with_prompt) {
  const Shared& s = shared();
  const json texts = json::array({
      {"In the beginning", " God created.", " was the word."},
      {"Let there be", " light", " dark"},
      {"And the evening", " and the morning", " fell."},
  });
  json records = json::array();
  for (const json& t : texts) {
    const std::string p = t[0], c = t[1], r = t[2];
    records.push_back(with_prompt ? json{{"prompt", p}, {"chosen", c}, {"rejected", r}}
                                  : json{{"chosen", p + c}, {"rejected", p + r}});
  }
  const fs::path path = s.root / (with_prompt ? "records.json" : "records_implicit.json");
  std::ofstream(path) << records.dump();
  PreferenceLoss loss;
  loss.beta = 0.1;
  const json ref = reference("dpo_text", {{"beta", 0.1}, {"loss_type", {"sigmoid"}}}, path);

  const std::unique_ptr<Tokenizer> tok = load_tokenizer((s.base / "tokenizer.json").string());
  RecordOptions o;
  o.format = RecordFormat::kPreference;
  ASSERT_EQ(ref["tokenized"].size(), records.size());
  for (size_t i = 0; i < records.size(); ++i) {
    SCOPED_TRACE(records[i].dump());
    const RecordDocument d = encode_record(records[i], o, *tok);
    const json& t = ref["tokenized"][i];
    const std::vector<int32_t> p = t["prompt_ids"];
    for (const auto& [doc, key] :
         {std::pair{&d.doc, "chosen_ids"}, {&*d.rejected, "rejected_ids"}}) {
      std::vector<int32_t> want = p;
      for (const json& id : t[key]) want.push_back(id.get<int32_t>());
      EXPECT_EQ(doc->tokens, want) << key;
      std::vector<uint8_t> mask(want.size(), 1);
      std::fill_n(mask.begin(), p.size(), 0);
      EXPECT_EQ(doc->mask, mask) << key;
    }
  }
  std::ostringstream log;
  Dataset data(load_record_source(path.string(), *tok, o, log), kTextT, tok->eos_id(), 0, -1,
               {Packing::kSamples, Overlong::kError});
  const Ours ours = run_ours(loss, std::move(data));
  EXPECT_EQ(ours.pairs, int64_t(records.size()));
  compare(ours, ref, 0.1);
}

TEST_F(PreferenceTrl, DpoTextRecordsTokenizeAsDpoTrainer) { expect_text_records_match(true); }

TEST_F(PreferenceTrl, DpoImplicitPromptRecordsTokenizeAsDpoTrainer) {
  expect_text_records_match(false);
}

}  // namespace
}  // namespace shardlm
