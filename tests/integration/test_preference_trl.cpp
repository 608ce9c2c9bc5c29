// The preference objectives against TRL (trl 1.x in the venv): a random Llama made by
// transformers with a PEFT adapter (random A and B on every projection) trains one step of DPO
// (sigmoid, ipo, and label smoothing) and of SimPO on three pre-tokenized pairs, two of them
// sharing a row, through shardlm's preference runner; DPOTrainer (the reference: the base with
// the adapter off) and CPOTrainer (loss_type "simpo", cpo_alpha 0) on the same pairs give the
// loss, TRL's rewards and logps metrics and the adapter's gradients within a bound. cDPO is
// checked against TRL 1.x's loss combination that equals it: 2 (1 - e) sigmoid - (1 - 2 e)
// robust (trl 1.x's sigmoid loss no longer reads label_smoothing).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "shardlm/backend/backend.h"
#include "shardlm/hf/hf.h"
#include "shardlm/io/safetensors.h"
#include "shardlm/model/llama.h"
#include "test_util.h"
#include "tolerance.h"
#include "train/preference.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using trainer_detail::PreferenceLoss;

constexpr int64_t kT = 32, kB = 2;

struct Pair {
  std::vector<int32_t> prompt, chosen, rejected;
};
// Pairs 0 and 1 share a row under best-fit decreasing at T = 32; token 1 is the eos.
const std::vector<Pair> kPairs = {{{5, 77, 123, 9}, {250, 31, 1}, {299, 0, 42, 1}},
                                  {{17, 180}, {42, 17, 8, 1}, {9, 1}},
                                  {{3, 4, 5, 6, 7, 8, 9, 10, 11}, {12, 13, 14, 1}, {15, 16, 1}}};

struct Shared {
  fs::path root, base, adapter, pairs;
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
    s.pairs = s.root / "pairs.json";
    const std::string src = std::string(SHARDLM_SOURCE_DIR) + "/tests/integration/";
    test::run_command(s.python + " " + src + "hf_reference.py make " + s.base.string() + " llama",
                      s.root / "make.txt", true);
    test::run_command(s.python + " " + src + "preference_reference.py adapter " + s.base.string() +
                          " " + s.adapter.string(),
                      s.root / "adapter.txt", true);
    json pairs = json::array();
    for (const Pair& p : kPairs)
      pairs.push_back(
          {{"prompt_ids", p.prompt}, {"chosen_ids", p.chosen}, {"rejected_ids", p.rejected}});
    std::ofstream(s.pairs) << pairs.dump();
    return s;
  }();
  return s;
}

json reference(const std::string& kind, const json& config) {
  const Shared& s = shared();
  const std::string out = test::run_command(
      s.python + " " + SHARDLM_SOURCE_DIR + "/tests/integration/preference_reference.py " + kind +
          " " + s.base.string() + " " + s.adapter.string() + " " + s.pairs.string() + " '" +
          config.dump() + "' 2>/dev/null",
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
  double loss = 0;
  trainer_detail::PreferenceSums sums;
  std::map<std::string, std::vector<float>> grads;
  ModelConfig cfg;
};

Ours run_ours(const PreferenceLoss& loss) {
  const Shared& s = shared();
  const HfModelInfo info = read_hf_config(s.base.string());
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  ModelOptions opt;
  opt.max_batch = kB;
  opt.max_seq = kT;
  opt.token_weights = true;
  opt.lora.rank = 4;
  opt.lora.alpha = 8;
  opt.lora.targets = lora_targets_from_string("all");
  LlamaModel model(info.config, opt, *be, ledger);
  const SafetensorsDir st(s.base.string());
  const ParamLayout& L = model.layout();
  for (int u = 0; u < int(L.units.size()); ++u)
    read_hf_unit(st, L, u, model.params().f32() + L.units[u].begin);
  const SafetensorsFile a((s.adapter / "adapter_model.safetensors").string());
  for (const ParamEntry& e : model.lora_layout().params.entries)
    a.read_f32(e.name, model.lora_params().f32() + e.offset);
  be->zero(model.lora_grads());

  Dataset data(pair_source(), kT, 1, 0, -1, {Packing::kSamples, Overlong::kError});
  EXPECT_EQ(data.num_windows(), 2);  // pairs 0 and 1 in one row
  std::vector<int64_t> order(size_t(data.num_windows()));
  for (size_t i = 0; i < order.size(); ++i) order[i] = int64_t(i);
  trainer_detail::InputStaging staging(*be, ledger, kB * kT);
  const trainer_detail::StepParts parts{model, nullptr, data, *be, staging, kB, kT, kT, 1, 0};
  const auto runner = trainer_detail::make_preference_runner(parts, loss);
  const trainer_detail::StepSums sums =
      runner->run({order, 0, 0, 1, data.targets_per_epoch(), int64_t(kPairs.size())});
  Ours out;
  out.loss = sums.loss_sum / double(kPairs.size());
  out.sums = sums.preference;
  out.cfg = info.config;
  for (const ParamEntry& e : model.lora_layout().params.entries)
    out.grads[e.name].assign(model.lora_grads().f32() + e.offset,
                             model.lora_grads().f32() + e.offset + e.shape.numel());
  return out;
}

// The bound: every log-probability sum is a reduction through the decoder, off by at most
// reorder_tolerance(chain) of the magnitude of its terms (the completions' summed |log p|,
// `logps_scale`); the loss, the metrics and each pair's coefficient move by at most `lipschitz`
// times that. Gradients: the coefficient's error times the unweighted gradient plus the chain's
// own error, relative to the largest gradient element.
void compare(const Ours& ours, const json& ref, double lipschitz) {
  const double n = double(kPairs.size());
  const double chain = test::reorder_tolerance(test::reduction_chain(ours.cfg, kT, kB));
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
  double largest = 0, moved = 0;
  for (const auto& [name, g] : ours.grads) {
    ASSERT_TRUE(ref["grads"].contains(name)) << name;
    for (float x : g) largest = std::max(largest, double(std::abs(x)));
  }
  ASSERT_GT(largest, 0.0);
  for (const auto& [name, g] : ours.grads) {
    const std::vector<double> want = ref["grads"][name].get<std::vector<double>>();
    ASSERT_EQ(want.size(), g.size()) << name;
    for (size_t i = 0; i < g.size(); ++i) moved = std::max(moved, std::abs(double(g[i]) - want[i]));
  }
  EXPECT_LE(moved, tol * largest + chain * largest) << "adapter gradients, largest " << largest;
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
  compare(run_ours(loss), reference("dpo", {{"beta", 0.1}, {"loss_type", {"sigmoid"}}}), 0.1);
}

TEST_F(PreferenceTrl, DpoIpoMatchesDpoTrainer) {
  PreferenceLoss loss;
  loss.kind = PreferenceLoss::Kind::kDpoIpo;
  loss.beta = 0.5;
  // (h - 1 / (2 beta))^2 with h an average of log-ratios: Lipschitz 2 |h - 1 / (2 beta)| <= 2 (1 +
  // 1)
  compare(run_ours(loss), reference("dpo", {{"beta", 0.5}, {"loss_type", {"ipo"}}}), 4.0);
}

TEST_F(PreferenceTrl, ConservativeDpoMatchesDpoTrainer) {
  PreferenceLoss loss;
  loss.beta = 0.1;
  loss.label_smoothing = 0.2;
  const double e = 0.2;
  compare(run_ours(loss),
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
  compare(run_ours(loss), reference("simpo", {{"beta", 2.0}, {"simpo_gamma", 0.5}}), 2.0);
}

}  // namespace
}  // namespace shardlm
