// shardlm-bench-linear: a linear layer's forward + backward (y = x W^T + b; dx, an f32 dw and
// db, as training accumulates them) on one backend, timed per shape and activation dtype, one
// JSON line each on stdout, with tokens/s and, for bf16, the ratio to f32 on the same shape.
// Not a test: it asserts nothing about speed.
//
// Usage: shardlm-bench-linear [--device cpu|cuda] [--shapes 4096x1024x1024,4096x1024x2816]
//          [--dtypes fp32,bf16] [--reps 5]
// A shape is NxINxOUT: N tokens, in features, out features.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "pass_timing.h"
#include "shardlm/backend/backend.h"
#include "shardlm/core/buffer.h"
#include "shardlm/core/dtype.h"

namespace shardlm {
namespace {

struct Options {
  std::string device = "cpu";
  std::vector<std::string> shapes = {"4096x1024x1024", "4096x1024x2816"};
  std::vector<std::string> dtypes = {"fp32", "bf16"};
  int reps = 5;
};

struct LinearShape {
  int64_t n, in, out;
};

LinearShape parse_shape(const std::string& s) {
  LinearShape d{};
  char x1 = 0, x2 = 0;
  std::istringstream in(s);
  in >> d.n >> x1 >> d.in >> x2 >> d.out;
  SHARDLM_CHECK(in && x1 == 'x' && x2 == 'x' && d.n > 0 && d.in > 0 && d.out > 0,
                "--shapes: '{}' is not NxINxOUT with positive extents", s);
  return d;
}

// One shape and dtype: medians of `reps` forward and backward passes after one warm-up.
bench::Timing time_shape(Backend& be, LinearShape d, DType dt, int reps) {
  MemoryLedger ledger;
  std::vector<Buffer> buffers;
  const auto make = [&](Shape s, DType t) {
    buffers.emplace_back(be, ledger, MemCategory::kActivations, MemPool::kDevice,
                         size_t(s.numel()) * dtype_size(t));
    return buffers.back().view(t, s);
  };
  const Tensor x = make({d.n, d.in}, dt), w = make({d.out, d.in}, dt), b = make({d.out}, dt),
               y = make({d.n, d.out}, dt), dy = make({d.n, d.out}, dt), dx = make({d.n, d.in}, dt),
               dw = make({d.out, d.in}, DType::kF32), db = make({d.out}, DType::kF32);
  bench::fill_random(be, x, 1);
  bench::fill_random(be, w, 2);
  bench::fill_random(be, b, 3);
  bench::fill_random(be, dy, 4);
  return bench::time_passes(
      be, reps, [&] { be.linear_forward(x, w, b, y); },
      [&] { be.linear_backward(x, w, dy, dx, dw, db); });
}

int run(const Options& o) {
  const DeviceKind kind = o.device == "cuda" ? DeviceKind::kCuda : DeviceKind::kCpu;
  const std::unique_ptr<Backend> be = make_backend(kind);
  for (const std::string& s : o.shapes) {
    const LinearShape d = parse_shape(s);
    std::map<std::string, double> step_s;  // forward + backward, per dtype
    for (const std::string& name : o.dtypes) {
      const DType dt = name == "bf16" ? DType::kBF16 : DType::kF32;
      const bench::Timing t = time_shape(*be, d, dt, o.reps);
      const double total = t.forward_s + t.backward_s;
      step_s[name] = total;
      const std::string ratio =
          name != "fp32" && step_s.count("fp32")
              ? fmt::format(R"(, "time_vs_fp32": {:.3f})", total / step_s["fp32"])
              : "";
      std::cout << fmt::format(R"({{"engine": "shardlm", "backend": "{}", "dtype": "{}", )"
                               R"("N": {}, "in": {}, "out": {}, "forward_ms": {:.3f}, )"
                               R"("backward_ms": {:.3f}, "tokens_per_s": {:.0f}, )"
                               R"("gflops": {:.1f}{}}})",
                               be->name(), name, d.n, d.in, d.out, t.forward_s * 1e3,
                               t.backward_s * 1e3, double(d.n) / total,
                               6.0 * double(d.n) * double(d.in) * double(d.out) / total / 1e9,
                               ratio)
                << std::endl;
    }
  }
  return 0;
}

}  // namespace
}  // namespace shardlm

int main(int argc, char** argv) {
  shardlm::Options o;
  CLI::App app{"linear layer forward + backward, timed per shape and dtype"};
  app.add_option("--device", o.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--shapes", o.shapes, "NxINxOUT, in order")->delimiter(',');
  app.add_option("--dtypes", o.dtypes, "activation and weight storage, in order")
      ->delimiter(',')
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--reps", o.reps, "timed passes per shape (median)")->check(CLI::PositiveNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    return shardlm::run(o);
  } catch (const std::exception& e) {
    std::cerr << "shardlm-bench-linear: " << e.what() << "\n";
    return 2;
  }
}
