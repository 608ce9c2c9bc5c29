// The logits comparison the Hugging Face tests share: shardlm's logits of the last position for
// every prefix of a token list (what the Python references print for transformers), and the
// scaled-error check between two such tables; the logits a PEFT reference script prints and the
// check that its adapter changed them. Tests only.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardlm/model/llama.h"
#include "tolerance.h"

namespace shardlm::test {

// [T][V]: row t-1 holds the logits after the prefix tokens[0..t) (one sequence, one document).
// model.options().max_seq must be at least tokens.size().
inline std::vector<std::vector<float>> prefix_logits(LlamaModel& model,
                                                     const std::vector<int32_t>& tokens) {
  std::vector<std::vector<float>> all;
  for (int64_t T = 1; T <= int64_t(tokens.size()); ++T) {
    BatchInputs in = model.inputs(1, T);
    for (int64_t t = 0; t < T; ++t) {
      in.tokens.i32()[t] = tokens[t];
      in.targets.i32()[t] = kIgnoreIndex;
      in.positions.i32()[t] = int32_t(t);
      in.seg_start.i32()[t] = 0;
    }
    std::vector<float> logits;
    model.forward_last_logits(T, logits);
    all.push_back(logits);
  }
  return all;
}

// a equals b at every position and vocabulary entry, within the bound on two f32 forwards of the
// model `cfg` that sum in other orders (tests/tolerance.h: transformers' kernels and shardlm's),
// relative to the position's largest logit.
inline void expect_logits_near(const std::vector<std::vector<float>>& a,
                               const std::vector<std::vector<float>>& b, const ModelConfig& cfg,
                               const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  const double tol = reorder_tolerance(reduction_chain(cfg, int64_t(a.size()), 1));
  double worst = 0;
  for (size_t t = 0; t < a.size(); ++t) {
    ASSERT_EQ(a[t].size(), b[t].size()) << what;
    double scale = 0;
    for (float x : b[t]) scale = std::max(scale, std::abs(double(x)));
    for (size_t v = 0; v < a[t].size(); ++v)
      worst = std::max(worst, std::abs(double(a[t][v]) - double(b[t][v])) / (tol * scale));
  }
  EXPECT_LE(worst, 1.0) << what << ": logits differ beyond " << tol
                        << " of the largest (scaled error " << worst << ")";
}

// What a PEFT reference script (lora_reference.py, bnb4bit_reference.py) prints as its last line
// (libraries may print warnings before it): the logits of the base alone, of PeftModel(base,
// adapter) and of transformers on the merged directory.
struct PeftLogits {
  std::vector<std::vector<float>> base, peft, merged;
};

inline PeftLogits peft_logits_from(const std::string& out) {
  const nlohmann::json ref = nlohmann::json::parse(out.substr(out.rfind("{\"base\"")));
  using Logits = std::vector<std::vector<float>>;
  return {ref["base"].get<Logits>(), ref["peft"].get<Logits>(), ref["merged"].get<Logits>()};
}

// The adapters matter: the base alone is further from PeftModel's logits than any tolerance.
inline void expect_adapter_changes_logits(const PeftLogits& ref) {
  double diff = 0;
  for (size_t t = 0; t < ref.base.size(); ++t)
    for (size_t v = 0; v < ref.base[t].size(); ++v)
      diff = std::max(diff, double(std::abs(ref.base[t][v] - ref.peft[t][v])));
  EXPECT_GT(diff, 1e-3) << "the adapter changed nothing";
}

}  // namespace shardlm::test
