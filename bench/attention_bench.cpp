// shardlm-bench-attention: causal attention forward + backward of one backend, timed per
// sequence length, one JSON line each on stdout. The peer in bench/gpu/attention_peer.py times
// PyTorch's SDPA on the same shapes with the same FLOP count, so the two read side by side.
// Not a test: it asserts nothing about speed.
//
// Usage: shardlm-bench-attention [--device cuda|cpu] [--seq 8192,16384] [--heads 32]
//          [--kv-heads 8] [--head-dim 128] [--dtype bf16|fp32] [--reps 3] [--budget-s 240]
//          [--window 0]
// --window: sliding-window attention of that many keys (0: full causal); FLOPs count the pairs
// inside the window only, so a kernel that skips the rest shows the same rate.
// Lengths are run in the order given; one whose predicted time (the previous length's, scaled
// by the square of the ratio) would overrun --budget-s is reported as skipped, not run.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <iostream>
#include <string>
#include <vector>

#include "pass_timing.h"
#include "shardlm/backend/backend.h"
#include "shardlm/core/buffer.h"
#include "shardlm/core/dtype.h"

namespace shardlm {
namespace {

using Clock = std::chrono::steady_clock;

struct Options {
  std::string device = "cuda";
  std::vector<int64_t> seq = {8192, 16384, 32768, 65536, 131072};
  int64_t heads = 32, kv_heads = 8, head_dim = 128;
  std::string dtype = "bf16";
  int reps = 3;
  double budget_s = 240;
  int64_t window = 0;
};

// Causal attention's FLOPs, FlashAttention's convention: forward 2 matmuls over the visible
// pairs (T^2/2 of them, 4 T^2 Dh H / 2), backward 2.5 times that (5 matmuls). Under a window W
// the pairs are W (W + 1) / 2 + (T - W) W instead.
double forward_flops(const Options& o, int64_t T) {
  const double W = double(o.window > 0 ? std::min(o.window, T) : T);
  const double pairs = o.window > 0 ? W * (W + 1) / 2 + (double(T) - W) * W : double(T) * T / 2;
  return 4.0 * pairs * double(o.head_dim) * double(o.heads);
}

// One sequence length: q, k, v, out, dout and the gradients on the device; medians of `reps`
// forward and backward passes after one warm-up, synchronised only around each pass.
bench::Timing time_length(Backend& be, const Options& o, DType dt, int64_t T) {
  MemoryLedger ledger;
  const auto make = [&](Shape s, DType t) {
    return Buffer(be, ledger, MemCategory::kActivations, MemPool::kDevice,
                  size_t(s.numel()) * dtype_size(t));
  };
  const Shape qs{1, T, o.heads, o.head_dim}, ks{1, T, o.kv_heads, o.head_dim};
  Buffer q = make(qs, dt), k = make(ks, dt), v = make(ks, dt), out = make(qs, dt),
         dout = make(qs, dt), dq = make(qs, dt), dk = make(ks, dt), dv = make(ks, dt),
         lse = make({1, o.heads, T}, DType::kF32);
  const Tensor tq = q.view(dt, qs), tk = k.view(dt, ks), tv = v.view(dt, ks),
               tout = out.view(dt, qs), tdout = dout.view(dt, qs), tdq = dq.view(dt, qs),
               tdk = dk.view(dt, ks), tdv = dv.view(dt, ks),
               tlse = lse.view(DType::kF32, {1, o.heads, T});
  const Tensor no_documents;  // one causal sequence, as the peers run it (and cuDNN takes it)
  bench::fill_random(be, tq, 1);
  bench::fill_random(be, tk, 2);
  bench::fill_random(be, tv, 3);
  bench::fill_random(be, tdout, 4);
  // Planned as a model plans it, with its window: the CUDA backend builds that window's cuDNN
  // graphs here (a step builds none, so an unplanned window would time the own kernel).
  const std::vector<int64_t> windows{o.window};
  const size_t ws_bytes =
      be.attention_plan_workspace_bytes(1, T, o.heads, o.kv_heads, o.head_dim, windows);
  Buffer ws(be, ledger, MemCategory::kWorkspace, MemPool::kDevice, std::max<size_t>(ws_bytes, 64));
  const Workspace w{ws.data(), ws_bytes};

  return bench::time_passes(
      be, o.reps,
      [&] { be.attention_forward(tq, tk, tv, no_documents, tout, tlse, w, {}, o.window); },
      [&] {
        be.attention_backward(tq, tk, tv, no_documents, tout, tlse, tdout, tdq, tdk, tdv, w, {},
                              o.window);
      });
}

int run(const Options& o) {
  const DeviceKind kind = o.device == "cuda" ? DeviceKind::kCuda : DeviceKind::kCpu;
  const DType dt = o.dtype == "bf16" ? DType::kBF16 : DType::kF32;
  const std::unique_ptr<Backend> be = make_backend(kind);
  double spent = 0, last_s = 0;
  int64_t last_T = 0;
  for (const int64_t T : o.seq) {
    const double ratio = last_T > 0 ? double(T) / double(last_T) : 0;
    const double predicted = last_s * ratio * ratio * (o.reps + 1);
    if (last_T > 0 && spent + predicted > o.budget_s) {
      std::cout << fmt::format(R"({{"engine": "shardlm", "backend": "{}", "T": {}, "skipped": )"
                               R"("predicted {:.0f} s past the {:.0f} s budget"}})",
                               be->name(), T, predicted, o.budget_s)
                << std::endl;
      continue;
    }
    const auto t0 = Clock::now();
    const bench::Timing t = time_length(*be, o, dt, T);
    spent += std::chrono::duration<double>(Clock::now() - t0).count();
    last_s = t.forward_s + t.backward_s;
    last_T = T;
    const double f = forward_flops(o, T);
    std::cout << fmt::format(R"({{"engine": "shardlm", "backend": "{}", "dtype": "{}", "T": {}, )"
                             R"("window": {}, "heads": {}, "kv_heads": {}, "head_dim": {}, )"
                             R"("forward_ms": {:.3f}, )"
                             R"("backward_ms": {:.3f}, "forward_tflops": {:.4g}, )"
                             R"("fwd_bwd_tflops": {:.4g}}})",
                             be->name(), o.dtype, T, o.window, o.heads, o.kv_heads, o.head_dim,
                             t.forward_s * 1e3, t.backward_s * 1e3, f / t.forward_s / 1e12,
                             3.5 * f / last_s / 1e12)
              << std::endl;
  }
  return 0;
}

}  // namespace
}  // namespace shardlm

