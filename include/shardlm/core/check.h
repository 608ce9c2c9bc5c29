// Error type and the SHARDLM_CHECK macro used by every layer.
// Library code never exits: it throws shardlm::Error carrying a kind, so that only cli/
// decides exit codes and user-facing wording.
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace shardlm {

// What kind of failure, so that cli/ can map it onto an exit code.
enum class ErrorKind {
  kInternal = 1,     // a bug or an unexpected runtime failure
  kConfig = 2,       // bad usage or invalid configuration: the message names the key
  kData = 3,         // unreadable, truncated or corrupt data/checkpoint: names the file
  kOutOfMemory = 4,  // an allocation exceeded a budget or failed
};

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

namespace detail {
[[noreturn]] void throw_check_failure(ErrorKind kind, const char* expr, const char* file, int line,
                                      const char* func, const std::string& message);
}  // namespace detail

}  // namespace shardlm

// SHARDLM_CHECK(cond, "what is wrong; what to do {}", args...) throws shardlm::Error
// (kind kInternal) with file:line:function. The _KIND variant picks the ErrorKind.
#define SHARDLM_CHECK_KIND(kind, cond, ...)                                               \
  do {                                                                                    \
    if (!(cond)) [[unlikely]] {                                                           \
      ::shardlm::detail::throw_check_failure((kind), #cond, __FILE__, __LINE__, __func__, \
                                             ::fmt::format(__VA_ARGS__));                 \
    }                                                                                     \
  } while (0)

#define SHARDLM_CHECK(cond, ...) \
  SHARDLM_CHECK_KIND(::shardlm::ErrorKind::kInternal, cond, __VA_ARGS__)

// Errors that are the user's, not the engine's: no file:line, just the message.
#define SHARDLM_FAIL(kind, ...) throw ::shardlm::Error((kind), ::fmt::format(__VA_ARGS__))
