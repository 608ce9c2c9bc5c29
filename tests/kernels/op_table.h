// The op table: one list of cases (a Backend method, its shapes and dtype, a tolerance) that
// runs through any Backend& against an f64 reference computed here from the very values the
// backend was given (bf16 inputs rounded first). test_op_table runs it on the CPU backend,
// tests/gpu/test_cuda_op_table on the CUDA backend (ggml's test-backend-ops). Each case's
// reference states the op's contract once; the per-op tests beside it keep the finite
// differences and the edge cases. Outputs are poisoned with NaN before the op, so an
// element the backend fails to write fails the comparison. Header-only: two executables
// include it. The references of the larger families are in op_table_refs.h.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <ostream>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/op_table_refs.h"
#include "shardlm/backend/backend.h"
#include "shardlm/core/buffer.h"
#include "tolerance.h"

namespace shardlm::test::ops {

using Values = std::vector<double>;

// f64 RMSNorm (eps 1e-5) of x [N, D] with weights off + w [D]: rstd [N] and y [N, D] (when
// given).
inline void rmsnorm_reference(const Values& x, const Values& w, int64_t N, int64_t D, Values& rstd,
                              Values* y, double off = 0) {
  for (int64_t n = 0; n < N; ++n) {
    double ss = 0;
    for (int64_t d = 0; d < D; ++d) ss += x[n * D + d] * x[n * D + d];
    rstd[n] = 1.0 / std::sqrt(ss / double(D) + 1e-5);
    if (y != nullptr)
      for (int64_t d = 0; d < D; ++d) (*y)[n * D + d] = x[n * D + d] * rstd[n] * (off + w[d]);
  }
}

// Its backward from dy [N, D] and rstd [N]: dx [N, D] and dw [D] accumulate.
inline void rmsnorm_backward_reference(const Values& x, const Values& w, const Values& dy,
                                       const Values& rstd, int64_t N, int64_t D, Values& dx,
                                       Values& dw, double off = 0) {
  for (int64_t n = 0; n < N; ++n) {
    double dot = 0;  // mean over d of (dy w) * xhat
    for (int64_t d = 0; d < D; ++d) dot += dy[n * D + d] * (off + w[d]) * x[n * D + d] * rstd[n];
    dot /= double(D);
    for (int64_t d = 0; d < D; ++d) {
      const double xhat = x[n * D + d] * rstd[n];
      dx[n * D + d] += rstd[n] * (dy[n * D + d] * (off + w[d]) - xhat * dot);
      dw[d] += dy[n * D + d] * xhat;
    }
  }
}

// f64 SwiGLU backward: dgate and dup of h = silu(gate) * up from dh, elementwise.
inline void swiglu_backward_reference(const Values& g, const Values& u, const Values& dh,
                                      Values& dg, Values& du) {
  for (size_t i = 0; i < g.size(); ++i) {
    const double s = 1 / (1 + std::exp(-g[i]));
    dg[i] = dh[i] * u[i] * (s + g[i] * s * (1 - s));
    du[i] = dh[i] * g[i] * s;
  }
}

// f64 GeGLU: h = gelu_tanh(gate) * up, and its backward (dgate, dup) from dh, elementwise.
inline double gelu_tanh_reference(double g) {
  return 0.5 * g * (1 + std::tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)));
}
inline void geglu_backward_reference(const Values& g, const Values& u, const Values& dh, Values& dg,
                                     Values& du) {
  for (size_t i = 0; i < g.size(); ++i) {
    const double k = 0.7978845608028654, t = std::tanh(k * (g[i] + 0.044715 * g[i] * g[i] * g[i]));
    const double grad =
        0.5 * (1 + t) + 0.5 * g[i] * (1 - t * t) * k * (1 + 3 * 0.044715 * g[i] * g[i]);
    dg[i] = dh[i] * u[i] * grad;
    du[i] = dh[i] * gelu_tanh_reference(g[i]);
  }
}

// Device tensors of one case, and their movement to and from host f64 values.
class OpRun {
 public:
  OpRun(Backend& be, DType dtype, double tol) : be(be), dtype(dtype), tol(tol) {}

