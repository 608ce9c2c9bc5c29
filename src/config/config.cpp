// The JSON run-configuration loader: one key table (config_keys.cpp) drives parsing, --set
// overrides, run_config_to_json and the "did you mean" suggestions, so a key added there is
// everywhere.
// Every failure is Error(kConfig) naming the full key path and the fix; nothing here reads
// data files or touches the model beyond resolving the preset. The value rules are in
// config_validate.cpp.
#include "shardlm/config/config.h"
#include "shardlm/hf/hf.h"

#include "config_keys.h"
#include "json_show.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>
#include <variant>

#include "shardlm/core/check.h"
#include "shardlm/io/tokenize.h"

namespace shardlm {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

using config_keys::children_of;
using config_keys::dotted_to_pointer;
using config_keys::find_key;
using config_keys::is_group;
using config_keys::is_under;
using config_keys::join;
using config_keys::KeySpec;
using config_keys::leaf_of;
using config_keys::parent_of;
using config_keys::suggest;

// A JSON value's type in an error message's words.
std::string type_of(const json& v) {
  if (v.is_number_integer()) return "integer";
  if (v.is_number_float()) return "number";
  return v.type_name();
}

[[noreturn]] void fail_type(std::string_view path, std::string_view want, const json& v) {
  SHARDLM_FAIL(ErrorKind::kConfig, "{} must be {}, got {} ({})", path, want, quote_json(v),
               type_of(v));
}

// A value bound for a key, from the file or from --set.
struct Assignment {
  std::string path;
  json value;
  std::string set_text;        // the --set argument, "" when the value came from the file
  bool set_names_key = false;  // --set named this key itself (not a section holding it)
};

void flatten(const json& obj, const std::string& prefix, const std::string& set_text,
             std::vector<Assignment>& out) {
  for (const auto& [name, value] : obj.items()) {
    const std::string path = prefix.empty() ? name : prefix + "." + name;
    if (name.find('.') != std::string::npos)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "key '{}' contains '.'; nest it as an object instead (\"train\": {{\"lr\": "
                   "...}}) or use --set {}=...",
                   path, path);
    if (find_key(path)) {
      out.push_back({path, value, set_text});
    } else if (is_group(path)) {
      if (!value.is_object())
        SHARDLM_FAIL(ErrorKind::kConfig, "'{}' must be a JSON object with keys {}; got {} ({})",
                     path, join(children_of(path), ", "), quote_json(value), type_of(value));
      flatten(value, path, set_text, out);
    } else {
      for (const auto& planned : config_keys::planned_keys())
        if (planned.path == path)
          SHARDLM_FAIL(ErrorKind::kConfig, "'{}' is not supported in this version; {}", path,
                       planned.hint);
      for (const auto& not_key : config_keys::not_keys())
        if (not_key.path == path)
          SHARDLM_FAIL(ErrorKind::kConfig, "'{}' is not a key: {}", path, not_key.hint);
      if (std::string near = suggest(path); !near.empty())
        SHARDLM_FAIL(ErrorKind::kConfig, "unknown {} '{}'; did you mean '{}'?",
                     prefix.empty() ? "section" : "key", path, near);
      if (prefix.empty())
        SHARDLM_FAIL(ErrorKind::kConfig, "unknown section '{}'; valid sections: {}", path,
                     join(children_of(""), ", "));
      SHARDLM_FAIL(ErrorKind::kConfig, "unknown key '{}'; valid keys in '{}': {}", path, prefix,
                   join(children_of(prefix), ", "));
    }
  }
}

// JSON number -> int64, accepting integral floats (1e6) and rejecting everything else.
int64_t to_int(std::string_view path, const json& v) {
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      SHARDLM_FAIL(ErrorKind::kConfig, "{} is out of range: {}", path, quote_json(v));
    return static_cast<int64_t>(v.get<uint64_t>());
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::trunc(d) != d) fail_type(path, "an integer", v);
    if (!(d >= -9.2233720368547758e18 && d < 9.2233720368547758e18))
      SHARDLM_FAIL(ErrorKind::kConfig, "{} is out of range: {}", path, quote_json(v));
    return static_cast<int64_t>(d);
  }
  fail_type(path, "an integer", v);
}

uint64_t to_uint(std::string_view path, const json& v) {
  if (v.is_number_unsigned()) return v.get<uint64_t>();
  if (v.is_number_integer() && v.get<int64_t>() >= 0)
    return static_cast<uint64_t>(v.get<int64_t>());
  if (v.is_number_integer() || (v.is_number_float() && v.get<double>() < 0))
    SHARDLM_FAIL(ErrorKind::kConfig, "{} must be a non-negative integer, got {}", path,
                 quote_json(v));
  if (v.is_number_float()) {
    const double d = v.get<double>();
    if (std::trunc(d) != d) fail_type(path, "a non-negative integer", v);
    if (!(d < 1.8446744073709552e19))
      SHARDLM_FAIL(ErrorKind::kConfig, "{} is out of range: {}", path, quote_json(v));
    return static_cast<uint64_t>(d);
  }
  fail_type(path, "a non-negative integer", v);
}

