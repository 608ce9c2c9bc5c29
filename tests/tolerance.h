// Tolerances from bounds, for the tests that compare two computations of one quantity which
// differ only in the order of their floating-point operations: ranks and micro-batches reduced
// in another order, a table folded piece by piece, a matrix split over tensor-parallel ranks,
// OpenBLAS's kernels (chosen by CPU and OPENBLAS_CORETYPE). A tolerance that held on one machine
// is not a bound; these are, under the model written here, and every test derives its own from
// the dtype and the lengths of its reductions through these functions. Tests only.
//
// Rounding (Higham, "Accuracy and Stability of Numerical Algorithms", 2nd ed., 2.2 and 3.1):
//  - unit roundoff u = 2^-p for a p-bit significand: f32 2^-24, bf16 2^-8, f64 2^-53;
//  - a sum of n terms accumulated in precision u, in any order, is within gamma_n * sum|x_i|
//    of the exact sum, gamma_n = n u / (1 - n u); a dot product of length n likewise with
//    sum|x_i y_i|. Two orders of the same terms therefore differ by at most 2 gamma_n sum|terms|;
//  - a value stored in a narrower type (bf16 activations, weights or wire) is within u of it,
//    relative, once per rounding.
// A quantity computed through a chain of such operations (layer after layer, forward then
// backward) carries, to first order, the sum of their relative errors: gamma of the chain's
// summed reduction lengths (reduction_chain). The model assumes each operation passes a relative
// error on with a gain of at most one with respect to the magnitude of its terms (normalised
// layers, softmax, Lipschitz activations, the tests' random inputs with no cancellation beyond
// their own scale). So the scale of a comparison is the magnitude of what is compared: a loss
// (a sum of positive per-token terms) relative to itself, a tensor relative to its largest
// element or its norm.
//
// bf16: two runs whose f32 values differ in their last bits round some stored bf16 values the
// other way. There is no useful worst-case bound: every store along the chain may round the other
// way, 2 r u, a quarter of a loss through two layers. The probabilistic model of Higham and Mary
// ("A new approach to probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019)
// treats rounding errors as independent, mean zero and at most u: a mean over `terms` quantities
// (tokens of a loss, the tokens summed into a weight's gradient), each through `roundings` bf16
// stores, is then off by at most lambda u sqrt(roundings / terms) of their magnitude with
// probability at least 1 - 2 exp(-lambda^2 / 2) (Hoeffding's inequality); lambda = 7 makes that
// 5e-11 per comparison (bf16_mean_tolerance).
//
// Weights after optimizer steps: an update that is Lipschitz in the gradient, with constant L in
// the max norm over the gradient history, turns gradient differences of at most delta_j at step
// j into weight differences of at most sum_j L delta_j (first order: the change parted weights
// make to later gradients is of second order while the steps times lr times the loss's
// curvature stay below one, as in these tests' few small steps).
//  - SGD: L = lr.
//  - AdamW: lr m^ / (sqrt(v^) + eps) with bias-corrected moments. m^ is a convex combination of
//    the gradients so far and sqrt(v^) their weighted root mean square: both 1-Lipschitz in the
//    max norm. d/dm^ is at most 1/eps; |d/dsqrt(v^)| = |m^| / (sqrt(v^) + eps)^2 <= C / (4 eps),
//    with |m^| <= C sqrt(v^) by Cauchy-Schwarz, C^2 = max_t sum_j a_j^2 / b_j over the two
//    moments' weights a, b (adam_moment_ratio). So L = lr (1 + C / 4) / eps. Decoupled weight
//    decay only contracts. With eps far below a gradient element, L is no bound worth having:
//    a rarely seen embedding row (moments of 1e-6..1e-9) turns a last-bit difference of its
//    gradient into a weight difference of up to lr. Tests that compare weights after AdamW
//    therefore set eps above the scale of their gradients' differences, so that the bound
//    stays well below the lr-sized difference a wrong update makes.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "shardlm/core/check.h"
#include "shardlm/core/dtype.h"
#include "shardlm/model/config.h"

