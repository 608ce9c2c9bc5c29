// The default device clock of a backend whose ops finish before they return: marks are the
// host's steady clock in nanoseconds, readable forever.
#include <chrono>

#include "shardlm/backend/backend.h"

namespace shardlm {

uint64_t Backend::mark() {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch())
                      .count());
}

double Backend::seconds_between(uint64_t a, uint64_t b) { return (double(b) - double(a)) * 1e-9; }

}  // namespace shardlm
