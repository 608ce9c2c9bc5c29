// Host memory readings for out-of-memory messages (host_memory.h).
#include "shardlm/core/host_memory.h"

#include <fmt/format.h>

#include <fstream>
#include <sstream>

#include "shardlm/core/ledger.h"

namespace shardlm {

int64_t host_available_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream fields(line.substr(13));
    int64_t kib = -1;
    fields >> kib;
    return kib < 0 ? -1 : kib * 1024;
  }
  return -1;
}

std::string host_refusal_text(size_t bytes, bool pinned) {
  const int64_t avail = host_available_bytes();
  return fmt::format(
      "out of host memory: the operating system refused {}{} (the machine has {} "
      "available)",
      format_bytes(int64_t(bytes)), pinned ? " of pinned memory" : "",
      avail < 0 ? std::string("an unknown amount") : format_bytes(avail));
}

}  // namespace shardlm