namespace shardlm::test {

// u = 2^-p for the dtype's p-bit significand (f32 p = 24, bf16 p = 8, f64 p = 53).
inline double unit_roundoff(DType dt) {
  switch (dt) {
    case DType::kF32:
      return 0x1p-24;
    case DType::kBF16:
      return 0x1p-8;
    case DType::kF64:
      return 0x1p-53;
    default:
      SHARDLM_CHECK(false, "unit_roundoff: not a floating-point dtype");
  }
  return 0;
}

// gamma_n = n u / (1 - n u): the relative bound on a length-n sum in precision u.
inline double gamma_n(DType dt, int64_t n) {
  const double nu = double(n) * unit_roundoff(dt);
  SHARDLM_CHECK(nu < 0.5, "gamma_n: n u = {}: no first-order bound at this length", nu);
  return nu / (1.0 - nu);
}

// The relative bound on the difference of two computations that sum the same terms in other
// orders, through a chain of reductions of total length `chain` accumulated in `accumulate`:
// 2 gamma_chain.
inline double reorder_tolerance(int64_t chain, DType accumulate = DType::kF32) {
  return 2.0 * gamma_n(accumulate, chain);
}

// The relative bound, with probability 1 - 2 exp(-lambda^2 / 2), on the difference of two runs'
// means over `terms` quantities that each pass through `roundings` bf16 stores (above):
// 2 lambda u_bf16 sqrt(roundings / terms).
inline double bf16_mean_tolerance(int roundings, int64_t terms, double lambda = 7.0) {
  return 2.0 * lambda * unit_roundoff(DType::kBF16) * std::sqrt(double(roundings) / double(terms));
}

// The summed reduction lengths that a decoder's loss and gradients pass through for a batch of
// `rows` sequences of `seq` tokens: per layer, forward and backward, the norm (D), the q/k/v
// projections (D), the scores (head_dim) and their weighted sum (seq), the output projection
// (heads * head_dim) and the MLP (D, then F), with post-norms (Gemma, GLM-4-0414) their two
// norms (D each); then the head's D and its softmax over the vocabulary; and a weight's gradient
// summed over every token of the batch (rows * seq).
inline int64_t reduction_chain(const ModelConfig& c, int64_t seq, int64_t rows = 1) {
  const int64_t hd = c.head_dim();
  const int64_t per_layer = c.dim + c.dim + hd + seq + c.n_heads * hd + c.dim + c.ffn_dim +
                            (c.post_norms ? 2 * c.dim : 0);
  return 2 * (c.n_layers * per_layer + c.dim + c.vocab_size) + rows * seq;
}

// The bf16 stores along one token's chain through a decoder with bf16 activations, each of which
// a sum in another order may round the other way: per layer the two norms' outputs, q, k, v,
// the attention output and the MLP's hidden activations (and the two post-norms' outputs); then
// the embedding and the final norm.
inline int bf16_stores_per_token(const ModelConfig& c) {
  return int(c.n_layers) * (c.post_norms ? 9 : 7) + 2;
}

// An op against its f64 reference on the very values the backend holds (bf16 inputs rounded
// first), normwise relative to the result: f32 accumulation over its longest chain of `reduction`
// operations is within gamma of the terms' magnitudes, and the op table's seeded signed inputs
// sum to a result no smaller than 1 / sqrt(reduction) of those magnitudes up to the factor 2
// (for independent signed terms the ratio concentrates at sqrt(2 / pi)); each bf16 store of the
// result (or of an intermediate a bf16 kernel keeps) adds u, relative, per element.
inline double op_tolerance(DType dt, int64_t reduction, int bf16_roundings = 1) {
  const double accumulate = 2.0 * gamma_n(DType::kF32, reduction) * std::sqrt(double(reduction));
  return accumulate + (dt == DType::kBF16 ? bf16_roundings * unit_roundoff(DType::kBF16) : 0.0);
}

// C = max over steps t of sqrt(sum_j a_j^2 / b_j), where a_j and b_j are the bias-corrected
// weights of gradient j in AdamW's first and second moments after t steps: |m^| <= C sqrt(v^).
inline double adam_moment_ratio(double beta1, double beta2, int steps) {
  double worst = 1.0;
  for (int t = 1; t <= steps; ++t) {
    double s = 0;
    for (int j = 1; j <= t; ++j) {
      const double a = (1 - beta1) * std::pow(beta1, t - j) / (1 - std::pow(beta1, t));
      const double b = (1 - beta2) * std::pow(beta2, t - j) / (1 - std::pow(beta2, t));
      s += a * a / b;
    }
    worst = std::max(worst, std::sqrt(s));
  }
  return worst;
}

// AdamW's Lipschitz constant in the gradient history's max norm: lr (1 + C / 4) / eps.
inline double adamw_lipschitz(double lr, double eps, double beta1, double beta2, int steps) {
  return lr * (1.0 + adam_moment_ratio(beta1, beta2, steps) / 4.0) / eps;
}

// Weights after `steps` updates with Lipschitz constant `lipschitz` whose gradients differed by
// at most `grad_bound` (absolute, max norm) at each step: steps * L * grad_bound.
inline double weight_bound(double lipschitz, double grad_bound, int steps) {
  return double(steps) * lipschitz * grad_bound;
}

}  // namespace shardlm::test
