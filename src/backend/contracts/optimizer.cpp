// The contracts of the optimizer step: adamw_step, and adamw_step_segments over a list.
#include <algorithm>
#include <string>
#include <vector>

#include "backend/contracts/checks.h"

namespace shardlm {

using namespace contract;  // NOLINT: the contract helpers are this file's vocabulary

namespace {

// param, grad, m, v: f32 of one size; `where` names the segment in messages.
void check_adamw_tensors(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                         std::string_view op, const std::string& where) {
  for (const auto& [t, name] : {std::pair{&param, "param"}, {&grad, "grad"}, {&m, "m"}, {&v, "v"}})
    check_tensor(*t, DType::kF32, -1, op, where + name);
  const int64_t n = param.numel();
  SHARDLM_CHECK(grad.numel() == n && m.numel() == n && v.numel() == n,
                "{} needs {}param, grad, m, v of equal size, got {}, {}, {}, {}", op, where, n,
                grad.numel(), m.numel(), v.numel());
}

// The tensors the step writes (every segment's param, m and v) pairwise disjoint: a stretch
// stepped twice would be stepped in either order, or at once.
void check_written_disjoint(std::span<const AdamWSegment> segments) {
  struct Range {
    MemPool pool;
    const std::byte *begin, *end;
    size_t segment;
  };
  std::vector<Range> ranges;
  for (size_t i = 0; i < segments.size(); ++i)
    for (const Tensor* t : {&segments[i].param, &segments[i].m, &segments[i].v})
      if (t->numel() > 0) {
        const auto* p = static_cast<const std::byte*>(t->data());
        ranges.push_back({t->pool(), p, p + t->bytes(), i});
      }
  std::sort(ranges.begin(), ranges.end(), [](const Range& a, const Range& b) {
    return a.pool != b.pool ? a.pool < b.pool : a.begin < b.begin;
  });
  for (size_t r = 1; r < ranges.size(); ++r)
    SHARDLM_CHECK(ranges[r].pool != ranges[r - 1].pool || ranges[r].begin >= ranges[r - 1].end,
                  "adamw_step_segments: segments {} and {} write the same memory (param, m or v); "
                  "each element is stepped once",
                  std::min(ranges[r].segment, ranges[r - 1].segment),
                  std::max(ranges[r].segment, ranges[r - 1].segment));
}

}  // namespace

void Backend::adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                         const AdamWHyper& hyper) {
  check_adamw_tensors(param, grad, m, v, "adamw_step", "");
  SHARDLM_CHECK(hyper.step >= 1, "adamw_step step is 1-based, got {}", hyper.step);
  do_adamw_step(param, grad, m, v, hyper);
}

void Backend::adamw_step_segments(std::span<const AdamWSegment> segments, const AdamWHyper& hyper) {
  constexpr std::string_view op = "adamw_step_segments";
  for (size_t i = 0; i < segments.size(); ++i) {
    const AdamWSegment& s = segments[i];
    check_adamw_tensors(s.param, s.grad, s.m, s.v, op, fmt::format("segments[{}].", i));
  }
  SHARDLM_CHECK(hyper.step >= 1, "adamw_step_segments step is 1-based, got {}", hyper.step);
  check_written_disjoint(segments);
  do_adamw_step_segments(segments, hyper);
}

}  // namespace shardlm
