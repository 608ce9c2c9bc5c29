// The configuration reference (docs/config.md), generated from the key table so that the page
// cannot disagree with the keys the loader accepts: `shardlm config --doc` prints it, and a
// unit test fails when the committed page differs from it.
#pragma once

#include <string>

namespace shardlm {

// The whole page, markdown: what a config is, then every key by section with its default (the
// value of a default RunConfig as run_config_to_json writes it, or the key's default_text) and
// its meaning, the refused keys with their reasons, and how a DeepSpeed config maps onto them.
std::string config_reference_markdown();

}  // namespace shardlm
