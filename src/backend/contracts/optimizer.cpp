// The contract of the optimizer step: adamw_step.
#include "backend/contracts/checks.h"

namespace shardlm {

using namespace contract;  // NOLINT: the contract helpers are this file's vocabulary

void Backend::adamw_step(const Tensor& param, const Tensor& grad, const Tensor& m, const Tensor& v,
                         const AdamWHyper& hyper) {
  constexpr std::string_view op = "adamw_step";
  for (const auto& [t, name] : {std::pair{&param, "param"}, {&grad, "grad"}, {&m, "m"}, {&v, "v"}})
    check_tensor(*t, DType::kF32, -1, op, name);
  const int64_t n = param.numel();
  SHARDLM_CHECK(grad.numel() == n && m.numel() == n && v.numel() == n,
                "adamw_step needs param, grad, m, v of equal size, got {}, {}, {}, {}", n,
                grad.numel(), m.numel(), v.numel());
  SHARDLM_CHECK(hyper.step >= 1, "adamw_step step is 1-based, got {}", hyper.step);
  do_adamw_step(param, grad, m, v, hyper);
}

}  // namespace shardlm
