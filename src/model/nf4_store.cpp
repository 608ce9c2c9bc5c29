// The NF4 base's store (nf4_store.h): quantize at load, dequantize a decoder layer on acquire.
#include "nf4_store.h"

#include <vector>

#include "shardlm/core/check.h"
#include "shardlm/quant/nf4.h"

namespace shardlm {

LlamaModel::Nf4Store::Nf4Store(const ParamLayout& layout, DType param_dtype, Backend& backend,
                               MemoryLedger& ledger)
    : layout_(layout), N_(make_nf4_base_layout(layout)), dtype_(param_dtype), be_(backend) {
  const MemPool dev = MemPool::kDevice;
  dense_ = Buffer(backend, ledger, MemCategory::kParams, dev,
                  size_t(N_.dense_elems) * dtype_size(param_dtype));
  codes_ = Buffer(backend, ledger, MemCategory::kParams, dev, size_t(N_.code_bytes));
  absmax_ = Buffer(backend, ledger, MemCategory::kParams, dev, size_t(N_.absmax_values) * 4);
  workspace_ = Buffer(backend, ledger, MemCategory::kWorkspace, dev,
                      size_t(N_.workspace_elems) * dtype_size(param_dtype));
}

void LlamaModel::Nf4Store::set_unit_values(int u, const float* values) {
  SHARDLM_CHECK(holds_ == 0 || workspace_unit_ != u,
                "the NF4 base's unit {} is set while it is acquired", u);
  if (workspace_unit_ == u) workspace_unit_ = -1;
  std::vector<uint8_t> codes;
  std::vector<float> absmax;
  for (const Nf4Segment& s : N_.units[u]) {
    const float* w = values + (s.begin - layout_.units[u].begin);
    if (!s.quantized) {
      be_.convert(Tensor(const_cast<float*>(w), DType::kF32, {s.n}, MemPool::kHost), dense(s));
      continue;
    }
    const int64_t bytes = nf4::packed_bytes(s.n), blocks = nf4::num_blocks(s.n);
    codes.resize(size_t(bytes));
    absmax.resize(size_t(blocks));
    nf4::quantize(w, s.n, codes.data(), absmax.data());
    be_.copy(Tensor(codes.data(), DType::kU8, {bytes}, MemPool::kHost),
             codes_.view(DType::kU8, {N_.code_bytes}).rows(s.code_at, bytes));
    be_.copy(Tensor(absmax.data(), DType::kF32, {blocks}, MemPool::kHost),
             absmax_.view(DType::kF32, {N_.absmax_values}).rows(s.absmax_at, blocks));
  }
}

Tensor LlamaModel::Nf4Store::acquire_params(int u) {
  const int64_t n = layout_.unit_size(u);
  if (!N_.quantized(u)) {  // dense whole: embeddings, final norm and head, an empty layer
    if (n == 0) return Tensor(nullptr, dtype_, {0}, MemPool::kDevice);
    return dense(N_.units[u].front());
  }
  const Tensor unit = workspace_.view(dtype_, {N_.workspace_elems}).rows(0, n);
  if (workspace_unit_ != u) {
    SHARDLM_CHECK(holds_ == 0,
                  "the NF4 base dequantizes one decoder layer at a time: layer {} is acquired "
                  "while layer {} is in use",
                  u - 1, workspace_unit_ - 1);
    for (const Nf4Segment& s : N_.units[u]) {
      const Tensor dst = unit.rows(s.begin - layout_.units[u].begin, s.n);
      if (!s.quantized) {
        be_.copy(dense(s), dst);
        continue;
      }
      be_.nf4_dequantize(
          codes_.view(DType::kU8, {N_.code_bytes}).rows(s.code_at, nf4::packed_bytes(s.n)),
          absmax_.view(DType::kF32, {N_.absmax_values}).rows(s.absmax_at, nf4::num_blocks(s.n)),
          dst);
    }
    workspace_unit_ = u;
  }
  ++holds_;
  return unit;
}

void LlamaModel::Nf4Store::release_params(int u) {
  if (N_.quantized(u) && workspace_unit_ == u && holds_ > 0) --holds_;
}

Tensor LlamaModel::Nf4Store::acquire_grads(int u) {
  SHARDLM_FAIL(ErrorKind::kInternal, "the NF4 base is frozen: unit {} has no gradients", u);
}

}  // namespace shardlm