double to_double(std::string_view path, const json& v) {
  if (!v.is_number()) fail_type(path, "a number", v);
  const double d = v.get<double>();
  if (!std::isfinite(d)) SHARDLM_FAIL(ErrorKind::kConfig, "{} must be finite", path);
  return d;
}

// true, false, a fraction in [0, 1] or "auto".
CheckpointOffload to_checkpoint_offload(std::string_view path, const json& v) {
  if (v.is_boolean()) return {v.get<bool>() ? 1.0 : 0.0, false};
  if (v.is_string() && v.get<std::string>() == "auto") return {0, true};
  if (v.is_number() && v.get<double>() >= 0 && v.get<double>() <= 1)
    return {v.get<double>(), false};
  fail_type(path, "true, false, a fraction in [0, 1] or \"auto\"", v);
}

void assign(RunConfig& cfg, const KeySpec& key, const Assignment& a) {
  const std::string_view path = key.path;
  const json& v = a.value;
  std::visit(
      [&](auto* field) {
        using T = std::remove_pointer_t<decltype(field)>;
        if constexpr (std::is_same_v<T, int64_t>) {
          *field = to_int(path, v);
        } else if constexpr (std::is_same_v<T, uint64_t>) {
          *field = to_uint(path, v);
        } else if constexpr (std::is_same_v<T, double>) {
          *field = to_double(path, v);
        } else if constexpr (std::is_same_v<T, bool>) {
          if (!v.is_boolean()) fail_type(path, "true or false", v);
          *field = v.get<bool>();
        } else if constexpr (std::is_same_v<T, CheckpointOffload>) {
          *field = to_checkpoint_offload(path, v);
        } else {
          if (v.is_string()) {
            *field = v.get<std::string>();
          } else if (a.set_names_key && !v.is_object() && !v.is_array()) {
            // --set data.train=2024 means the file "2024", not a type error.
            *field = a.set_text.substr(a.set_text.find('=') + 1);
          } else {
            fail_type(path, "a string", v);
          }
          if (key.relative_to_config_dir && a.set_text.empty() && !field->empty() &&
              !cfg.config_dir.empty() && fs::path(*field).is_relative())
            *field = (fs::path(cfg.config_dir) / *field).lexically_normal().string();
        }
      },
      key.field(cfg));
}

// Reports an error in a --set value as coming from that argument.
template <typename F>
void with_origin(const Assignment& a, F&& f) {
  if (a.set_text.empty()) return f();
  try {
    f();
  } catch (const Error& e) {
    SHARDLM_FAIL(ErrorKind::kConfig, "--set {}: {}", a.set_text, e.what());
  }
}

std::vector<Assignment> parse_overrides(const std::vector<std::string>& overrides) {
  std::vector<Assignment> out;
  for (const auto& text : overrides) {
    const size_t eq = text.find('=');
    if (eq == std::string::npos)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "--set '{}': expected key.path=value (for example --set train.lr=1e-3)", text);
    std::string path = text.substr(0, eq);
    const auto ws = " \t";
    path.erase(0, path.find_first_not_of(ws));
    path.erase(path.find_last_not_of(ws) + 1);
    if (path.empty() || path.starts_with('.') || path.ends_with('.') ||
        path.find("..") != std::string::npos)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "--set '{}': '{}' is not a key path; expected section.key=value", text, path);
    json value = json::parse(text.substr(eq + 1), nullptr, /*allow_exceptions=*/false);
    if (value.is_discarded()) value = text.substr(eq + 1);
    // Wrap the value as {"a": {"b": value}} so --set goes through the file's checks exactly.
    json wrapped = value;
    for (std::string_view p = path; !p.empty(); p = parent_of(p))
      wrapped = json::object({{std::string(leaf_of(p)), std::move(wrapped)}});
    const size_t first_new = out.size();
    try {
      flatten(wrapped, "", text, out);
    } catch (const Error& e) {
      SHARDLM_FAIL(ErrorKind::kConfig, "--set {}: {}", text, e.what());
    }
    for (size_t i = first_new; i < out.size(); ++i) out[i].set_names_key = out[i].path == path;
  }
  return out;
}

// "[json.exception.parse_error.101] parse error at ..." -> "parse error at ...".
std::string without_exception_id(std::string what) {
  const size_t p = what.find("] ");
  return what.starts_with("[json.exception") && p != std::string::npos ? what.substr(p + 2) : what;
}

