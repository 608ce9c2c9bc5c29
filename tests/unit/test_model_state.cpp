// Model-state accounting (plan/model_state.h) against figures it did not produce: the ZeRO
// paper's worked example, exact arithmetic on a small case, DeepSpeed's own estimators for the
// presets (run through the Python venv; skipped with a message without it), and the planner,
// whose model-state categories must be these bytes, in the pool the engine keeps them in.
#include "shardlm/plan/model_state.h"

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "shardlm/config/config.h"
#include "shardlm/core/check.h"
#include "shardlm/model/config.h"
#include "shardlm/model/layout.h"
#include "shardlm/plan/plan.h"
#include "shardlm/planner/plan_inputs.h"
#include "test_util.h"

namespace shardlm {
namespace {

// Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion Parameter Models",
// Figure 1: 7.5B parameters, 64 ranks, mixed-precision Adam (K = 12). The paper gives decimal
// GB rounded to three significant digits: 120, 31.4, 16.6 and 1.88 (1.9 in the text).
TEST(ModelState, ZeroPaperFigure1) {
  const int64_t params = 7'500'000'000;
  const std::array<double, 4> paper_gb{120, 31.4, 16.6, 1.88};
  const std::array<double, 4> rounding{0.5, 0.05, 0.05, 0.005};
  // Exactly: (2 + 2 + 12) P; (2 + 2) P + 12 P / 64; 2 P + (2 + 12) P / 64; 16 P / 64.
  const std::array<int64_t, 4> exact{120'000'000'000, 31'406'250'000, 16'640'625'000,
                                     1'875'000'000};
  for (int stage = 0; stage <= 3; ++stage) {
    const ModelStateBytes b = model_state_bytes(params, 64, stage, kZeroPaperAccounting);
    EXPECT_EQ(b.total(), exact[stage]) << "stage " << stage;
    EXPECT_NEAR(double(b.total()) / 1e9, paper_gb[stage], rounding[stage]) << "stage " << stage;
  }
}

// 10 parameters over 4 ranks: each owns ceil(10 / 4) = 3.
TEST(ModelState, SmallExact) {
  auto at = [](int stage, const ModelStateAccounting& a) {
    return model_state_bytes(10, 4, stage, a);
  };
  const ModelStateAccounting paper = kZeroPaperAccounting;
  EXPECT_EQ(at(0, paper).params, 20);
  EXPECT_EQ(at(0, paper).grads, 20);
  EXPECT_EQ(at(0, paper).optimizer, 120);
  EXPECT_EQ(at(1, paper).optimizer, 36);
  EXPECT_EQ(at(1, paper).grads, 20);
  EXPECT_EQ(at(2, paper).grads, 6);
  EXPECT_EQ(at(2, paper).params, 20);
  EXPECT_EQ(at(3, paper).params, 6);
  EXPECT_EQ(at(3, paper).total(), 48);

  // shardlm with bf16 parameters: fp32 gradients (and an fp32 reduced shard at stage 1 only),
  // fp32 master weights and moments.
  const ModelStateAccounting bf16 = shardlm_accounting(DType::kBF16, false);
  EXPECT_EQ(at(0, bf16).total(), 10 * (2 + 4 + 12));
  EXPECT_EQ(at(1, bf16).grads, 10 * 4 + 3 * 4);
  EXPECT_EQ(at(1, bf16).optimizer, 3 * 12);
  EXPECT_EQ(at(2, bf16).total(), 10 * 2 + 3 * (4 + 12));
  EXPECT_EQ(at(3, bf16).total(), 3 * (2 + 4 + 12));
  // fp32 parameters need no master copy unless the optimizer lives on the host.
  EXPECT_EQ(shardlm_accounting(DType::kF32, false).optimizer_bytes, 8);
  EXPECT_EQ(shardlm_accounting(DType::kF32, true).optimizer_bytes, 12);
  EXPECT_THROW(model_state_bytes(10, 4, 4, paper), Error);
  EXPECT_THROW(model_state_bytes(10, 0, 1, paper), Error);
}

const std::vector<std::string> kPresets{"llama3.2-1b", "llama3.1-8b", "mistral-7b", "qwen2.5-0.5b",
                                        "qwen2.5-7b"};

// The planner's parameters, gradients and optimizer state are model_state_bytes under
// shardlm's accounting over the ZeRO layout (the ledger tests check the planner against the
// engine's allocations).
TEST(ModelState, PlannerCountsTheseBytes) {
  for (const std::string& name : {std::string("llama3.2-1b"), std::string("qwen2.5-0.5b")})
    for (int stage = 0; stage <= 3; ++stage)
      for (bool offload : {false, true}) {
        PlanInputs in;
        in.model = model_preset(name);
        in.param_dtype = DType::kBF16;
        in.dp = 8;
        in.zero_stage = stage;
        in.offload_optimizer = offload;
        const MemoryPlan plan = plan_memory(in);
        const ZeroLayout z = make_zero_layout(make_param_layout(in.model), 8, in.bucket_elems);
        const ModelStateBytes ms = model_state_bytes(z.padded_total, z.shard, stage,
                                                     shardlm_accounting(in.param_dtype, offload));
        const auto& dev = plan.by_category[int(MemPool::kDevice)];
        const auto& host = plan.by_category[int(MemPool::kHost)];
        const int64_t rope = in.model.head_dim() / 2 * 4;
        const std::string where = name + " stage " + std::to_string(stage);
        // From stage 2 an offloaded optimizer's gradient shard is streamed to the host.
        const bool streamed = stage >= 2 && offload;
        EXPECT_EQ(dev[int(MemCategory::kParams)] - rope, ms.params) << where;
        EXPECT_EQ((streamed ? host : dev)[int(MemCategory::kGrads)], ms.grads) << where;
        EXPECT_EQ((streamed ? dev : host)[int(MemCategory::kGrads)], 0) << where;
        EXPECT_EQ((offload ? host : dev)[int(MemCategory::kOptimizer)], ms.optimizer) << where;
      }
}

// Llama-3.1-8B on one rank at ZeRO-3 with the optimizer and the parameters offloaded (README's
// `shardlm plan` example on configs/demo.json, with the offloads): the f32 gradient shard
// (8.03 G parameters, 29.9 GiB) is on the host with the optimizer, and the device holds no
// model state, only the buffers: the rotating gradient buckets and their reduced chunks.
TEST(ModelState, Llama8BStage3OffloadKeepsNoGradientsOnTheDevice) {
  const RunConfig cfg =
      load_run_config(std::string(SHARDLM_SOURCE_DIR) + "/configs/demo.json",
                      {"model.preset=llama3.1-8b", "data.seq_len=8192", "train.micro_batch=1",
                       "precision.param=bf16", "zero.stage=3", "memory.checkpointing=full",
                       "zero.offload_optimizer=cpu", "zero.offload_params=cpu"});
  const std::unique_ptr<Backend> be = make_backend(DeviceKind::kCpu);
  const MemoryPlan plan = plan_memory(plan_inputs_for(cfg, 1, *be));
  const ZeroOptions zopt = zero_options_for(cfg);
  const ParamLayout L = make_param_layout(cfg.model);
  const ZeroLayout z =
      make_zero_layout(L, 1, zopt.bucket_elems, zero_splits_tables(zopt.stage, zopt.split_tables));
  const auto& dev = plan.by_category[int(MemPool::kDevice)];
  const auto& host = plan.by_category[int(MemPool::kHost)];
  EXPECT_GT(z.shard, int64_t(8e9));
  EXPECT_EQ(dev[int(MemCategory::kGrads)], 0);
  EXPECT_EQ(host[int(MemCategory::kGrads)], z.shard * 4);
  EXPECT_EQ(dev[int(MemCategory::kOptimizer)], 0);
  EXPECT_EQ(dev[int(MemCategory::kParams)], cfg.model.head_dim() / 2 * 4);  // rotary table only
  // Host staging: each of the two gradient buffers' reduced chunk, copied out, and the
  // checkpoint's staging buffer.
  EXPECT_EQ(host[int(MemCategory::kHostOffload)],
            zero_grad_buffers(false) * z.max_chunk * 4 +
                zero_checkpoint_stage_elems(z, zopt.bucket_elems) * 4);
  // The device's largest category is the buffers, the largest bucket a few times over, not
  // anything the size of the model; the embeddings and the head in pieces, a layer is the
  // largest bucket.
  EXPECT_LT(plan.peak_bytes[int(MemPool::kDevice)], z.shard * 4);
  EXPECT_EQ(z.max_bucket, L.max_layer);
}

// DeepSpeed's estimators (deepspeed 0.19; deepspeed_model_states.py runs them) count, per GPU:
//  ZeRO-2, no offload:  2 P (16-bit parameters) + int(18 P / N) (16-bit and fp32 gradients,
//                       fp32 master, m, v). That is kDeepSpeedZero2Accounting at stage 2.
//  ZeRO-2, offload:     2 P: only the 16-bit parameters stay on the GPU.
//  ZeRO-3, no offload:  4 L + int(18 P / N), L the largest layer's parameters: 4 L is a buffer
//                       (the gathered layer's 16-bit parameters and gradients), the rest is
//                       kDeepSpeedZero3Accounting at stage 3.
//  ZeRO-3, offload optimizer: 4 L + int(2 P / N): the 16-bit parameter shard.
//  ZeRO-3, offload optimizer and parameters: 4 L, no model state on the GPU.
// Their CPU figures multiply by a 1.5 "buffer factor" and are not compared. We split P over N
// ranks as ceil(P / N) each where DeepSpeed truncates the product, so we may be above by less
// than the bytes of one parameter (18). L is the largest tensor (the embedding or LM head, as
// DeepSpeed's model_to_params finds it: the largest module's own parameters).
TEST(ModelState, DeepSpeedEstimators) {
  const std::filesystem::path venv = test::venv_dir(), python = venv / "bin/python";
  if (!std::filesystem::exists(python))
    SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("deepspeed"));

  struct Case {
    std::string preset;
    int world;
    int64_t total, largest;
  };
  std::vector<Case> cases;
  nlohmann::json request = nlohmann::json::array();
  for (const std::string& name : kPresets) {
    const ParamLayout L = make_param_layout(model_preset(name));
    int64_t largest = 0;
    for (const ParamEntry& e : L.entries) largest = std::max(largest, e.shape.numel());
    for (int world : {1, 8, 64}) {
      cases.push_back({name, world, L.total, largest});
      request.push_back({{"total", L.total}, {"largest", largest}, {"world", world}});
    }
  }
  const std::string script =
      std::string(SHARDLM_SOURCE_DIR) + "/tests/unit/deepspeed_model_states.py";
  const std::string cmd = "'" + python.string() + "' '" + script + "' '" + request.dump() + "'";
  FILE* pipe = popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr) << cmd;
  std::string text;
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), pipe)) text.append(buf.data(), n);
  const int status = pclose(pipe);
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (rc == 3) SHARDLM_MISSING_REFERENCE(test::venv_skip_reason("deepspeed"));
  ASSERT_EQ(rc, 0) << cmd << "\n" << text;
  // DeepSpeed may print before the JSON line: take the last line.
  const size_t last = text.find_last_of('\n', text.size() >= 2 ? text.size() - 2 : 0);
  const nlohmann::json ds =
      nlohmann::json::parse(last == std::string::npos ? text : text.substr(last));
  ASSERT_EQ(ds.size(), cases.size());

  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const nlohmann::json& d = ds[i];
    const std::string where = c.preset + " on " + std::to_string(c.world);
    const int64_t buffer = 4 * c.largest;
    ASSERT_EQ(d["zero3_largest_layer_bytes"].get<int64_t>(), buffer) << where;
    const ModelStateBytes z2 = model_state_bytes(c.total, c.world, 2, kDeepSpeedZero2Accounting);
    const ModelStateBytes z3 = model_state_bytes(c.total, c.world, 3, kDeepSpeedZero3Accounting);
    auto expect_close = [&](int64_t ours, int64_t theirs, const char* what) {
      EXPECT_GE(ours, theirs) << where << ", " << what;
      EXPECT_LT(ours - theirs, 18) << where << ", " << what;
    };
    expect_close(z2.total(), d["zero2_gpu"].get<int64_t>(), "ZeRO-2");
    EXPECT_EQ(z2.params, d["zero2_offload_gpu"].get<int64_t>()) << where << ", ZeRO-2 offload";
    expect_close(z3.total(), d["zero3_gpu"].get<int64_t>() - buffer, "ZeRO-3");
    expect_close(z3.params, d["zero3_offload_gpu"].get<int64_t>() - buffer, "ZeRO-3 offload");
    EXPECT_EQ(d["zero3_offload_params_gpu"].get<int64_t>(), buffer) << where;
  }
}

}  // namespace
}  // namespace shardlm
