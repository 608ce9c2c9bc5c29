// Internal to src/io: durable-write helpers shared by the token-shard and safetensors writers.
// Failures are Error(kData) naming the path and the system's reason.
#pragma once

#include <string>

namespace shardlm::io_detail {

// fsyncs a directory, so that a rename into it survives a crash.
void fsync_directory(const std::string& dir);

}  // namespace shardlm::io_detail
