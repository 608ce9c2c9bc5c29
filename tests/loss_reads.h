// LossReads: the CPU backend behind a ForwardingBackend that counts the results the host reads
// (read_loss, lm_head_loss, sum_squares, sum_squares_segments: each a wait on a device) and
// the xent_slice_finish calls, with and without a loss accumulator. The model tests hold a
// walk over loss chunks and vocabulary pieces to one read of its loss with it.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>

#include "shardlm/backend/forwarding.h"

namespace shardlm::test {

class LossReads final : public ForwardingBackend {
 public:
  LossReads() : ForwardingBackend(make_backend(DeviceKind::kCpu)) {}
  std::string name() const override { return "cpu+loss reads"; }

  int64_t reads = 0;     // results the host read
  int64_t finishes = 0;  // xent_slice_finish calls
  int64_t counted = 0;   // of those, the ones that added to a loss accumulator

 private:
  void run(OpFamily, HostWaits, std::function<void()> op) override { op(); }
  void do_xent_slice_finish(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                            const Tensor& row_max, const Tensor& stats, float grad_scale,
                            bool want_grad, const Tensor& loss_acc, Workspace ws,
                            float softcap) override {
    ++finishes;
    counted += loss_acc.empty() ? 0 : 1;
    inner().xent_slice_finish(logits, targets, vocab_begin, row_max, stats, grad_scale, want_grad,
                              loss_acc, ws, softcap);
  }
  LossResult do_read_loss(const Tensor& loss_acc) override {
    ++reads;
    return inner().read_loss(loss_acc);
  }
  LossResult do_lm_head_loss(const Tensor& h, const Tensor& w, const Tensor& targets,
                             int64_t chunk_tokens, float grad_scale, const Tensor& dh,
                             const Tensor& dw, Workspace ws, float softcap) override {
    ++reads;
    return inner().lm_head_loss(h, w, targets, chunk_tokens, grad_scale, dh, dw, ws, softcap);
  }
  double do_sum_squares(const Tensor& x) override {
    ++reads;
    return inner().sum_squares(x);
  }
  void do_sum_squares_segments(std::span<const Tensor> xs, std::span<double> sums) override {
    ++reads;
    inner().sum_squares_segments(xs, sums);
  }
};

}  // namespace shardlm::test
