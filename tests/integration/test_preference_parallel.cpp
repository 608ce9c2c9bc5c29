// The preference objectives in parallel: DPO (LoRA and full fine-tuning) and SimPO on the tiny
// model, trained by 2 and 4 ranks at each ZeRO stage (with optimizer and parameter offload),
// under context parallelism (ulysses, ring, hybrid), tensor parallelism, pipeline stages and
// grids of them, against the one-rank run of the same global batch: the step's loss, TRL's
// metrics, the gradient norms and the final weights within a bound, and every rank's measured
// memory its plan (the one-rank run's too). A pair lives in one row, so each data-parallel replica
// computes its pairs' coefficients alone: its cp ranks sum their own tokens' shares of each pair's
// sums over the cp group, its tp ranks reduce the head's row statistics over the tp group, so that
// every rank of the replica weighs its tokens with the same coefficients; under pp the last stage
// computes them at each micro-batch's backward (DPO's reference: a forward-only sweep through the
// stages first). The loss and the metrics are sums over the replicas, the gradients ZeRO's
// reduction of each rank's weighted backward.
//
// The bound (tests/tolerance.h): follow_bounds' relative bound `rel` holds for a sum of per-token
// log-probabilities (all of one sign) computed in another order (a cp group's partial sums added, a
// tp group's vocabulary statistics folded in another order). A pair's DPO argument d = beta ((pi_c
// - ref_c) - (pi_r - ref_r)) then moves by at most beta rel S, S the sum of the four sums'
// magnitudes (SimPO's h likewise, with the means); the loss (slope below 1 in d) and the rewards,
// means over the pairs, by as much. A pair's gradient coefficient beta sigmoid(-d) moves relatively
// by sigmoid(d) |dd| <= beta rel S, and a pair's S is at most (the step's pairs) times the step's
// mean S: that relative move adds to the gradient's own reordering bound (weight_bound is linear in
// it).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "integration/tiny_runs.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using shardlm::test::metric_series;
using shardlm::test::slurp;

constexpr int kSteps = 10;
constexpr double kBeta = 0.1;

fs::path pairs_file() {
  static const fs::path path = shardlm::test::write_pairs_file("preference_parallel_pairs.jsonl");
  return path;
}

fs::path train(int ranks, int micro, int accum, const std::string& name, const std::string& extra) {
  const std::string sets = "--set data.train=" + pairs_file().string() +
                           " --set data.packing=samples --set lora.rank=4 --set train.lr=1e-2 "
                           "--set train.warmup_steps=0 --set train.dpo.beta=0.1 "
                           "--set train.simpo.beta=0.1 " +
                           extra;
  return shardlm::test::train_tiny(ranks, micro, accum, "shardlm_pref_" + name, kSteps, true, sets);
}

// The largest mean S of the one-rank run's steps (above): the policy's sums from logps/*, the
// reference's from logps minus rewards / beta (DPO; SimPO has none, and its logps are means, at
// most the sums in size).
double largest_mean_s(const fs::path& one, bool dpo) {
  const std::vector<double> lc = metric_series(one, "logps/chosen"),
                            lr = metric_series(one, "logps/rejected"),
                            rc = metric_series(one, "rewards/chosen"),
                            rr = metric_series(one, "rewards/rejected");
  double s = 0;
  for (size_t i = 0; i < lc.size(); ++i) {
    double step = std::abs(lc[i]) + std::abs(lr[i]);
    if (dpo) step += std::abs(lc[i] - rc[i] / kBeta) + std::abs(lr[i] - rr[i] / kBeta);
    s = std::max(s, step);
  }
  return s;
}

void expect_series_near(const fs::path& run, const fs::path& one, const char* key, double tol) {
  const std::vector<double> ref = metric_series(one, key), got = metric_series(run, key);
  ASSERT_EQ(got.size(), ref.size()) << key;
  ASSERT_EQ(ref.size(), size_t(kSteps)) << key;
  for (size_t i = 0; i < ref.size(); ++i)
    EXPECT_NEAR(got[i], ref[i], tol) << key << ", step " << i + 1;
}

