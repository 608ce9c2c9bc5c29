// Names of element types, for messages and run reports.
#include "shardlm/core/dtype.h"

namespace shardlm {

std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::kF32:
      return "f32";
    case DType::kBF16:
      return "bf16";
    case DType::kI32:
      return "i32";
    case DType::kF64:
      return "f64";
    case DType::kI64:
      return "i64";
    case DType::kU8:
      return "u8";
  }
  return "?";
}

}  // namespace shardlm
