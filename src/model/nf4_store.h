// LlamaModel's store for a frozen LoRA base in NF4 (LoraConfig::nf4_base, model/nf4_base.h):
// the dense parts in the parameter dtype, the decoder projections as NF4 codes and absmax, all
// on the device, and a one-layer workspace in the parameter dtype. Acquiring a decoder layer
// dequantizes its projections into the workspace (Backend::nf4_dequantize) and copies its norms
// and biases beside them, so the layer's code reads the same flat unit as from any store; the
// workspace keeps the last layer, so the backward's first layer (the forward's last) is not
// dequantized twice. One decoder layer at a time. Private to src/model.
#pragma once

#include "shardlm/core/buffer.h"
#include "shardlm/model/llama.h"
#include "shardlm/model/nf4_base.h"

namespace shardlm {

class LlamaModel::Nf4Store final : public ParamStore {
 public:
  Nf4Store(const ParamLayout& layout, DType param_dtype, Backend& backend, MemoryLedger& ledger);

  // Unit u from f32 host values: dense parts converted, projections quantized on the host.
  void set_unit_values(int u, const float* values);

  void begin_pass(Pass) override {}
  void end_pass() override {}
  Tensor acquire_params(int u) override;
  void release_params(int u) override;
  Tensor acquire_grads(int u) override;
  void release_grads(int) override {}

 private:
  Tensor dense(const Nf4Segment& s) const {
    return dense_.view(dtype_, {N_.dense_elems}).rows(s.dense_at, s.n);
  }

  const ParamLayout& layout_;
  Nf4BaseLayout N_;
  DType dtype_;
  Backend& be_;
  Buffer dense_;             // [dense_elems] param dtype (params)
  Buffer codes_;             // [code_bytes] u8 (params)
  Buffer absmax_;            // [absmax_values] f32 (params)
  Buffer workspace_;         // [workspace_elems] param dtype: the dequantized layer (workspace)
  int workspace_unit_ = -1;  // the layer the workspace holds
  int holds_ = 0;            // its acquisitions not yet released
};

}  // namespace shardlm
