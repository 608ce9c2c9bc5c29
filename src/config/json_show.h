// Internal to train/: how a JSON value is quoted in an error message (compact, cut at 60
// characters on a UTF-8 boundary, invalid UTF-8 replaced). Shared by the config loader and the
// DeepSpeed mapping so both quote user input the same way.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace shardlm {

inline std::string quote_json(const nlohmann::json& v) {
  std::string s = v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (s.size() > 60) {
    size_t n = 57;
    while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
    s = s.substr(0, n) + "...";
  }
  return s;
}

}  // namespace shardlm
