// Argument checks of the quantized-weight ops (Backend::nf4_dequantize): the packed codes and
// absmax must describe exactly the output's elements in quant/nf4.h's layout.
#include "backend/contracts/checks.h"
#include "shardlm/quant/nf4.h"

namespace shardlm {

using namespace contract;

void Backend::nf4_dequantize(const Tensor& codes, const Tensor& absmax, const Tensor& out) {
  check_tensor(codes, DType::kU8, 1, "nf4_dequantize", "codes");
  check_tensor(absmax, DType::kF32, 1, "nf4_dequantize", "absmax");
  check_float(out, -1, "nf4_dequantize", "out");
  const int64_t n = out.numel();
  SHARDLM_CHECK(codes.numel() == nf4::packed_bytes(n),
                "nf4_dequantize: codes [{}] must hold ceil(n / 2) = {} bytes for out {}",
                codes.numel(), nf4::packed_bytes(n), out.shape().str());
  SHARDLM_CHECK(absmax.numel() == nf4::num_blocks(n),
                "nf4_dequantize: absmax [{}] must hold ceil(n / 64) = {} values for out {}",
                absmax.numel(), nf4::num_blocks(n), out.shape().str());
  if (n == 0) return;
  do_nf4_dequantize(codes, absmax, out);
}

}  // namespace shardlm
