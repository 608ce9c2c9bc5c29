// How near one name is to another, for "did you mean" suggestions on unknown config keys:
// an edit distance and an abbreviation test on snake_case words.
#pragma once

#include <cstddef>
#include <string_view>

namespace shardlm {

// Optimal-string-alignment distance: Levenshtein plus adjacent transpositions ("trian").
size_t edit_distance(std::string_view a, std::string_view b);

// "lr" ~ "learning_rate" (initials), "n_layers" ~ "num_layers", "dim" ~ "dimension" (each
// word a prefix of the other's).
bool abbreviates(std::string_view a, std::string_view b);

}  // namespace shardlm