  Backend& be;
  const DType dtype;  // the case's float dtype (f32 or bf16)
  const double tol;   // normwise relative error allowed against the reference

  // A backend tensor holding `v` in `dt` (default: the case's dtype; f64, f32 or bf16). f32 and
  // bf16 round `v` in place, so the reference sees exactly what the backend holds.
  Tensor in(Values& v, Shape shape, std::optional<DType> dt = {}) { return in_at(0, v, shape, dt); }
  // As in(), a view starting `offset` elements into its buffer: offset 1 is misaligned for
  // every vector width, so a backend's kernels take their unaligned path.
  Tensor in_at(int64_t offset, Values& v, Shape shape, std::optional<DType> dt = {}) {
    const DType t = dt.value_or(dtype);
    Tensor dev = alloc(shape, t, offset);
    upload(v, dev);
    return dev;
  }
  // Overwritten outputs: poisoned with NaN first.
  Tensor out(Shape shape, std::optional<DType> dt = {}) { return out_at(0, shape, dt); }
  Tensor out_at(int64_t offset, Shape shape, std::optional<DType> dt = {}) {
    const DType t = dt.value_or(dtype);
    Tensor dev = alloc(shape, t, offset);
    Values nan(static_cast<size_t>(shape.numel()), std::numeric_limits<double>::quiet_NaN());
    upload(nan, dev);
    return dev;
  }
  Tensor ids(std::vector<int32_t> v) {
    Tensor dev = alloc({int64_t(v.size())}, DType::kI32);
    be.copy(Tensor(v.data(), DType::kI32, {int64_t(v.size())}, MemPool::kHost), dev);
    return dev;
  }
  // An f64 tensor holding v exactly (a loss accumulator), and its values read back.
  Tensor f64s(std::vector<double> v) {
    Tensor dev = alloc({int64_t(v.size())}, DType::kF64);
    be.copy(Tensor(v.data(), DType::kF64, {int64_t(v.size())}, MemPool::kHost), dev);
    return dev;
  }
  Values get_f64(const Tensor& dev) {
    Values v(static_cast<size_t>(dev.numel()));
    be.copy(dev, Tensor(v.data(), DType::kF64, dev.shape(), MemPool::kHost));
    return v;
  }
  // Raw bytes (packed quantized codes), uploaded as they are.
  Tensor bytes(std::vector<uint8_t> v) {
    Tensor dev = alloc({int64_t(v.size())}, DType::kU8);
    be.copy(Tensor(v.data(), DType::kU8, {int64_t(v.size())}, MemPool::kHost), dev);
    return dev;
  }
  Workspace ws(size_t bytes) {
    if (bytes == 0) return {};
    buffers_.emplace_back(be, ledger_, MemCategory::kWorkspace, MemPool::kDevice, bytes);
    return {buffers_.back().data(), bytes};
  }
  Values get(const Tensor& dev) {
    Values v(static_cast<size_t>(dev.numel()));
    if (dev.dtype() == DType::kF64) {
      be.copy(dev, Tensor(v.data(), DType::kF64, dev.shape(), MemPool::kHost));
    } else if (dev.dtype() == DType::kF32) {
      std::vector<float> host(v.size());
      be.copy(dev, Tensor(host.data(), DType::kF32, dev.shape(), MemPool::kHost));
      for (size_t i = 0; i < v.size(); ++i) v[i] = host[i];
    } else {
      std::vector<uint16_t> host(v.size());
      be.copy(dev, Tensor(host.data(), DType::kBF16, dev.shape(), MemPool::kHost));
      for (size_t i = 0; i < v.size(); ++i) v[i] = bf16_to_f32(host[i]);
    }
    return v;
  }
  // Normwise: ||got - want|| <= tol * max(||want||, 1e-30), and nothing non-finite where the
  // reference is finite.
  void check(const Tensor& got, const Values& want, const std::string& what) {
    check(get(got), want, what);
  }
  void check(const Values& got, const Values& want, const std::string& what) const {
    ASSERT_EQ(got.size(), want.size()) << what;
    double err = 0, norm = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      if (std::isinf(want[i]) && got[i] == want[i]) continue;  // -inf lse of an empty row
      ASSERT_TRUE(std::isfinite(got[i]))
          << what << "[" << i << "] = " << got[i] << ", the reference " << want[i];
      err += (got[i] - want[i]) * (got[i] - want[i]);
      norm += want[i] * want[i];
    }
    EXPECT_LE(std::sqrt(err), tol * std::max(std::sqrt(norm), 1e-30))
        << what << ": normwise error " << std::sqrt(err) / std::max(std::sqrt(norm), 1e-30);
  }
  // Seeded N(0, scale^2) values; bf16 callers get them rounded by in().
  static Values randn(int64_t n, uint64_t seed, double scale = 1.0) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<double> d(0.0, scale);
    Values v(static_cast<size_t>(n));
    for (double& x : v) x = d(rng);
    return v;
  }

 private:
  Tensor alloc(Shape shape, DType t, int64_t offset = 0) {
    const size_t at = static_cast<size_t>(offset) * dtype_size(t);
    const size_t bytes =
        std::max<size_t>(at + static_cast<size_t>(shape.numel()) * dtype_size(t), 1);
    buffers_.emplace_back(be, ledger_, MemCategory::kActivations, MemPool::kDevice, bytes);
    return buffers_.back().view(t, shape, at);
  }
  void upload(Values& v, const Tensor& dev) {
    if (dev.dtype() == DType::kF64) {
      be.copy(Tensor(v.data(), DType::kF64, dev.shape(), MemPool::kHost), dev);
    } else if (dev.dtype() == DType::kF32) {
      std::vector<float> host(v.begin(), v.end());
      for (size_t i = 0; i < v.size(); ++i) v[i] = host[i];
      be.copy(Tensor(host.data(), DType::kF32, dev.shape(), MemPool::kHost), dev);
    } else {
      std::vector<uint16_t> host(v.size());
      for (size_t i = 0; i < v.size(); ++i) {
        host[i] = f32_to_bf16(float(v[i]));
        if (!std::isnan(v[i])) v[i] = bf16_to_f32(host[i]);
      }
      be.copy(Tensor(host.data(), DType::kBF16, dev.shape(), MemPool::kHost), dev);
    }
  }

  MemoryLedger ledger_;
  std::vector<Buffer> buffers_;
};