RunConfig parse_impl(const std::string& json_text, const std::vector<std::string>& overrides,
                     const std::string& base_dir, const std::string& source, bool validate = true) {
  json doc;
  try {
    doc = json::parse(json_text);
  } catch (const json::parse_error& e) {
    SHARDLM_FAIL(ErrorKind::kConfig, "{}: invalid JSON at byte {}: {}", source, e.byte,
                 without_exception_id(e.what()));
  } catch (const json::exception& e) {  // number overflow ("1e999") reports no position
    SHARDLM_FAIL(ErrorKind::kConfig, "{}: invalid JSON: {}", source,
                 without_exception_id(e.what()));
  }
  if (!doc.is_object())
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "{}: the config must be a JSON object with sections {}; got {}", source,
                 join(children_of(""), ", "), type_of(doc));

  std::vector<Assignment> assignments;
  flatten(doc, "", "", assignments);
  for (auto& a : parse_overrides(overrides)) assignments.push_back(std::move(a));

  RunConfig cfg;
  cfg.config_dir = base_dir;
  // The preset is the base that every other model.* key overrides, wherever it was set.
  const KeySpec& preset_key = *find_key("model.preset");
  const KeySpec& hf_key = *find_key("model.hf_dir");
  for (const auto& a : assignments)
    if (a.path == preset_key.path || a.path == hf_key.path)
      with_origin(a, [&] { assign(cfg, *find_key(a.path), a); });
  const bool from_hf = !cfg.model_hf_dir.empty();
  // A Hugging Face directory's config.json is the model (model.preset is then ignored);
  // model.* keys given beside it must agree with it.
  cfg.model = from_hf ? read_hf_config(cfg.model_hf_dir).config : model_preset(cfg.model_preset);
  for (const auto& a : assignments) {
    if (a.path == preset_key.path || a.path == hf_key.path) continue;
    const KeySpec& key = *find_key(a.path);
    if (!from_hf || !is_under(a.path, "model")) {
      with_origin(a, [&] { assign(cfg, key, a); });
      continue;
    }
    RunConfig probe = cfg;
    with_origin(a, [&] { assign(probe, key, a); });
    // Built by appending: GCC 12's -Wrestrict misfires on "/" + std::string.
    std::string pointer = "/";
    pointer += dotted_to_pointer(a.path);
    const json given = run_config_to_json(probe)[json::json_pointer(pointer)];
    const json hf = run_config_to_json(cfg)[json::json_pointer(pointer)];
    if (given != hf)
      SHARDLM_FAIL(ErrorKind::kConfig,
                   "{} = {} disagrees with model.hf_dir's config.json ({}/config.json says {}); "
                   "drop {} (the Hugging Face config defines the model)",
                   a.path, given.dump(), cfg.model_hf_dir, hf.dump(), a.path);
  }

  if (validate) cfg.validate();
  return cfg;
}

}  // namespace

// As the key is written: false, true, the fraction, or "auto".
void to_json(json& out, const CheckpointOffload& offload) {
  if (offload.automatic)
    out = "auto";
  else if (offload.fraction == 0 || offload.fraction == 1)
    out = offload.fraction == 1;
  else
    out = offload.fraction;
}

RunConfig parse_run_config(const std::string& json_text, const std::vector<std::string>& overrides,
                           const std::string& base_dir) {
  return parse_impl(json_text, overrides, base_dir, "<config text>");
}

namespace {

RunConfig load_impl(const std::string& path, const std::vector<std::string>& overrides,
                    bool validate) {
  std::error_code ec;
  if (fs::is_directory(path, ec))
    SHARDLM_FAIL(ErrorKind::kConfig, "config file '{}' is a directory; pass a JSON file", path);
  std::ifstream in(path, std::ios::binary);
  if (!in)
    SHARDLM_FAIL(ErrorKind::kConfig, "cannot read config file '{}': {}", path,
                 std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) SHARDLM_FAIL(ErrorKind::kConfig, "cannot read config file '{}'", path);
  std::string dir = fs::path(path).parent_path().string();
  return parse_impl(text.str(), overrides, dir.empty() ? "." : dir, path, validate);
}

}  // namespace

RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides) {
  return load_impl(path, overrides, /*validate=*/true);
}

RunConfig load_run_config_unvalidated(const std::string& path,
                                      const std::vector<std::string>& overrides) {
  return load_impl(path, overrides, /*validate=*/false);
}

std::string RunConfig::tokenizer_path() const {
  if (!data.tokenizer.empty()) return data.tokenizer;
  if (!model_hf_dir.empty() && !find_tokenizer(model_hf_dir).empty()) return model_hf_dir;
  return "byte";
}

nlohmann::json run_config_to_json(const RunConfig& cfg) {
  RunConfig copy = cfg;  // the key table hands out mutable field pointers
  json out = json::object();
  for (const auto& key : config_keys::all_keys()) {
    std::string pointer = "/";
    pointer += key.path;
    std::replace(pointer.begin(), pointer.end(), '.', '/');
    std::visit(
        [&](auto* field) {
          json value = *field;
          // A --set string need not be UTF-8 (a Latin-1 file name); keep the output dumpable.
          if (value.is_string())
            value = json::parse(value.dump(-1, ' ', false, json::error_handler_t::replace));
          out[json::json_pointer(pointer)] = std::move(value);
        },
        key.field(copy));
  }
  return out;
}

int64_t ZeroConfig::bucket_elems(size_t param_bytes) const {
  return std::max<int64_t>(
      1, std::min<int64_t>(reduce_bucket_bytes / 4, allgather_bucket_bytes / int64_t(param_bytes)));
}

}  // namespace shardlm
