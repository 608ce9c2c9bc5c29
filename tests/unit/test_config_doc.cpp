// docs/config.md against its generator (config_reference_markdown, from the key table in
// src/config/config_keys.cpp): the committed page is exactly the generated one, every key is
// documented, and the defaults shown are a default RunConfig's.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "config/config_keys.h"
#include "shardlm/config/config.h"
#include "shardlm/config/config_doc.h"
#include "shardlm/model/config.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;

constexpr const char* kRegenerate = "build/shardlm config --doc > docs/config.md";

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// Where a text first differs from the generated page, by line, so that the failure says what
// is stale.
std::string first_difference(const std::string& name, const std::string& text,
                             const std::string& generated) {
  const auto a = lines_of(text), b = lines_of(generated);
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  if (i == a.size() && i == b.size()) return "the texts differ only in their final newline";
  return fmt::format("first difference at line {}:\n  {}: {}\n  generated: {}", i + 1, name,
                     i < a.size() ? a[i] : "(end)", i < b.size() ? b[i] : "(end)");
}

TEST(ConfigDoc, DocsPageIsTheGeneratedOne) {
  const fs::path page = fs::path(SHARDLM_SOURCE_DIR) / "docs" / "config.md";
  ASSERT_TRUE(fs::exists(page)) << "docs/config.md is missing; generate it: " << kRegenerate;
  const std::string committed = test::slurp(page), generated = config_reference_markdown();
  EXPECT_TRUE(committed == generated)
      << "docs/config.md differs from the key table's documentation "
         "(src/config/config_keys.cpp); regenerate it with `"
      << kRegenerate << "` (after building shardlm) and commit it.\n"
      << first_difference("docs/config.md", committed, generated);
}

TEST(ConfigDoc, EveryKeyHasAMeaning) {
  for (const auto& key : config_keys::all_keys()) {
    EXPECT_FALSE(key.meaning.empty()) << key.path << " has no .meaning in config_keys.cpp";
    // A paragraph break is "\n\n"; a stray blank around the text would break the markdown.
    EXPECT_FALSE(key.meaning.starts_with(' ') || key.meaning.ends_with(' ') ||
                 key.meaning.ends_with('\n'))
        << key.path << ": " << key.meaning;
  }
  for (const auto& key : config_keys::planned_keys()) EXPECT_FALSE(key.hint.empty()) << key.path;
  for (const auto& key : config_keys::not_keys()) EXPECT_FALSE(key.hint.empty()) << key.path;
}

// The page's defaults are a default-constructed RunConfig's, as run_config_to_json writes them
// (spot checks, one per kind of value), and default_text replaces or frames them.
TEST(ConfigDoc, DefaultsComeFromADefaultRunConfig) {
  const std::string page = config_reference_markdown();
  const RunConfig defaults;
  const auto shown = [](const std::string& key, const std::string& value) {
    return fmt::format("### `{}`\n\nDefault: {}\n", key, value);
  };
  const auto json_of = [](const auto& v) { return fmt::format("`{}`", nlohmann::json(v).dump()); };
  for (const std::string& entry :
       {shown("train.lr", json_of(defaults.train.lr)),
        shown("train.resume", json_of(defaults.train.resume)),
        shown("zero.reduce_bucket_bytes", json_of(defaults.zero.reduce_bucket_bytes)),
        shown("memory.offload_checkpoints", json_of(defaults.memory.offload_checkpoints)),
        shown("checkpoint.at_end", json_of(defaults.checkpoint.at_end)),
        shown("data.train", "required"), shown("model.dim", "preset"),
        shown("model.qk_norm", fmt::format("preset ({})", json_of(defaults.model.qk_norm)))})
    EXPECT_NE(page.find(entry), std::string::npos) << "missing from the page:\n" << entry;
}

// The preset list is written out in model.preset's meaning; it must name every preset.
TEST(ConfigDoc, PresetMeaningNamesEveryPreset) {
  const std::string_view meaning = config_keys::find_key("model.preset")->meaning;
  for (const std::string& name : model_preset_names())
    EXPECT_NE(meaning.find(fmt::format("`{}`", name)), std::string_view::npos)
        << "model.preset's meaning (src/config/config_keys.cpp) does not name the preset " << name;
}

TEST(ConfigDoc, CommandPrintsThePage) {
  if (!fs::exists(SHARDLM_BINARY)) GTEST_SKIP() << "the shardlm binary is not built";
  const fs::path out = fs::path(testing::TempDir()) / fmt::format("config_doc_{}.md", getpid());
  const std::string printed =
      test::run_command(fmt::format("{} config --doc", SHARDLM_BINARY), out);
  fs::remove(out);
  fs::remove(fmt::format("{}.err", out.string()));
  EXPECT_TRUE(printed == config_reference_markdown())
      << first_difference("shardlm config --doc", printed, config_reference_markdown());
}

}  // namespace
}  // namespace shardlm
