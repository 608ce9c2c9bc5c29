// The contracts of the linear layer: linear_forward and linear_backward.
#include "backend/contracts/checks.h"

namespace shardlm {
namespace {

using namespace contract;  // NOLINT: the contract helpers are this file's vocabulary

// x [N, in]; w [out, in] of x's dtype
void check_linear(const Tensor& x, const Tensor& w, std::string_view op) {
  check_float(x, 2, op, "x");
  check_like(w, x, 2, op, "w", "x");
  SHARDLM_CHECK(x.dim(1) == w.dim(1), "{}: x is [N, in] = {} but w is [out, in] = {}; in differs",
                op, x.shape().str(), w.shape().str());
}

// [N, out] from x and w
void check_rows_by_out(const Tensor& t, const Tensor& x, const Tensor& w, std::string_view op,
                       std::string_view name) {
  check_like(t, x, 2, op, name, "x");
  SHARDLM_CHECK(t.dim(0) == x.dim(0) && t.dim(1) == w.dim(0), "{}: {} is {}, expected [{}, {}]", op,
                name, t.shape().str(), x.dim(0), w.dim(0));
}

// An accumulated output: present, and apart from the GEMM's operands.
void check_accumulated(const Tensor& t, const Tensor& a, const Tensor& b, std::string_view op,
                       std::string_view name, std::string_view a_name, std::string_view b_name) {
  SHARDLM_CHECK(!t.empty() || t.numel() == 0,
                "{}: {} is accumulated (OutputMode::kAccumulate) but empty; pass the tensor to "
                "add into, or OutputMode::kOverwrite",
                op, name);
  check_disjoint(t, a, op, name, a_name);
  check_disjoint(t, b, op, name, b_name);
}

// b [out], rank already checked
void check_bias(const Tensor& b, const Tensor& w, std::string_view op, std::string_view name) {
  SHARDLM_CHECK(b.dim(0) == w.dim(0), "{}: {} is {} but w has {} output rows", op, name,
                b.shape().str(), w.dim(0));
}

// residual [N, out] of y's dtype, with an overwritten y: y itself, or apart from y, x and w.
// Returns whether it is y itself (the product then accumulates into y).
bool check_residual(const Tensor& residual, const Tensor& x, const Tensor& w, const Tensor& y,
                    OutputMode y_mode, std::string_view op) {
  SHARDLM_CHECK(y_mode == OutputMode::kOverwrite,
                "{}: a residual and OutputMode::kAccumulate together; the residual is what y "
                "starts from, so pass one of them",
                op);
  check_rows_by_out(residual, x, w, op, "residual");
  const bool is_y = residual.data() == y.data() && residual.pool() == y.pool();
  if (!is_y) {
    check_disjoint(y, residual, op, "y", "residual");
    check_disjoint(residual, x, op, "residual", "x");
    check_disjoint(residual, w, op, "residual", "w");
  }
  return is_y;
}

}  // namespace

void Backend::linear_forward(const Tensor& x, const Tensor& w, const Tensor& b, const Tensor& y,
                             OutputMode y_mode, const Tensor& residual) {
  constexpr std::string_view op = "linear_forward";
  check_linear(x, w, op);
  check_rows_by_out(y, x, w, op, "y");
  if (!b.empty()) {
    check_like(b, x, 1, op, "b", "x");
    check_bias(b, w, op, "b");
  }
  const bool residual_is_y = !residual.empty() && check_residual(residual, x, w, y, y_mode, op);
  if (residual_is_y) y_mode = OutputMode::kAccumulate;
  if (y_mode == OutputMode::kAccumulate) check_accumulated(y, x, w, op, "y", "x", "w");
  do_linear_forward(x, w, b, y, y_mode, residual_is_y ? Tensor() : residual);
}

void Backend::linear_backward(const Tensor& x, const Tensor& w, const Tensor& dy, const Tensor& dx,
                              const Tensor& dw, const Tensor& db, OutputMode dx_mode) {
  constexpr std::string_view op = "linear_backward";
  check_linear(x, w, op);
  check_rows_by_out(dy, x, w, op, "dy");
  if (!dx.empty()) {
    check_like(dx, x, 2, op, "dx", "x");
    check_same_shape(dx, x, op, "dx", "x");
  }
  if (dx_mode == OutputMode::kAccumulate) check_accumulated(dx, dy, w, op, "dx", "dy", "w");
  if (!dw.empty()) {
    check_float(dw, 2, op, "dw");
    SHARDLM_CHECK(dw.dtype() == DType::kF32 || dw.dtype() == x.dtype(),
                  "{}: dw must be f32 or {}, got {}", op, dtype_name(x.dtype()),
                  dtype_name(dw.dtype()));
    check_same_shape(dw, w, op, "dw", "w");
  }
  if (!db.empty()) {
    check_tensor(db, DType::kF32, 1, op, "db");
    check_bias(db, w, op, "db");
  }
  do_linear_backward(x, w, dy, dx, dw, db, dx_mode);
}

}  // namespace shardlm
