// LlamaModel's LoRA adapters on the targeted projections: y += alpha/r * dropout(x) A^T B^T
// forward, and the adapters' gradients (and their share of dx) backward, with the counter-based
// dropout mask recomputed identically in backward (model/lora.h).
#include "llama_views.h"

namespace shardlm {

Tensor LlamaModel::lora_input(int l, LoraTarget t, const Tensor& x, int64_t row0) {
  if (!dropout_active_) return x;
  const int64_t n = x.dim(0), in = x.dim(1);
  const Tensor xd = lora_views_[4].rows(0, n * in).view({n, in});
  // One mask per (micro-batch key, layer, target); element = the token's index in the step
  // times the input width plus the column, so chunked and recomputed rows draw the same bits.
  const uint64_t key =
      dropout_key_ * 0x9e3779b97f4a7c15ULL + uint64_t(l * kNumLoraTargets + int(t));
  be_.dropout(x, xd, float(opt_.lora.dropout), key, (dropout_token0_ + row0) * in);
  return xd;
}

void LlamaModel::lora_forward(int l, LoraTarget t, const Tensor& x, const Tensor& y, int64_t row0) {
  if (!lora_on(l, t)) return;
  const int64_t n = x.dim(0), in = x.dim(1), out = y.dim(1), r = opt_.lora.rank;
  const int64_t begin = lora_layout_.params.units[l].begin;
  const Tensor& p = unit_adapters_[l];
  SHARDLM_CHECK(!p.empty(), "adapters of layer {} used without being acquired", l);
  const Tensor A = p.rows(lora_layout_.a[l][int(t)] - begin, r * in).view({r, in});
  const Tensor Bw = p.rows(lora_layout_.b[l][int(t)] - begin, out * r).view({out, r});
  const Tensor u = lora_views_[0].rows(0, n * r).view({n, r});       // [n, r]
  const Tensor yl = lora_views_[2].rows(0, n * out).view({n, out});  // [n, out]
  be_.linear_forward(lora_input(l, t, x, row0), A, Tensor(), u);
  be_.linear_forward(u, Bw, Tensor(), yl);
  be_.scale(yl, opt_.lora.scaling());
  be_.add(y, yl, y);
}

void LlamaModel::lora_backward(int l, LoraTarget t, const Tensor& x, const Tensor& dy,
                               const Tensor& dx, int64_t row0) {
  if (!lora_on(l, t)) return;
  const int64_t n = x.dim(0), in = x.dim(1), out = dy.dim(1), r = opt_.lora.rank;
  const int64_t begin = lora_layout_.params.units[l].begin;
  const Tensor& p = unit_adapters_[l];
  const Tensor& g = unit_adapter_grads_[l];
  SHARDLM_CHECK(!p.empty() && !g.empty(), "adapters of layer {} used without being acquired", l);
  const int64_t a_off = lora_layout_.a[l][int(t)] - begin,
                b_off = lora_layout_.b[l][int(t)] - begin;
  // The adapters in the activation dtype, their gradients f32.
  const Tensor A = p.rows(a_off, r * in).view({r, in});     // [r, in]
  const Tensor Bw = p.rows(b_off, out * r).view({out, r});  // [out, r]
  const Tensor dA = g.rows(a_off, r * in).view({r, in});    // [r, in] f32
  const Tensor dB = g.rows(b_off, out * r).view({out, r});  // [out, r] f32
  auto view = [&](int i, int64_t cols) { return lora_views_[i].rows(0, n * cols).view({n, cols}); };
  const Tensor u = view(0, r), du = view(1, r), dys = view(2, out), dxl = view(3, in);
  const Tensor xin = lora_input(l, t, x, row0);  // the forward's input, recomputed
  be_.linear_forward(xin, A, Tensor(), u);
  be_.copy(dy, dys);
  be_.scale(dys, opt_.lora.scaling());
  be_.linear_backward(u, Bw, dys, du, dB, Tensor());   // du = s dy B;  dB += s dy^T u
  be_.linear_backward(xin, A, du, dxl, dA, Tensor());  // dxl = du A;   dA += du^T xin
  if (dropout_active_) {
    const uint64_t key =
        dropout_key_ * 0x9e3779b97f4a7c15ULL + uint64_t(l * kNumLoraTargets + int(t));
    be_.dropout(dxl, dxl, float(opt_.lora.dropout), key, (dropout_token0_ + row0) * in);
  }
  be_.add(dx, dxl, dx);
}

}  // namespace shardlm