// Every rank's measured peaks are its plan, category by category, on both pools.
void expect_memory_planned(const fs::path& run, int ranks) {
  for (int r = 0; r < ranks; ++r) {
    const json mem = json::parse(slurp(run / ("memory_rank" + std::to_string(r) + ".json")));
    EXPECT_EQ(mem["peak_by_category"], mem["planned"]["peak_by_category"]) << "rank " << r;
    EXPECT_EQ(mem["host_peak_by_category"], mem["planned"]["host_peak_by_category"])
        << "rank " << r;
  }
}

// The evaluation under the objective (step kSteps, every held-out pair): TRL's eval_ metrics as
// the one-rank run's, within the step metrics' bound from the held-out sums' own S (the
// evaluation losses of tiny_runs.h's expect_follows likewise: the final weights' own difference
// is the reordering's). Its loss is the objective's: no perplexity is logged beside it.
void expect_eval_follows(const fs::path& run, const fs::path& one, bool dpo) {
  const shardlm::test::FollowBounds bound = shardlm::test::follow_bounds(one);
  const std::vector<double> pairs = metric_series(one, "eval_preference_pairs");
  ASSERT_EQ(pairs.size(), 1u);
  ASSERT_GT(pairs[0], 0.0);
  EXPECT_EQ(metric_series(run, "eval_preference_pairs"), pairs);
  EXPECT_TRUE(metric_series(run, "eval_ppl").empty());
  const double lc = metric_series(one, "eval_logps/chosen").at(0),
               lr = metric_series(one, "eval_logps/rejected").at(0);
  double mean_s = std::abs(lc) + std::abs(lr);
  if (dpo)
    mean_s += std::abs(lc - metric_series(one, "eval_rewards/chosen").at(0) / kBeta) +
              std::abs(lr - metric_series(one, "eval_rewards/rejected").at(0) / kBeta);
  auto near = [&](const char* key, double tol) {
    const std::vector<double> ref = metric_series(one, key), got = metric_series(run, key);
    ASSERT_EQ(ref.size(), 1u) << key;
    ASSERT_EQ(got.size(), 1u) << key;
    EXPECT_NEAR(got[0], ref[0], tol) << key;
  };
  const double metric_tol = kBeta * bound.relative * mean_s;
  for (const char* key :
       {"eval_loss", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/margins"})
    near(key, metric_tol);
  for (const char* key : {"eval_logps/chosen", "eval_logps/rejected"})
    near(key, bound.relative * mean_s);
  near("eval_rewards/accuracies", 1.0 / pairs[0]);
}

void expect_follows(const fs::path& run, const fs::path& one, int ranks, bool dpo) {
  const shardlm::test::FollowBounds bound = shardlm::test::follow_bounds(one);
  const std::vector<double> pairs = metric_series(one, "preference_pairs");
  ASSERT_FALSE(pairs.empty());
  const double most_pairs = *std::max_element(pairs.begin(), pairs.end());
  const double mean_s = largest_mean_s(one, dpo);
  // Every metric and the loss: beta rel S on d; the logps themselves: rel times their size.
  const double metric_tol = kBeta * bound.relative * mean_s;
  for (const char* key : {"loss", "rewards/chosen", "rewards/rejected", "rewards/margins"})
    expect_series_near(run, one, key, metric_tol);
  for (const char* key : {"logps/chosen", "logps/rejected"})
    expect_series_near(run, one, key, bound.relative * mean_s);
  // A pair whose margin lies within the bound of zero may count on the other side.
  expect_series_near(run, one, "rewards/accuracies", 1.0 / most_pairs);
  expect_series_near(run, one, "preference_pairs", 0);
  // The gradients: their reordering plus each coefficient's relative move.
  const double coefficient = kBeta * bound.relative * mean_s * most_pairs;
  const std::vector<double> norm = metric_series(run, "grad_norm"),
                            ref_norm = metric_series(one, "grad_norm");
  ASSERT_EQ(norm.size(), ref_norm.size());
  for (size_t i = 0; i < norm.size(); ++i)
    EXPECT_NEAR(norm[i], ref_norm[i], (bound.norm_relative + coefficient) * ref_norm[i])
        << "gradient norm, step " << i + 1;
  const double weights = bound.weights * (1 + coefficient / bound.relative);
  shardlm::test::expect_same_weights(run, one, kSteps, weights);
  expect_eval_follows(run, one, dpo);
  expect_memory_planned(run, ranks);
}

// Full fine-tuning DPO: the reference table of `run` (dpo_reference.json) is the one-rank run's,
// pair by pair, within the bound of a sum of per-token log-probabilities (all of one sign)
// computed in another order: rel times its size.
void expect_same_reference(const fs::path& run, const fs::path& one) {
  const json ref = json::parse(slurp(one / "dpo_reference.json")),
             got = json::parse(slurp(run / "dpo_reference.json"));
  EXPECT_EQ(got["key"]["data"], ref["key"]["data"]);
  EXPECT_EQ(got["key"]["model"], ref["key"]["model"]);
  const double rel = shardlm::test::follow_bounds(one).relative;
  for (const char* side : {"chosen", "rejected"}) {
    const std::vector<double> r = ref[side].get<std::vector<double>>(),
                              g = got[side].get<std::vector<double>>();
    ASSERT_EQ(g.size(), r.size()) << side;
    for (size_t i = 0; i < r.size(); ++i) {
      EXPECT_LT(r[i], 0) << side << ", pair " << i;  // a pair's completion has tokens
      EXPECT_NEAR(g[i], r[i], rel * std::abs(r[i])) << side << ", pair " << i;
    }
  }
}

struct Case {
  const char* name;
  int ranks, micro, accum;
  std::string sets;
};

// Every case against the one-rank run of 4 rows per step; `label` names the runs' directories,
// `sets` is every run's (the one-rank run's too).
void expect_cases_follow(const std::string& objective, const std::string& label,
                         const std::string& sets, const std::vector<Case>& cases) {
  const std::string common = "--set train.objective=" + objective + " " + sets + " ";
  const fs::path one = train(1, 2, 2, label + "_one", common);
  ASSERT_EQ(metric_series(one, "loss").size(), size_t(kSteps));
  expect_memory_planned(one, 1);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const fs::path run = train(c.ranks, c.micro, c.accum, label + "_" + c.name, common + c.sets);
    expect_follows(run, one, c.ranks, objective == "dpo");
    if (fs::exists(one / "dpo_reference.json")) expect_same_reference(run, one);
  }
}

TEST(PreferenceParallel, DpoLoraZeroStagesMatchOneRank) {
  expect_cases_follow(
      "dpo", "dpo", "",
      {{"z0", 2, 1, 2, "--set zero.stage=0"},
       {"z1", 2, 2, 1, "--set zero.stage=1"},
       {"z2_offload", 2, 1, 2, "--set zero.stage=2 --set zero.offload_optimizer=cpu"},
       {"z3_offload", 2, 1, 2,
        "--set zero.stage=3 --set zero.offload_optimizer=cpu --set zero.offload_params=cpu"},
       {"z3_four", 4, 1, 1, "--set zero.stage=3"},
       {"z1_four", 4, 1, 1, "--set zero.stage=1"}});
}

TEST(PreferenceParallel, SimpoLoraZeroStagesMatchOneRank) {
  expect_cases_follow(
      "simpo", "simpo", "",
      {{"z0", 2, 1, 2, "--set zero.stage=0"},
       {"z3_offload", 2, 1, 2, "--set zero.stage=3 --set zero.offload_optimizer=cpu"},
       {"z2_four", 4, 1, 1, "--set zero.stage=2"}});
}

// Full fine-tuning DPO: the reference sums are the initial weights', computed once before the
// first step with each rank's share of the pairs and summed over the ranks (ZeRO-3 gathers the
// parameters for that pass as for a forward), then read two per pair.
TEST(PreferenceParallel, DpoFullFineTuningZeroStagesMatchOneRank) {
  expect_cases_follow(
      "dpo", "dpo_full", "--set lora.rank=0",
      {{"z3", 2, 1, 2, "--set zero.stage=3"},
       {"z1", 2, 2, 1, "--set zero.stage=1"},
       {"z2_offload", 2, 1, 2, "--set zero.stage=2 --set zero.offload_optimizer=cpu"},
       {"z3_offload", 2, 1, 2,
        "--set zero.stage=3 --set zero.offload_optimizer=cpu --set zero.offload_params=cpu"}});
}

// The same on the other axes: each cp rank sums its own tokens of a pair and the cp group adds
// them, one tp rank of a replica gives its sums, the pipeline's last stage holds them after a
// forward-only sweep through the stages; the table is then every rank's.
TEST(PreferenceParallel, DpoFullFineTuningOnEveryAxisMatchesOneRank) {
  expect_cases_follow(
      "dpo", "dpo_full_axes", "--set lora.rank=0",
      {{"tp2", 2, 2, 2, "--set parallel.tp=2"},
       {"cp2_ulysses", 2, 2, 2, "--set parallel.cp=2 --set parallel.cp_kind=ulysses"},
       {"cp2_ring", 2, 2, 2, "--set parallel.cp=2 --set parallel.cp_kind=ring"},
       {"cp4_hybrid", 4, 2, 2, "--set parallel.cp=4 --set parallel.cp_kind=hybrid"},
       {"dp2_cp2_z1", 4, 1, 2,
        "--set parallel.cp=2 --set parallel.cp_kind=ring --set zero.stage=1"},
       {"tp2_cp2", 4, 2, 2,
        "--set parallel.tp=2 --set parallel.cp=2 --set parallel.cp_kind=ulysses"},
       {"tp2_dp2_z3", 4, 1, 2, "--set parallel.tp=2 --set zero.stage=3"},
       {"pp2", 2, 2, 2, "--set parallel.pp=2"},
       {"pp2_tp2_z3", 4, 2, 2, "--set parallel.pp=2 --set parallel.tp=2 --set zero.stage=3"}});
  // Two stages without tp or cp run the one-rank run's kernels on the same micro-batches, layer
  // by layer (the hidden state crosses between them as its bytes): the same bits.
  auto table = [](const std::string& name) {
    const json t =
        json::parse(slurp(shardlm::test::scratch_root() / ("shardlm_pref_dpo_full_axes_" + name) /
                          "run" / "dpo_reference.json"));
    return std::make_pair(t["chosen"], t["rejected"]);
  };
  EXPECT_EQ(table("pp2"), table("one"));
}

// The table is kept in the run directory and read by a resume; `shardlm dpo-reference` writes
// the same file ahead of a run; another data file's key is computed anew, or refused by a run
// that resumes from a checkpoint trained against the old table.
TEST(PreferenceParallel, DpoFullReferenceIsKeptAndKeyed) {
  const std::string full = "--set train.objective=dpo --set lora.rank=0 ";
  const fs::path run = train(1, 2, 2, "dpo_full_key", full);
  const fs::path dir = run.parent_path(), table = run / "dpo_reference.json";
  ASSERT_TRUE(fs::exists(table));
  EXPECT_NE(slurp(dir / "out.txt").find("none yet; computing"), std::string::npos);
  const json first = json::parse(slurp(table));
  EXPECT_GT(first["pairs"].get<int64_t>(), 0);
  // Step 1's policy is the reference: every reward 0, the loss log 2.
  EXPECT_EQ(metric_series(run, "rewards/margins").at(0), 0.0);
  EXPECT_NEAR(metric_series(run, "loss").at(0), std::log(2.0), 1e-12);

  // A resume reads the table (and does not write it again).
  const fs::file_time_type written = fs::last_write_time(table);
  shardlm::test::train_tiny(1, 2, 2, "shardlm_pref_dpo_full_key", kSteps + 2, false,
                            "--set data.train=" + pairs_file().string() +
                                " --set data.packing=samples --set train.lr=1e-2 "
                                "--set train.warmup_steps=0 " +
                                full);
  const std::string resumed = slurp(dir / "out.txt");
  EXPECT_NE(resumed.find("pairs' sums read from"), std::string::npos) << resumed;
  EXPECT_NE(resumed.find("resume: continuing"), std::string::npos) << resumed;
  EXPECT_EQ(fs::last_write_time(table), written);
  // Once more to the same step: nothing to do, said before any reference sums are read.
  shardlm::test::train_tiny(1, 2, 2, "shardlm_pref_dpo_full_key", kSteps + 2, false,
                            "--set data.train=" + pairs_file().string() +
                                " --set data.packing=samples --set train.lr=1e-2 "
                                "--set train.warmup_steps=0 " +
                                full);
  const std::string complete = slurp(dir / "out.txt");
  EXPECT_NE(complete.find("nothing to do"), std::string::npos) << complete;
  EXPECT_EQ(complete.find("dpo reference:"), std::string::npos) << complete;

  // Another data file (one completion changed): a resume refuses, naming the data.
  const fs::path changed = dir / "changed.jsonl";
  {
    std::string text = slurp(pairs_file());
    char& c = text[text.find("\"chosen\":\" ") + 11];  // the completion's first character
    c = c == 'X' ? 'Y' : 'X';
    std::ofstream(changed) << text;
  }
  const std::string options =
      " --config " + std::string(SHARDLM_SOURCE_DIR) +
      "/configs/demo.json --set data.train=" + changed.string() +
      " --set data.seq_len=64 --set model.n_layers=2 --set train.max_steps=" +
      std::to_string(kSteps + 4) +
      " --set sample.count=0 --set data.packing=samples --set log.dir=" + run.string() + " " + full;
  const std::string args = " train" + options;
  EXPECT_EQ(shardlm::test::run_shardlm(1, args, dir / "refused.txt"), 2);
  const std::string refused = slurp(dir / "refused.txt");
  EXPECT_NE(refused.find("its data differs"), std::string::npos) << refused;
  EXPECT_NE(refused.find("train.resume = \"none\""), std::string::npos) << refused;

  // `shardlm dpo-reference` on the changed data computes the new key's table, which a fresh run
  // then reads.
  EXPECT_EQ(shardlm::test::run_shardlm(2, " dpo-reference" + options, dir / "ahead.txt"), 0)
      << slurp(dir / "ahead.txt");
  EXPECT_NE(slurp(dir / "ahead.txt").find("its data differs"), std::string::npos);
  const json second = json::parse(slurp(table));
  EXPECT_NE(second["key"]["data"], first["key"]["data"]);
  EXPECT_EQ(second["key"]["model"], first["key"]["model"]);
  EXPECT_EQ(shardlm::test::run_shardlm(1, args + " --set train.resume=none", dir / "fresh.txt"), 0)
      << slurp(dir / "fresh.txt");
  EXPECT_NE(slurp(dir / "fresh.txt").find("pairs' sums read from"), std::string::npos);
  // Other initial weights (another seed): the model part of the key differs.
  EXPECT_EQ(shardlm::test::run_shardlm(1, " dpo-reference" + options + " --set train.seed=7",
                                       dir / "seed.txt"),
            0)
      << slurp(dir / "seed.txt");
  EXPECT_NE(slurp(dir / "seed.txt").find("its model differs"), std::string::npos)
      << slurp(dir / "seed.txt");
}

// Evaluation under DPO is the objective over the held-out pairs: with a learning rate too small
// to move any weight (1e-30 against f32 weights; LoRA's B from 0 to ~1e-30, below every
// activation's ulp) the policy is the reference, so every held-out pair's rewards are 0 and the
// loss log 2 exactly, with LoRA (the adapters-off forward) and with full fine-tuning (the
// held-out set's table of the initial weights, computed on 2 ranks with ZeRO-3 and kept beside
// the training one). A held-out file's bad record is refused as a training file's.
TEST(PreferenceParallel, DpoEvaluatesTheObjectiveOnTheHeldOutPairs) {
  const std::string still =
      "--set train.objective=dpo --set train.lr=1e-30 --set train.min_lr=0 "
      "--set train.eval_every=5 ";
  for (const auto& [name, ranks, sets] :
       {std::tuple{"eval_lora", 1, std::string()},
        std::tuple{"eval_full", 2, std::string("--set lora.rank=0 --set zero.stage=3")}}) {
    SCOPED_TRACE(name);
    const fs::path run = train(ranks, 1, 2, name, still + sets);
    const std::vector<double> loss = metric_series(run, "eval_loss");
    ASSERT_EQ(loss.size(), 2u);  // steps 5 and 10
    for (const double l : loss) EXPECT_NEAR(l, std::log(2.0), 1e-12);
    for (const double m : metric_series(run, "eval_rewards/margins")) EXPECT_EQ(m, 0.0);
    EXPECT_GT(metric_series(run, "eval_preference_pairs").at(0), 0.0);
    EXPECT_EQ(fs::exists(run / "dpo_reference_valid.json"), sets.find("rank=0") != sets.npos);
  }
  const fs::path dir = shardlm::test::scratch_root() / "shardlm_pref_eval_bad";
  fs::create_directories(dir);
  std::ofstream(dir / "valid.jsonl")
      << json{{"prompt", "In the"}, {"chosen", " beginning"}, {"rejected", " end"}}.dump() << "\n"
      << json{{"prompt", "In the"}, {"chosen", " beginning"}}.dump() << "\n";
  const std::string args = " train --config " + std::string(SHARDLM_SOURCE_DIR) +
                           "/configs/demo.json --set data.train=" + pairs_file().string() +
                           " --set data.valid=" + (dir / "valid.jsonl").string() +
                           " --set data.format=preference --set data.packing=samples "
                           "--set train.objective=dpo --set lora.rank=4 --set log.dir=" +
                           (dir / "run").string();
  EXPECT_EQ(shardlm::test::run_shardlm(1, args, dir / "out.txt"), 3);
  const std::string out = slurp(dir / "out.txt");
  EXPECT_NE(out.find((dir / "valid.jsonl").string() + ":2"), std::string::npos) << out;
  EXPECT_NE(out.find("rejected"), std::string::npos) << out;
}

TEST(PreferenceParallel, DpoLoraContextParallelMatchesOneRank) {
  expect_cases_follow(
      "dpo", "dpo_cp", "",
      {{"cp2_ulysses", 2, 2, 2, "--set parallel.cp=2 --set parallel.cp_kind=ulysses"},
       {"cp2_ring", 2, 2, 2, "--set parallel.cp=2 --set parallel.cp_kind=ring"},
       {"cp4_hybrid", 4, 2, 2, "--set parallel.cp=4 --set parallel.cp_kind=hybrid"},
       {"dp2_cp2_z1", 4, 1, 2,
        "--set parallel.cp=2 --set parallel.cp_kind=ring --set zero.stage=1"}});
}

TEST(PreferenceParallel, DpoLoraTensorParallelMatchesOneRank) {
  expect_cases_follow("dpo", "dpo_tp", "",
                      {{"tp2", 2, 2, 2, "--set parallel.tp=2"},
                       {"tp2_dp2_z3", 4, 1, 2, "--set parallel.tp=2 --set zero.stage=3"},
                       {"tp2_cp2", 4, 2, 2,
                        "--set parallel.tp=2 --set parallel.cp=2 "
                        "--set parallel.cp_kind=ulysses"}});
}

TEST(PreferenceParallel, DpoLoraPipelineStagesMatchOneRank) {
  expect_cases_follow("dpo", "dpo_pp", "",
                      {{"pp2", 2, 2, 2, "--set parallel.pp=2"},
                       {"pp2_dp2_z1", 4, 1, 2, "--set parallel.pp=2 --set zero.stage=1"},
                       {"pp2_cp2", 4, 2, 2,
                        "--set parallel.pp=2 --set parallel.cp=2 "
                        "--set parallel.cp_kind=ring"},
                       {"pp2_tp2", 4, 2, 2, "--set parallel.pp=2 --set parallel.tp=2"}});
}

TEST(PreferenceParallel, SimpoLoraContextTensorAndPipelineParallelMatchOneRank) {
  expect_cases_follow(
      "simpo", "simpo_axes", "",
      {{"cp2_ulysses", 2, 2, 2, "--set parallel.cp=2 --set parallel.cp_kind=ulysses"},
       {"cp2_ring", 2, 2, 2, "--set parallel.cp=2 --set parallel.cp_kind=ring"},
       {"tp2", 2, 2, 2, "--set parallel.tp=2"},
       {"tp2_dp2_z1", 4, 1, 2, "--set parallel.tp=2 --set zero.stage=1"},
       {"pp2", 2, 2, 2, "--set parallel.pp=2"}});
}

// SimPO needs no reference, so it also trains the whole model: with tied embeddings, whose
// matrix the weighted head walk and the embedding both update (on the last and the first stage
// under pp), its gradients complete once per micro-batch for ZeRO's reduction.
TEST(PreferenceParallel, SimpoFullTiedOnEveryAxisMatchesOneRank) {
  expect_cases_follow(
      "simpo", "simpo_full", "--set lora.rank=0 --set model.tie_embeddings=true",
      {{"full_dp2_z0", 2, 1, 2, "--set zero.stage=0"},
       {"full_dp2_z3", 2, 1, 2, "--set zero.stage=3"},
       {"full_pp2", 2, 2, 2, "--set parallel.pp=2"},
       {"full_tp2", 2, 2, 2, "--set parallel.tp=2"},
       {"full_cp2", 2, 2, 2, "--set parallel.cp=2 --set parallel.cp_kind=ring"},
       {"full_pp2_tp2_z3", 4, 2, 2, "--set parallel.pp=2 --set parallel.tp=2 --set zero.stage=3"}});
}

}  // namespace
