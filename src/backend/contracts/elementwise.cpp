// The contracts of the elementwise ops: add, scale, scale_rows, sum_squares, dropout,
// swiglu_forward, swiglu_backward, geglu_forward and geglu_backward (and dropout's refusal where a
// backend has no kernel for it).
#include "backend/contracts/checks.h"

namespace shardlm {

using namespace contract;  // NOLINT: the contract helpers are this file's vocabulary

void Backend::add(const Tensor& a, const Tensor& b, const Tensor& out) {
  constexpr std::string_view op = "add";
  check_float(a, -1, op, "a");
  check_like(b, a, -1, op, "b", "a");
  check_like(out, a, -1, op, "out", "a");
  SHARDLM_CHECK(a.numel() == b.numel() && a.numel() == out.numel(),
                "add: a {}, b {} and out {} must have the same element count", a.shape().str(),
                b.shape().str(), out.shape().str());
  do_add(a, b, out);
}

void Backend::scale(const Tensor& x, float s) {
  check_float(x, -1, "scale", "x");
  do_scale(x, s);
}

void Backend::scale_rows(const Tensor& x, const Tensor& s) {
  constexpr std::string_view op = "scale_rows";
  check_float(x, 2, op, "x");
  check_tensor(s, DType::kF32, 1, op, "s");
  SHARDLM_CHECK(s.numel() == x.dim(0), "{}: s has {} entries for the {} rows of x {}", op,
                s.numel(), x.dim(0), x.shape().str());
  check_disjoint(x, s, op, "x", "s");
  do_scale_rows(x, s);
}

double Backend::sum_squares(const Tensor& x) {
  check_float(x, -1, "sum_squares", "x");
  return do_sum_squares(x);
}

void Backend::sum_squares_segments(std::span<const Tensor> xs, std::span<double> sums) {
  constexpr std::string_view op = "sum_squares_segments";
  SHARDLM_CHECK(sums.size() == xs.size(), "{}: {} tensors but room for {} sums", op, xs.size(),
                sums.size());
  for (size_t i = 0; i < xs.size(); ++i) check_float(xs[i], -1, op, fmt::format("xs[{}]", i));
  if (!xs.empty()) do_sum_squares_segments(xs, sums);
}

void Backend::dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed, int64_t first,
                      int64_t row_stride) {
  check_float(x, -1, "dropout", "x");
  check_like(out, x, -1, "dropout", "out", "x");
  SHARDLM_CHECK(x.numel() == out.numel(), "dropout: x {} and out {} differ in element count",
                x.shape().str(), out.shape().str());
  SHARDLM_CHECK(p >= 0.f && p < 1.f, "dropout: p = {} must be in [0, 1)", p);
  if (row_stride == 0) return do_dropout(x, out, p, seed, first, x.numel(), x.numel());
  SHARDLM_CHECK(x.rank() == 2 && x.dim(1) <= row_stride,
                "dropout: with row_stride = {}, x must be [rows, w] with w <= row_stride, got {}",
                row_stride, x.shape().str());
  do_dropout(x, out, p, seed, first, x.dim(1), row_stride);
}

void Backend::do_dropout(const Tensor& x, const Tensor& out, float p, uint64_t seed, int64_t first,
                         int64_t width, int64_t row_stride) {
  (void)x, (void)out, (void)p, (void)seed, (void)first, (void)width, (void)row_stride;
  SHARDLM_FAIL(ErrorKind::kConfig,
               "lora.dropout > 0 needs a dropout kernel, which the {} backend does not have "
               "yet; set lora.dropout = 0",
               name());
}

void Backend::swiglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h) {
  constexpr std::string_view op = "swiglu_forward";
  check_float(gate, 2, op, "gate");
  for (const auto& [t, name] : {std::pair{&up, "up"}, {&h, "h"}}) {
    check_like(*t, gate, 2, op, name, "gate");
    check_same_shape(*t, gate, op, name, "gate");
  }
  do_swiglu_forward(gate, up, h);
}

void Backend::swiglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh,
                              const Tensor& dgate, const Tensor& dup) {
  constexpr std::string_view op = "swiglu_backward";
  check_float(gate, 2, op, "gate");
  for (const auto& [t, name] :
       {std::pair{&up, "up"}, {&dh, "dh"}, {&dgate, "dgate"}, {&dup, "dup"}}) {
    check_like(*t, gate, 2, op, name, "gate");
    check_same_shape(*t, gate, op, name, "gate");
  }
  do_swiglu_backward(gate, up, dh, dgate, dup);
}

void Backend::geglu_forward(const Tensor& gate, const Tensor& up, const Tensor& h) {
  constexpr std::string_view op = "geglu_forward";
  check_float(gate, 2, op, "gate");
  for (const auto& [t, name] : {std::pair{&up, "up"}, {&h, "h"}}) {
    check_like(*t, gate, 2, op, name, "gate");
    check_same_shape(*t, gate, op, name, "gate");
  }
  do_geglu_forward(gate, up, h);
}

void Backend::geglu_backward(const Tensor& gate, const Tensor& up, const Tensor& dh,
                             const Tensor& dgate, const Tensor& dup) {
  constexpr std::string_view op = "geglu_backward";
  check_float(gate, 2, op, "gate");
  for (const auto& [t, name] :
       {std::pair{&up, "up"}, {&dh, "dh"}, {&dgate, "dgate"}, {&dup, "dup"}}) {
    check_like(*t, gate, 2, op, name, "gate");
    check_same_shape(*t, gate, op, name, "gate");
  }
  do_geglu_backward(gate, up, dh, dgate, dup);
}

}  // namespace shardlm
