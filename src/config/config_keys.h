// The run config's key table: every valid key with the RunConfig field it sets and its
// documentation (docs/config.md, config_doc.cpp), the keys this version refuses with a reason,
// and the path arithmetic and "did you mean" suggestions built on the table. Internal to
// shardlm_config (config.cpp reads JSON and --set through it).
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "shardlm/config/config.h"

namespace shardlm::config_keys {

using FieldRef =
    std::variant<int64_t*, uint64_t*, double*, bool*, std::string*, CheckpointOffload*>;

struct KeySpec {
  std::string_view path;
  FieldRef (*field)(RunConfig&);
  // Relative paths (data.train, data.valid, log.dir) given in the config file are resolved
  // against the file's directory, so configs/demo.json can say "../data/kjv.txt" and work
  // from any working directory; paths given by --set, and defaults, are kept as they are
  // (relative to the working directory, where the user typed them).
  bool relative_to_config_dir = false;
  // The default docs/config.md shows, as markdown, for a key whose default is not a plain value
  // of a default-constructed RunConfig ("required", "preset"); "{}" in it stands for that value
  // ("preset ({})": the value of the presets that leave the key alone). Empty: the value alone,
  // so the page cannot drift from the code.
  std::string_view default_text = {};
  // What the key does, markdown (docs/config.md): paragraphs separated by a blank line.
  std::string_view meaning = {};
};

// Every valid key, in the order run_config_to_json writes them. Sections and nested objects
// (model.rope_scaling) are the path prefixes of these keys.
std::span<const KeySpec> all_keys();

// A key refused with a reason rather than "unknown key" and a suggestion.
struct PlannedKey {
  std::string_view path;
  std::string_view hint;
};

// Keys the architecture names but this version cannot honour.
std::span<const PlannedKey> planned_keys();
// Keys other tools have that are not keys here (parallel.dp is one letter from parallel.tp).
std::span<const PlannedKey> not_keys();

// The key spelled `path`, or null.
const KeySpec* find_key(std::string_view path);
// "a.b.c" -> "a/b/c" (a JSON pointer without its leading slash).
std::string dotted_to_pointer(std::string_view path);
// Whether `path` lies inside `group` ("train.lr" is under "train", "trainer.x" is not).
bool is_under(std::string_view path, std::string_view group);
// A section or nested object: a proper prefix of some key.
bool is_group(std::string_view path);
std::string_view parent_of(std::string_view path);
std::string_view leaf_of(std::string_view path);
// Valid groups and keys one level below `parent` ("" = the sections), in table order.
std::vector<std::string> children_of(std::string_view parent);
std::string join(const std::vector<std::string>& items, std::string_view sep);
// The valid key or section nearest to an unknown one, or "" when none is reasonably close.
std::string suggest(std::string_view unknown);

}  // namespace shardlm::config_keys
