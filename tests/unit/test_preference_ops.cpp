// The preference ops of the CPU backend (segment_logp_sums, preference_coefficients,
// gather_segment_weights) give the trainer's host computation bit for bit: each pair's sums as
// sum_span adds the logps read_target_logps makes, its coefficients and metrics as pair_result
// (preference.h) gives them, and the token weights on the spans' target positions. The two share
// preference_loss.h; this checks that the op adds in the same order and that its file is compiled
// as the trainer is (no contraction), for every loss kind, under the plain and the queued CPU
// backend.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "shardlm/backend/backend.h"
#include "train/preference.h"

namespace shardlm::trainer_detail {
namespace {

// A micro-batch's head statistics: n rows, every 5th without a target (statistics (0, 0)).
struct Rows {
  std::vector<float> row_max, stats;
  std::vector<int32_t> targets;
};
Rows rows(int64_t n, uint64_t seed) {
  Rows r{std::vector<float>(size_t(n)), std::vector<float>(size_t(2 * n)),
         std::vector<int32_t>(size_t(n), 1)};
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.f, 3.f);
  for (int64_t i = 0; i < n; ++i) {
    r.row_max[i] = d(rng);
    if (i % 5 == 2) {
      r.targets[i] = kIgnoreIndex;
      continue;  // (0, 0)
    }
    r.stats[2 * i] = 1.f + std::abs(d(rng)) * 30.f;
    r.stats[2 * i + 1] = r.row_max[i] - std::abs(d(rng));
  }
  return r;
}

// read_target_logps' host log-probabilities.
std::vector<double> host_logps(const Rows& r) {
  std::vector<double> l(r.row_max.size());
  for (size_t i = 0; i < l.size(); ++i)
    l[i] = r.stats[2 * i] == 0.f ? 0.0
                                 : double(r.stats[2 * i + 1]) - double(r.row_max[i]) -
                                       std::log(double(r.stats[2 * i]));
  return l;
}

// The segments of `pairs`: 2k on pair k's chosen span, 2k + 1 on its rejected, -1 elsewhere.
std::vector<int32_t> segments_of(const std::vector<PairSpans>& pairs, int64_t n) {
  std::vector<int32_t> seg(size_t(n), -1);
  for (size_t k = 0; k < pairs.size(); ++k) {
    for (int64_t i = pairs[k].chosen.begin; i < pairs[k].chosen.end; ++i) seg[i] = int32_t(2 * k);
    for (int64_t i = pairs[k].rejected.begin; i < pairs[k].rejected.end; ++i)
      seg[i] = int32_t(2 * k + 1);
  }
  return seg;
}

template <typename T>
Tensor host(std::vector<T>& v, DType t, Shape s) {
  return Tensor(v.data(), t, s, MemPool::kHost);
}

void expect_bits(double got, double want, const std::string& what) {
  EXPECT_EQ(std::bit_cast<uint64_t>(got), std::bit_cast<uint64_t>(want))
      << what << ": " << got << " vs the host's " << want;
}

void check_kind(Backend& be, const PreferenceLoss& loss) {
  // Pairs of uneven lengths in two rows of 96 (prompts before them), one empty chosen span.
  const int64_t n = 192;
  std::vector<PairSpans> pairs;
  for (const auto& [c0, c1, r1] : std::vector<std::tuple<int64_t, int64_t, int64_t>>{
           {5, 30, 61}, {61, 61, 90}, {100, 140, 150}, {150, 171, 192}})
    pairs.push_back({{c0, c1}, {c1, r1}});
  const Rows policy = rows(n, 1), reference = rows(n, 2);
  std::vector<double> pol_logps = host_logps(policy), ref_logps = host_logps(reference);
  const int64_t S = 2 * int64_t(pairs.size());
  std::vector<int32_t> seg = segments_of(pairs, n);
  auto device_sums = [&](Rows r) {  // a copy: the host tensors point into it
    std::vector<double> sums(size_t(2 * S));
    be.segment_logp_sums(host(r.row_max, DType::kF32, {n}), host(r.stats, DType::kF32, {n, 2}),
                         host(seg, DType::kI32, {n}), host(sums, DType::kF64, {S, 2}));
    be.synchronize();
    return sums;
  };
  std::vector<double> pol = device_sums(policy), ref = device_sums(reference);
  std::vector<float> coef(static_cast<size_t>(S));
  std::vector<double> metrics(size_t(kPreferenceMetrics), 0.0);
  const double norm = 1.0 / 3.0;
  be.preference_coefficients(loss, host(pol, DType::kF64, {S, 2}),
                             loss.needs_reference() ? host(ref, DType::kF64, {S, 2}) : Tensor(),
                             norm, host(coef, DType::kF32, {S}),
                             host(metrics, DType::kF64, {kPreferenceMetrics}));
  std::vector<float> weights(size_t(n), -1.f);
  be.gather_segment_weights(host(coef, DType::kF32, {S}), host(seg, DType::kI32, {n}),
                            host(weights, DType::kF32, {n}));
  be.synchronize();

  PreferenceSums want;
  for (size_t k = 0; k < pairs.size(); ++k) {
    PairLogps p;
    int64_t count = 0;
    sum_span(pairs[k].chosen, pol_logps, policy.targets, p.chosen, p.n_chosen);
    sum_span(pairs[k].rejected, pol_logps, policy.targets, p.rejected, p.n_rejected);
    if (loss.needs_reference()) {
      sum_span(pairs[k].chosen, ref_logps, policy.targets, p.ref_chosen, count);
      sum_span(pairs[k].rejected, ref_logps, policy.targets, p.ref_rejected, count);
    }
    const std::string at = "pair " + std::to_string(k);
    if (loss.needs_reference()) {
      expect_bits(ref[4 * k], p.ref_chosen, at + " reference chosen sum");
      expect_bits(ref[4 * k + 2], p.ref_rejected, at + " reference rejected sum");
    }
    expect_bits(pol[4 * k], p.chosen, at + " chosen sum");
    expect_bits(pol[4 * k + 1], double(p.n_chosen), at + " chosen count");
    expect_bits(pol[4 * k + 2], p.rejected, at + " rejected sum");
    expect_bits(pol[4 * k + 3], double(p.n_rejected), at + " rejected count");
    const PairResult r = pair_result(loss, p);
    want.add(r.sums);
    EXPECT_EQ(std::bit_cast<uint32_t>(coef[2 * k]),
              std::bit_cast<uint32_t>(float(-r.d_chosen * norm)))
        << at << " chosen coefficient";
    EXPECT_EQ(std::bit_cast<uint32_t>(coef[2 * k + 1]),
              std::bit_cast<uint32_t>(float(-r.d_rejected * norm)))
        << at << " rejected coefficient";
  }
  const double w[kPreferenceMetrics] = {
      want.loss,         want.rewards_chosen, want.rewards_rejected, want.accuracies,
      want.logps_chosen, want.logps_rejected, double(pairs.size())};
  for (int64_t j = 0; j < kPreferenceMetrics; ++j)
    expect_bits(metrics[j], w[j], "metrics[" + std::to_string(j) + "]");
  // The weights: the coefficient on a span's target positions, 0 elsewhere (the host's
  // fill_weights; a position without a target gets no gradient from the head either way).
  for (int64_t i = 0; i < n; ++i)
    EXPECT_EQ(weights[i], seg[i] >= 0 ? coef[size_t(seg[i])] : 0.f) << "token " << i;
}

std::vector<PreferenceLoss> kinds() {
  using Kind = PreferenceLoss::Kind;
  return {{Kind::kDpoSigmoid, 0.1, 0, 0},
          {Kind::kDpoSigmoid, 0.3, 0.2, 0},
          {Kind::kDpoIpo, 0.1, 0, 0},
          {Kind::kSimpo, 2.0, 0, 0.7}};
}

TEST(PreferenceOps, CpuOpsGiveTheHostComputationBitForBit) {
  for (const DeviceKind kind : {DeviceKind::kCpu, DeviceKind::kCpuQueued}) {
    const std::unique_ptr<Backend> be = make_backend(kind);
    for (const PreferenceLoss& loss : kinds()) {
      SCOPED_TRACE(be->name() + " kind " + std::to_string(int(loss.kind)));
      check_kind(*be, loss);
    }
  }
}

// A micro-batch's pair list is reserved for the bound plan.h counts (a pair is two sequences of
// at least one token in one row: B * (T / 2) pairs) and filled without growing, so the bytes
// the runner and the evaluation charge are the planned ones; a list reserved for fewer refuses
// instead of growing.
TEST(PreferenceHostRows, PairListsHoldThePlannedBytes) {
  constexpr int64_t T = 8, B = 2;
  std::vector<int32_t> tokens;
  std::vector<int64_t> docs;
  for (int k = 0; k < 16; ++k) {  // 8 pairs of one-token sequences: 4 fill a row
    docs.push_back(int64_t(tokens.size()));
    tokens.push_back(10 + k);
  }
  const auto src = make_memory_source(tokens, docs, "pairs", std::vector<uint8_t>(16, 1),
                                      /*paired=*/true);
  const Dataset data(src, T, 1, 0, -1, {Packing::kSamples, Overlong::kError});
  ASSERT_EQ(data.num_windows(), 2);
  const std::vector<int64_t> order = {0, 1};
  std::vector<PairSpans> list = pair_list(data, B);
  EXPECT_EQ(int64_t(list.capacity() * sizeof(PairSpans)),
            max_micro_batch_pairs(B, T) * kPreferencePairBytes);
  const PairSpans* at = list.data();
  micro_batch_pairs(data, order, 0, B, list);
  EXPECT_EQ(int64_t(list.size()), max_micro_batch_pairs(B, T));  // the bound, reached
  EXPECT_EQ(list.data(), at);
  EXPECT_EQ(list[5].chosen.begin, T + 2);  // row 1's second pair
  EXPECT_EQ(list[5].rejected.end, T + 4);
  EXPECT_EQ(list[5].nth, 1);
  std::vector<PairSpans> small;
  small.reserve(3);
  EXPECT_THROW(micro_batch_pairs(data, order, 0, B, small), Error);
}

// A model with token weights and the head holds read_target_logps' host rows in the ledger with
// the bytes the planner counts (target_logps_host_bytes), and reads a micro-batch's target
// log-probabilities through them; a model without token weights holds none.
TEST(PreferenceHostRows, TargetLogpsRowsAreLedgeredAsPlanned) {
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::kCpu);
  ModelConfig cfg = model_preset("tiny");
  cfg.n_layers = 1;
  ModelOptions opt;
  opt.max_batch = 2;
  opt.max_seq = 24;
  for (const bool weights : {false, true}) {
    opt.token_weights = weights;
    MemoryLedger ledger;
    LlamaModel model(cfg, opt, *be, ledger);
    EXPECT_EQ(ledger.current(MemPool::kHost, MemCategory::kActivations),
              weights ? int64_t(target_logps_host_bytes(opt)) : 0);
    if (!weights) continue;
    model.init_weights(3);
    const BatchInputs in = model.inputs(2, 24);
    for (int64_t i = 0; i < 48; ++i) {
      in.tokens.i32()[i] = int32_t(i * 7 % cfg.vocab_size);
      in.targets.i32()[i] = i % 24 == 23 ? kIgnoreIndex : int32_t((i + 1) * 7 % cfg.vocab_size);
      in.positions.i32()[i] = int32_t(i % 24);
      in.seg_start.i32()[i] = 0;
    }
    std::vector<double> logps(48);
    model.forward_target_logps(2, 24, /*base_only=*/false, logps);
    for (int64_t i = 0; i < 48; ++i) {
      if (i % 24 == 23) {
        EXPECT_EQ(logps[size_t(i)], 0.0) << i;  // no target
      } else {
        EXPECT_LT(logps[size_t(i)], 0.0) << i;
        EXPECT_GT(logps[size_t(i)], -50.0) << i;
      }
    }
  }
}

}  // namespace
}  // namespace shardlm::trainer_detail
