// A Backend whose do_<op> implementations only record that they ran, host memory for the
// tensors of one test, and the check that a call is rejected before any do_<op> ran: what the
// entry-point contract tests (src/backend/contracts/) need to test the entry point alone. Tests
// only.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "shardlm/backend/backend.h"
#include "test_util.h"

namespace shardlm::test {

class RecordingBackend final : public Backend {
 public:
  std::vector<std::string> ran;                  // the do_<op> calls, in order
  size_t workspace = 0;                          // what every *_workspace_bytes query answers
  mutable std::vector<int64_t> planned_windows;  // the windows of the last plan query
  OutputMode linear_forward_mode{};              // what the last do_linear_forward was given
  Tensor linear_forward_residual;

  std::string name() const override { return "recording"; }
  void* allocate(size_t bytes, MemPool) override { return std::malloc(bytes == 0 ? 1 : bytes); }
  void deallocate(void* p, size_t, MemPool) override { std::free(p); }
  size_t attention_workspace_bytes(int64_t, int64_t, int64_t, int64_t, int64_t) const override {
    return workspace;
  }
  size_t attention_block_workspace_bytes(int64_t, int64_t, int64_t, int64_t, int64_t,
                                         int64_t) const override {
    return workspace;
  }
  size_t attention_decode_workspace_bytes(int64_t, int64_t, int64_t, int64_t,
                                          int64_t) const override {
    return workspace;
  }
  size_t attention_plan_workspace_bytes(int64_t, int64_t, int64_t, int64_t, int64_t,
                                        std::span<const int64_t> windows) const override {
    planned_windows.assign(windows.begin(), windows.end());
    return workspace;
  }
  size_t attention_block_plan_workspace_bytes(int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                                              std::span<const int64_t> windows) const override {
    planned_windows.assign(windows.begin(), windows.end());
    return workspace;
  }

