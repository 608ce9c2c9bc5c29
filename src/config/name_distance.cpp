// The name distances behind config key suggestions (name_distance.h).
#include "name_distance.h"

#include <algorithm>
#include <vector>

namespace shardlm {

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

namespace {

std::vector<std::string_view> split_words(std::string_view s) {
  std::vector<std::string_view> words;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t end = std::min(s.find('_', start), s.size());
    if (end > start) words.push_back(s.substr(start, end - start));
    start = end + 1;
  }
  return words;
}

}  // namespace

bool abbreviates(std::string_view a, std::string_view b) {
  const auto wa = split_words(a), wb = split_words(b);
  if (wa.empty() || wb.empty()) return false;
  auto initials = [](std::string_view w, const std::vector<std::string_view>& words) {
    if (words.size() < 2 || w.size() != words.size()) return false;
    for (size_t i = 0; i < words.size(); ++i)
      if (w[i] != words[i][0]) return false;
    return true;
  };
  if (wa.size() == 1 && initials(wa[0], wb)) return true;
  if (wb.size() == 1 && initials(wb[0], wa)) return true;
  if (wa.size() != wb.size()) return false;
  for (size_t i = 0; i < wa.size(); ++i) {
    const auto& s = wa[i].size() <= wb[i].size() ? wa[i] : wb[i];
    const auto& l = wa[i].size() <= wb[i].size() ? wb[i] : wa[i];
    if (!l.starts_with(s)) return false;
    if (wa.size() == 1 && s.size() < 3) return false;
  }
  return true;
}

}  // namespace shardlm
