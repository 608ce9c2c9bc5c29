// shardlm-bench-gemm: the backend's matrix rate, the denominator of the MFU that gpu-check's
// speed phase reports: the median time of an n x n x n product (linear_forward, y = x W^T: on
// CUDA one cuBLASLt matmul with f32 accumulation, bf16 operands on the tensor cores; on the CPU
// OpenBLAS sgemm) on N(0, 1) data, after a warm-up. One JSON line in the format of
// bench/gpu/gemm_rate.py ({"bf16_tflops": ..., "f32_tflops": ...}), so the report reads either.
// Not a test: it asserts nothing about speed.
//
// Usage: shardlm-bench-gemm [--device cuda|cpu] [--n 8192 on CUDA, 2048 on the CPU] [--reps 10]
//          [--dtypes bf16,fp32]
// A GPU product takes about a millisecond, so each timed repetition runs as many products back
// to back as fill kMinRepSeconds (from the warm-up's time): the host's launch and synchronise
// are then a small part of what is timed.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "pass_timing.h"
#include "shardlm/backend/backend.h"
#include "shardlm/core/buffer.h"
#include "shardlm/core/dtype.h"

namespace shardlm {
namespace {

using Clock = std::chrono::steady_clock;

constexpr double kMinRepSeconds = 0.02;

struct Options {
  std::string device = "cuda";
  int64_t n = 0;  // 0: the device's default
  int reps = 10;
  std::vector<std::string> dtypes = {"bf16", "fp32"};
};

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// FLOP/s of y [n, n] = x [n, n] W^T [n, n] in dt: the median over `reps` timed repetitions of
// the time per product.
double gemm_rate(Backend& be, int64_t n, DType dt, int reps) {
  MemoryLedger ledger;
  std::vector<Buffer> buffers;
  const auto make = [&](uint64_t seed) {
    buffers.emplace_back(be, ledger, MemCategory::kWorkspace, MemPool::kDevice,
                         size_t(n * n) * dtype_size(dt));
    const Tensor t = buffers.back().view(dt, {n, n});
    bench::fill_random(be, t, seed);
    return t;
  };
  const Tensor x = make(1), w = make(2), y = make(3);
  be.synchronize();
  const auto warm = Clock::now();
  be.linear_forward(x, w, Tensor(), y);  // warm-up: the backend's plan, threads and caches
  be.synchronize();
  const double once = std::max(seconds_since(warm), 1e-6);
  const int per_rep = std::max(1, int(std::ceil(kMinRepSeconds / once)));
  std::vector<double> per_product;
  for (int rep = 0; rep < reps; ++rep) {
    const auto t0 = Clock::now();
    for (int i = 0; i < per_rep; ++i) be.linear_forward(x, w, Tensor(), y);
    be.synchronize();
    per_product.push_back(seconds_since(t0) / per_rep);
  }
  std::sort(per_product.begin(), per_product.end());
  return 2.0 * double(n) * double(n) * double(n) / per_product[per_product.size() / 2];
}

int run(const Options& o) {
  const bool cuda = o.device == "cuda";
  const int64_t n = o.n > 0 ? o.n : cuda ? 8192 : 2048;
  const std::unique_ptr<Backend> be = make_backend(cuda ? DeviceKind::kCuda : DeviceKind::kCpu);
  std::string rates;
  for (const std::string& name : o.dtypes) {
    const DType dt = name == "bf16" ? DType::kBF16 : DType::kF32;
    rates += fmt::format(R"(, "{}_tflops": {:.4g})", name == "bf16" ? "bf16" : "f32",
                         gemm_rate(*be, n, dt, o.reps) / 1e12);
  }
  std::cout << fmt::format(R"({{"engine": "shardlm", "backend": "{}", "device": "{}", "n": {}, )"
                           R"("reps": {}{}}})",
                           be->name(), o.device, n, o.reps, rates)
            << std::endl;
  return 0;
}

}  // namespace
}  // namespace shardlm

int main(int argc, char** argv) {
  shardlm::Options o;
  CLI::App app{"the backend's n x n x n GEMM rate in TFLOP/s, bf16 and f32"};
  app.add_option("--device", o.device, "cuda or cpu")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--n", o.n, "the product's extents (default 8192 on CUDA, 2048 on the CPU)")
      ->check(CLI::PositiveNumber);
  app.add_option("--reps", o.reps, "timed repetitions (median)")->check(CLI::PositiveNumber);
  app.add_option("--dtypes", o.dtypes, "operand dtypes, in order")
      ->delimiter(',')
      ->check(CLI::IsMember({"fp32", "bf16"}));
  CLI11_PARSE(app, argc, argv);
  try {
    return shardlm::run(o);
  } catch (const std::exception& e) {
    std::cerr << "shardlm-bench-gemm: " << e.what() << "\n";
    return 2;
  }
}