 private:
  void record(const char* op) { ran.emplace_back(op); }
  void do_zero(const Tensor&) override { record("zero"); }
  void do_copy(const Tensor&, const Tensor&) override { record("copy"); }
  void do_copy_blocks(const Tensor&, const Tensor&, const BlockCopy&) override {
    record("copy_blocks");
  }
  void do_convert(const Tensor&, const Tensor&) override { record("convert"); }
  void do_add(const Tensor&, const Tensor&, const Tensor&) override { record("add"); }
  void do_scale(const Tensor&, float) override { record("scale"); }
  void do_scale_rows(const Tensor&, const Tensor&) override { record("scale_rows"); }
  void do_sum_squares_segments(std::span<const Tensor>, std::span<double>) override {
    record("sum_squares_segments");
  }
  void do_nf4_dequantize(const Tensor&, const Tensor&, const Tensor&) override {
    record("nf4_dequantize");
  }
  double do_sum_squares(const Tensor&) override {
    record("sum_squares");
    return 0;
  }
  void do_linear_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         OutputMode mode, const Tensor& residual) override {
    record("linear_forward");
    linear_forward_mode = mode;
    linear_forward_residual = residual;
  }
  void do_linear_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&, OutputMode) override {
    record("linear_backward");
  }
  void do_embedding_forward(const Tensor&, const Tensor&, const Tensor&) override {
    record("embedding_forward");
  }
  void do_embedding_backward(const Tensor&, const Tensor&, const Tensor&) override {
    record("embedding_backward");
  }
  void do_embedding_forward_slice(const Tensor&, const Tensor&, int64_t, int64_t,
                                  const Tensor&) override {
    record("embedding_forward_slice");
  }
  void do_embedding_backward_slice(const Tensor&, const Tensor&, int64_t, int64_t,
                                   const Tensor&) override {
    record("embedding_backward_slice");
  }
  void do_rmsnorm_forward(const Tensor&, const Tensor&, float, const Tensor&, const Tensor&,
                          float) override {
    record("rmsnorm_forward");
  }
  void do_add_rmsnorm_forward(const Tensor&, const Tensor&, const Tensor&, float, const Tensor&,
                              const Tensor&, float) override {
    record("add_rmsnorm_forward");
  }
  void do_rmsnorm_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                           const Tensor&, const Tensor&, float) override {
    record("rmsnorm_backward");
  }
  void do_rope_forward(const Tensor&, const Tensor&, const Tensor&, RopePairs) override {
    record("rope_forward");
  }
  void do_rope_backward(const Tensor&, const Tensor&, const Tensor&, RopePairs) override {
    record("rope_backward");
  }
  void do_rope_qk_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          RopePairs) override {
    record("rope_qk_forward");
  }
  void do_rope_qk_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                           RopePairs) override {
    record("rope_qk_backward");
  }
  void do_swiglu_forward(const Tensor&, const Tensor&, const Tensor&) override {
    record("swiglu_forward");
  }
  void do_geglu_forward(const Tensor&, const Tensor&, const Tensor&) override {
    record("geglu_forward");
  }
  void do_geglu_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                         const Tensor&) override {
    record("geglu_backward");
  }
  void do_swiglu_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&) override {
    record("swiglu_backward");
  }
  void do_attention_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                            const Tensor&, const Tensor&, Workspace, const DocumentSpans&, int64_t,
                            float) override {
    record("attention_forward");
  }
  void do_attention_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                             const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                             const Tensor&, const Tensor&, Workspace, const DocumentSpans&, int64_t,
                             float) override {
    record("attention_backward");
  }
  void do_attention_block_forward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  int64_t, int64_t, const Tensor&, const Tensor&, Workspace,
                                  int64_t, float) override {
    record("attention_block_forward");
  }
  void do_attention_block_backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                   int64_t, int64_t, const Tensor&, const Tensor&, const Tensor&,
                                   const Tensor&, const Tensor&, const Tensor&, Workspace, int64_t,
                                   float) override {
    record("attention_block_backward");
  }
  void do_attention_merge(const Tensor&, const Tensor&, const Tensor&, const Tensor&) override {
    record("attention_merge");
  }
  void do_attention_decode(const Tensor&, const Tensor&, const Tensor&, int64_t, const Tensor&,
                           Workspace, float) override {
    record("attention_decode");
  }
  size_t do_lm_head_loss_workspace_bytes(int64_t, int64_t, DType) const override {
    return workspace;
  }
  LossResult do_lm_head_loss(const Tensor&, const Tensor&, const Tensor&, int64_t, float,
                             const Tensor&, const Tensor&, Workspace, float) override {
    record("lm_head_loss");
    return {};
  }
  void do_xent_slice_max(const Tensor&, const Tensor&, float) override { record("xent_slice_max"); }
  void do_xent_slice_stats(const Tensor&, const Tensor&, int64_t, int64_t, const Tensor&,
                           const Tensor&, float) override {
    record("xent_slice_stats");
  }
  void do_xent_slice_fold(const Tensor&, const Tensor&, int64_t, int64_t, const Tensor&,
                          const Tensor&, bool, float) override {
    record("xent_slice_fold");
  }
  void do_xent_slice_finish(const Tensor&, const Tensor&, int64_t, const Tensor&, const Tensor&,
                            float, bool, const Tensor&, Workspace, float) override {
    record("xent_slice_finish");
  }
  LossResult do_read_loss(const Tensor&) override {
    record("read_loss");
    return {};
  }
  void do_adamw_step(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                     const AdamWHyper&) override {
    record("adamw_step");
  }
  void do_adamw_step_segments(std::span<const AdamWSegment>, const AdamWHyper&) override {
    record("adamw_step_segments");
  }
  void do_segment_logp_sums(const Tensor&, const Tensor&, const Tensor&, const Tensor&) override {
    record("segment_logp_sums");
  }
  void do_preference_coefficients(const PreferenceLossSpec&, const Tensor&, const Tensor&, double,
                                  const Tensor&, const Tensor&) override {
    record("preference_coefficients");
  }
  void do_gather_segment_weights(const Tensor&, const Tensor&, const Tensor&) override {
    record("gather_segment_weights");
  }
};

// Host memory for the tensors of one test: f32, bf16, i32, u8 or f64 views of zeroed storage.
struct Arena {
  std::vector<std::vector<float>> f32s;
  std::vector<std::vector<uint16_t>> bf16s;
  std::vector<std::vector<int32_t>> i32s;
  Tensor f32(Shape s) { return view(f32s.emplace_back(s.numel()), s); }
  Tensor bf16(Shape s) {
    return Tensor(bf16s.emplace_back(s.numel()).data(), DType::kBF16, s, MemPool::kHost);
  }
  Tensor i32(Shape s) { return view(i32s.emplace_back(s.numel()), s); }
  std::vector<std::vector<uint8_t>> u8s;
  Tensor u8(Shape s) {
    return Tensor(u8s.emplace_back(s.numel()).data(), DType::kU8, s, MemPool::kHost);
  }
  std::vector<std::vector<double>> f64s;
  Tensor f64(Shape s) {
    return Tensor(f64s.emplace_back(s.numel()).data(), DType::kF64, s, MemPool::kHost);
  }
};

// Runs `call`, which must throw naming `what` before any do_<op> ran.
inline void expect_rejected(RecordingBackend& be, const std::function<void()>& call,
                            const std::string& what) {
  be.ran.clear();
  try {
    call();
    ADD_FAILURE() << "accepted; expected an error naming '" << what << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
  }
  EXPECT_TRUE(be.ran.empty()) << "the implementation ran: " << be.ran.front();
}

}  // namespace shardlm::test