int main(int argc, char** argv) {
  shardlm::Options o;
  CLI::App app{"causal attention forward + backward, timed per sequence length"};
  app.add_option("--device", o.device, "cuda or cpu")->check(CLI::IsMember({"cuda", "cpu"}));
  app.add_option("--seq", o.seq, "sequence lengths, in order")->delimiter(',');
  app.add_option("--heads", o.heads, "query heads")->check(CLI::PositiveNumber);
  app.add_option("--kv-heads", o.kv_heads, "key/value heads")->check(CLI::PositiveNumber);
  app.add_option("--head-dim", o.head_dim, "head dimension")->check(CLI::PositiveNumber);
  app.add_option("--dtype", o.dtype, "storage of q, k, v, out (the CPU backend: fp32)")
      ->check(CLI::IsMember({"bf16", "fp32"}));
  app.add_option("--reps", o.reps, "timed passes per length (median)")->check(CLI::PositiveNumber);
  app.add_option("--budget-s", o.budget_s, "skip lengths predicted to overrun this")
      ->check(CLI::PositiveNumber);
  app.add_option("--window", o.window, "sliding window in keys (0: full causal)")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  try {
    return shardlm::run(o);
  } catch (const std::exception& e) {
    std::cerr << "shardlm-bench-attention: " << e.what() << "\n";
    return 2;
  }
}