struct OpCase {
  std::string method;  // the Backend method it checks
  std::string label;   // its shapes and variant
  DType dtype = DType::kF32;
  double tol = 1e-5;
  bool cpu = true;  // the CPU backend takes this dtype for this op
  std::function<void(OpRun&)> body;
  std::string name() const { return method + "/" + label + "/" + std::string(dtype_name(dtype)); }
};

// For gtest: a case prints as its name, and names its test "<method>_<label>_<dtype>_<index>"
// with every other character made '_'.
inline void PrintTo(const OpCase& c, std::ostream* os) { *os << c.name(); }
inline std::string test_name(const OpCase& c, size_t index) {
  std::string name = c.name() + "_" + std::to_string(index);
  for (char& ch : name)
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  return name;
}

// The Backend methods that are not ops (the op table need not cover them), with why.
inline const std::set<std::string>& methods_without_cases() {
  static const std::set<std::string> kNotOps = {
      "name", "workspace_threads", "synchronize", "driver_device_bytes", "device_stream",
      // the step's count of host waits (metrics, test_cuda_train) and MFU's GEMM dtype
      "host_waits", "peak_gemm_dtype",
      // the choice of attention kernels, run by every attention case
      "select_attention",
      // sizes of scratch, exercised by the ops that take the workspace
      "attention_workspace_bytes", "attention_block_workspace_bytes",
      "attention_plan_workspace_bytes", "attention_block_plan_workspace_bytes",
      "attention_decode_workspace_bytes", "lm_head_loss_workspace_bytes",
      "xent_slice_workspace_bytes",
      // device time, not an op: test_queued_backend and the pipeline's stage figures
      "mark", "seconds_between"};
  return kNotOps;
}

}  // namespace shardlm::test::ops

#include "kernels/op_table_cases.h"
