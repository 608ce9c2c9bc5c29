// Formats check failures with their source location; the only definition behind SHARDLM_CHECK.
#include "shardlm/core/check.h"

namespace shardlm::detail {

void throw_check_failure(ErrorKind kind, const char* expr, const char* file, int line,
                         const char* func, const std::string& message) {
  throw Error(
      kind, fmt::format("{} [check `{}` failed at {}:{} in {}]", message, expr, file, line, func));
}

}  // namespace shardlm::detail
