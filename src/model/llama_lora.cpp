// LlamaModel's LoRA adapters on the targeted projections: y += s dropout(x) A^T B^T forward
// (s = alpha / r), and the adapters' gradients and their share of dx backward, with the
// counter-based dropout mask recomputed identically in backward (model/lora.h). Under tensor
// parallelism the adapters are split with their base projection (model/tensor_shard.h), so the
// same code runs on each rank's shard: a row-parallel projection's partial update joins its
// partial output before the sum over the group, a column-parallel one's input gradient joins
// the base's before the column region's reduction. The update's
// GEMMs accumulate straight into y and dx (OutputMode::kAccumulate): s scales the [n, r]
// intermediates in place, so no [n, out] or [n, in] term is ever held, except the input
// gradient with dropout, which is masked before it is added.
#include "llama_views.h"

namespace shardlm {

Tensor LlamaModel::lora_input(int l, LoraTarget t, const Tensor& x, int64_t row0) {
  if (!dropout_active_) return x;
  const int64_t n = x.dim(0), in = x.dim(1);
  const Tensor xd = lora_views_.x.rows(0, n * in).view({n, in});  // [n, in]
  drop_lora_input(l, t, x, xd, row0);
  return xd;
}

// The mask of the whole projection's input: under tensor parallelism a row-parallel
// projection's (o, down) input x [n, in / tp] is this rank's block of columns, drawn where the
// one-rank model draws them; a column-parallel one's input is whole on every rank.
void LlamaModel::drop_lora_input(int l, LoraTarget t, const Tensor& x, const Tensor& out,
                                 int64_t row0) {
  const int64_t in = x.dim(1);
  const bool cols_split = seam_->tp_size() > 1 && (t == LoraTarget::kO || t == LoraTarget::kDown);
  const int64_t whole = cols_split ? in * seam_->tp_size() : in;
  const int64_t first = (dropout_token0_ + row0) * whole + (cols_split ? seam_->tp_rank() * in : 0);
  be_.dropout(x, out, float(opt_.lora.dropout), lora_dropout_key(l, t), first,
              cols_split ? whole : 0);
}

// One mask per (micro-batch key, layer, target); element = the token's index in the step times
// the input width plus the column, so chunked and recomputed rows draw the same bits.
uint64_t LlamaModel::lora_dropout_key(int l, LoraTarget t) const {
  return dropout_key_ * 0x9e3779b97f4a7c15ULL + uint64_t(l * kNumLoraTargets + int(t));
}

void LlamaModel::lora_forward(int l, LoraTarget t, const Tensor& x, const Tensor& y, int64_t row0) {
  if (!lora_on(l, t)) return;
  const int64_t n = x.dim(0), in = x.dim(1), out = y.dim(1), r = opt_.lora.rank;
  const int64_t begin = lora_layout_.params.units[l].begin;
  const Tensor& p = unit_adapters_[l];
  SHARDLM_CHECK(!p.empty(), "adapters of layer {} used without being acquired", l);
  const Tensor A = p.rows(lora_layout_.a[l][int(t)] - begin, r * in).view({r, in});     // [r, in]
  const Tensor Bw = p.rows(lora_layout_.b[l][int(t)] - begin, out * r).view({out, r});  // [out, r]
  const Tensor su = lora_views_.u.rows(0, n * r).view({n, r});                          // [n, r]
  be_.linear_forward(lora_input(l, t, x, row0), A, Tensor(), su);    // u = dropout(x) A^T
  be_.scale(su, opt_.lora.scaling());                                // s u
  be_.linear_forward(su, Bw, Tensor(), y, OutputMode::kAccumulate);  // y [n, out] += (s u) B^T
}

// With v = s u = s xin A^T and y += v B^T: dB += dy^T v, and dv = dy B gives du = s dv, so
// dA += du^T xin and dx += du A (masked first with dropout) -- the same gradients as scaling dy.
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
  const Tensor su = lora_views_.u.rows(0, n * r).view({n, r}),
               du = lora_views_.du.rows(0, n * r).view({n, r});  // [n, r]
  const float s = opt_.lora.scaling();
  const Tensor xin = lora_input(l, t, x, row0);  // [n, in]: the forward's input, recomputed
  be_.linear_forward(xin, A, Tensor(), su);
  be_.scale(su, s);                                   // s u, bitwise the forward's
  be_.linear_backward(su, Bw, dy, du, dB, Tensor());  // du = dy B;  dB += dy^T (s u)
  be_.scale(du, s);                                   // s dy B
  if (!dropout_active_) {                             // dx += (s du) A;  dA += (s du)^T xin
    be_.linear_backward(xin, A, du, dx, dA, Tensor(), OutputMode::kAccumulate);
    return;
  }
  const Tensor dxl = lora_views_.dx.rows(0, n * in).view({n, in});  // [n, in]
  be_.linear_backward(xin, A, du, dxl, dA, Tensor());               // dxl = (s du) A
  drop_lora_input(l, t, dxl, dxl, row0);
  be_.add(dx, dxl, dx);
}

}  // namespace shardlm
