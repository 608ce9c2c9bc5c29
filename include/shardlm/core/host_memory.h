// What the machine can still give in host memory, for the message of a host allocation the OS
// refuses (the plan counted it; the machine could not provide it).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace shardlm {

// MemAvailable of /proc/meminfo in bytes, or -1 where it cannot be read.
int64_t host_available_bytes();

// "out of host memory: the OS refused N (pinned) ...; the machine has M available" for
// Error(kOutOfMemory) thrown by a backend's host allocation.
std::string host_refusal_text(size_t bytes, bool pinned);

}  // namespace shardlm
