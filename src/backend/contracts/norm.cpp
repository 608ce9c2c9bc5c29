// The contracts of the per-token transforms: rmsnorm_forward, rmsnorm_backward, the fused residual
// add and norm add_rmsnorm_forward, rope_forward, rope_backward and their two-tensor form
// rope_qk_forward, rope_qk_backward.
#include "backend/contracts/checks.h"

namespace shardlm {
namespace {

using namespace contract;  // NOLINT: the contract helpers are this file's vocabulary

// x [N, D]; w [D] of x's dtype; rstd [N] f32
void check_rmsnorm(const Tensor& x, const Tensor& w, const Tensor& rstd, std::string_view op) {
  check_float(x, 2, op, "x");
  check_like(w, x, 1, op, "w", "x");
  check_tensor(rstd, DType::kF32, 1, op, "rstd");
  SHARDLM_CHECK(w.dim(0) == x.dim(1), "{}: w is {} but x is [N, D] = {}; w must be [D]", op,
                w.shape().str(), x.shape().str());
  SHARDLM_CHECK(rstd.dim(0) == x.dim(0), "{}: rstd is {} but x is [N, D] = {}; it must be [N]", op,
                rstd.shape().str(), x.shape().str());
}

// [N, D] like x
void check_like_x(const Tensor& t, const Tensor& x, std::string_view op, std::string_view name) {
  check_like(t, x, 2, op, name, "x");
  check_same_shape(t, x, op, name, "x");
}

// x [N, H, Dh] with Dh even; positions [N] i32; inv_freq [R/2] f32 with 2 <= R <= Dh
void check_rope(const Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                std::string_view op, std::string_view name = "x") {
  check_float(x, 3, op, name);
  check_tensor(positions, DType::kI32, 1, op, "positions");
  check_tensor(inv_freq, DType::kF32, 1, op, "inv_freq");
  SHARDLM_CHECK(x.dim(2) % 2 == 0, "{}: {} is [N, H, Dh] = {}; Dh must be even", op, name,
                x.shape().str());
  SHARDLM_CHECK(positions.dim(0) == x.dim(0), "{}: positions is {} but {} is [N, H, Dh] = {}", op,
                positions.shape().str(), name, x.shape().str());
  SHARDLM_CHECK(inv_freq.dim(0) >= 1 && inv_freq.dim(0) <= x.dim(2) / 2,
                "{}: inv_freq is {}, expected [R/2] for the R rotated dims, 2 <= R <= Dh = {}", op,
                inv_freq.shape().str(), x.dim(2));
}

// q [N, Hq, Dh] and k [N, Hk, Dh] of one dtype, each a rope operand, in separate memory (each is
// rotated in place while the other is).
void check_rope_qk(const Tensor& q, const Tensor& k, const Tensor& positions,
                   const Tensor& inv_freq, std::string_view op, std::string_view q_name,
                   std::string_view k_name) {
  check_rope(q, positions, inv_freq, op, q_name);
  check_rope(k, positions, inv_freq, op, k_name);
  check_like(k, q, 3, op, k_name, q_name);
  const auto* a = static_cast<const std::byte*>(q.data());
  const auto* b = static_cast<const std::byte*>(k.data());
  const bool overlap = q.numel() > 0 && k.numel() > 0 && q.pool() == k.pool() &&
                       a < b + k.bytes() && b < a + q.bytes();
  SHARDLM_CHECK(!overlap, "{}: {} {} and {} {} share memory; each must be its own tensor", op,
                q_name, q.shape().str(), k_name, k.shape().str());
}

}  // namespace

void Backend::rmsnorm_forward(const Tensor& x, const Tensor& w, float eps, const Tensor& y,
                              const Tensor& rstd, float w_offset) {
  constexpr std::string_view op = "rmsnorm_forward";
  check_rmsnorm(x, w, rstd, op);
  check_like_x(y, x, op, "y");
  SHARDLM_CHECK(eps >= 0.0f, "rmsnorm_forward: eps = {} must be >= 0", eps);
  SHARDLM_CHECK(x.dim(0) == 0 || x.dim(1) > 0, "rmsnorm_forward: x {} has zero columns",
                x.shape().str());
  do_rmsnorm_forward(x, w, eps, y, rstd, w_offset);
}

void Backend::add_rmsnorm_forward(const Tensor& x, const Tensor& residual, const Tensor& w,
                                  float eps, const Tensor& y, const Tensor& rstd, float w_offset) {
  constexpr std::string_view op = "add_rmsnorm_forward";
  check_rmsnorm(residual, w, rstd, op);
  check_like_x(x, residual, op, "x");
  check_like_x(y, residual, op, "y");
  check_disjoint(y, residual, op, "y", "residual");
  check_disjoint(y, x, op, "y", "x");
  check_disjoint(residual, x, op, "residual", "x");
  SHARDLM_CHECK(eps >= 0.0f, "add_rmsnorm_forward: eps = {} must be >= 0", eps);
  SHARDLM_CHECK(residual.dim(0) == 0 || residual.dim(1) > 0,
                "add_rmsnorm_forward: residual {} has zero columns", residual.shape().str());
  do_add_rmsnorm_forward(x, residual, w, eps, y, rstd, w_offset);
}

void Backend::rmsnorm_backward(const Tensor& x, const Tensor& w, const Tensor& rstd,
                               const Tensor& dy, const Tensor& dx, const Tensor& dw,
                               float w_offset) {
  constexpr std::string_view op = "rmsnorm_backward";
  check_rmsnorm(x, w, rstd, op);
  check_like_x(dy, x, op, "dy");
  check_like_x(dx, x, op, "dx");
  check_tensor(dw, DType::kF32, 1, op, "dw");
  check_same_shape(dw, w, op, "dw", "w");
  do_rmsnorm_backward(x, w, rstd, dy, dx, dw, w_offset);
}

void Backend::rope_forward(const Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                           RopePairs pairs) {
  check_rope(x, positions, inv_freq, "rope_forward");
  do_rope_forward(x, positions, inv_freq, pairs);
}

void Backend::rope_backward(const Tensor& dx, const Tensor& positions, const Tensor& inv_freq,
                            RopePairs pairs) {
  check_rope(dx, positions, inv_freq, "rope_backward");
  do_rope_backward(dx, positions, inv_freq, pairs);
}

void Backend::rope_qk_forward(const Tensor& q, const Tensor& k, const Tensor& positions,
                              const Tensor& inv_freq, RopePairs pairs) {
  check_rope_qk(q, k, positions, inv_freq, "rope_qk_forward", "q", "k");
  do_rope_qk_forward(q, k, positions, inv_freq, pairs);
}

void Backend::rope_qk_backward(const Tensor& dq, const Tensor& dk, const Tensor& positions,
                               const Tensor& inv_freq, RopePairs pairs) {
  check_rope_qk(dq, dk, positions, inv_freq, "rope_qk_backward", "dq", "dk");
  do_rope_qk_backward(dq, dk, positions, inv_freq, pairs);
}

}  // namespace shardlm
