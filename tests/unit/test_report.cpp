// SVG reports (src/train/report.cpp): well-formed markup (balanced tags, escaped text), one
// polyline vertex per finite loss point, one marker per finite eval point, hand-computed nice
// tick labels with k/M/B and KiB/MiB/GiB units, one bar per category and series with widths
// proportional to bytes, degenerate inputs, and the atomic file write.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <regex>
#include <string>
#include <vector>

#include "shardlm/core/check.h"
#include "shardlm/core/ledger.h"
#include "shardlm/train/report.h"
#include "test_util.h"

namespace shardlm {
namespace {

namespace fs = std::filesystem;
using Points = std::vector<std::pair<double, double>>;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// Checks XML well-formedness for the subset we emit: every start tag closed in order, no
// stray '<' or '>' in text, and every '&' starting a known entity. Returns "" or the problem.
std::string xml_problem(const std::string& s) {
  std::vector<std::string> open;
  size_t i = 0;
  while (i < s.size()) {
    if (s[i] == '>') return "stray '>' at " + std::to_string(i);
    if (s[i] == '&') {
      static const std::regex entity("^&(amp|lt|gt|quot|apos);");
      if (!std::regex_search(s.substr(i, 8), entity)) return "bare '&' at " + std::to_string(i);
    }
    if (s[i] != '<') {
      ++i;
      continue;
    }
    const size_t end = s.find('>', i);
    if (end == std::string::npos) return "unterminated tag at " + std::to_string(i);
    const std::string tag = s.substr(i + 1, end - i - 1);
    if (tag.find('<') != std::string::npos) return "'<' inside tag at " + std::to_string(i);
    if (tag.empty()) return "empty tag";
    if (tag[0] == '/') {
      const std::string name = tag.substr(1);
      if (open.empty() || open.back() != name) return "unbalanced </" + name + ">";
      open.pop_back();
    } else if (tag.back() != '/') {
      open.push_back(tag.substr(0, tag.find_first_of(" \n")));
    }
    i = end + 1;
  }
  if (!open.empty()) return "unclosed <" + open.back() + ">";
  return "";
}

size_t count(const std::string& s, const std::string& needle) {
  size_t n = 0;
  for (size_t p = s.find(needle); p != std::string::npos; p = s.find(needle, p + 1)) ++n;
  return n;
}

// The number of "x,y" vertices in the polyline of class `cls`.
size_t polyline_vertices(const std::string& svg, const std::string& cls) {
  const size_t at = svg.find("<polyline class=\"" + cls + "\"");
  if (at == std::string::npos) return 0;
  const size_t p = svg.find("points=\"", at) + 8;
  const std::string pts = svg.substr(p, svg.find('"', p) - p);
  return count(pts, ",");
}

// Tick labels inside the <g class="<group>"> element, in order.
std::vector<std::string> tick_labels(const std::string& svg, const std::string& group) {
  const size_t begin = svg.find("<g class=\"" + group + "\">");
  const std::string g = svg.substr(begin, svg.find("</g>", begin) - begin);
  static const std::regex tick("class=\"tick\">([^<]*)</text>");
  std::vector<std::string> out;
  for (auto it = std::sregex_iterator(g.begin(), g.end(), tick); it != std::sregex_iterator(); ++it)
    out.push_back((*it)[1]);
  return out;
}

// The width attribute of the n-th <rect class="cls">.
double rect_width(const std::string& svg, const std::string& cls, size_t n) {
  size_t at = 0;
  for (size_t k = 0; k <= n; ++k) at = svg.find("<rect class=\"" + cls + "\"", at + 1);
  const size_t p = svg.find("width=\"", at) + 7;
  return std::stod(svg.substr(p, svg.find('"', p) - p));
}

Points decaying_loss(int n, double tokens_per_step) {
  Points pts;
  for (int i = 0; i < n; ++i)
    pts.emplace_back(tokens_per_step * (i + 1), 10 * std::exp(-i / 30.0) + 2);
  return pts;
}

TEST(LossCurveSvg, WellFormedWithOneVertexPerFiniteTrainPoint) {
  Points train = decaying_loss(100, 4000);  // tokens 4k .. 400k, loss 12 .. 2.4
  train[10].second = kNaN;
  train[20].second = kInf;
  train[30].first = kNaN;
  const Points eval = {{100000, 5.0}, {200000, kNaN}, {300000, 3.0}, {400000, 2.5}};
  const std::string svg = loss_curve_svg(train, eval, "tiny: loss");

  ASSERT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_EQ(xml_problem(svg), "");
  EXPECT_EQ(count(svg, "<svg"), 1u);
  EXPECT_EQ(count(svg, "</svg>"), 1u);
  EXPECT_EQ(count(svg, "<text"), count(svg, "</text>"));
  EXPECT_EQ(polyline_vertices(svg, "train"), 97u);
  EXPECT_EQ(count(svg, "<circle class=\"eval\""), 3u);
  EXPECT_NE(svg.find(">tiny: loss</text>"), std::string::npos);
  EXPECT_NE(svg.find(">train</text>"), std::string::npos);
  EXPECT_NE(svg.find(">eval</text>"), std::string::npos);
  EXPECT_NE(svg.find(">tokens</text>"), std::string::npos);
  EXPECT_NE(svg.find(">loss</text>"), std::string::npos);
  EXPECT_EQ(svg.find("nan"), std::string::npos);
  EXPECT_EQ(svg.find("inf"), std::string::npos);

  // By hand: tokens 0..400k over ~7 ticks -> step 100k; loss 2.37..12 over ~6 -> step 2.
  EXPECT_EQ(tick_labels(svg, "x-axis"),
            (std::vector<std::string>{"0", "100k", "200k", "300k", "400k"}));
  EXPECT_EQ(tick_labels(svg, "y-axis"), (std::vector<std::string>{"2", "4", "6", "8", "10", "12"}));
}

TEST(LossCurveSvg, TickUnitsAndDecimalsFollowTheRange) {
  auto labels = [](double max_tokens, double lo, double hi) {
    const std::string svg = loss_curve_svg({{0, hi}, {max_tokens, lo}}, {}, "t");
    return std::make_pair(tick_labels(svg, "x-axis"), tick_labels(svg, "y-axis"));
  };
  // 2.5M tokens, step 0.5M; loss 3.1..3.5 -> step 0.1.
  auto [x, y] = labels(2.5e6, 3.1, 3.5);
  EXPECT_EQ(x, (std::vector<std::string>{"0", "0.5M", "1.0M", "1.5M", "2.0M", "2.5M"}));
  EXPECT_EQ(y, (std::vector<std::string>{"3.1", "3.2", "3.3", "3.4", "3.5"}));
  // 3B tokens, step 0.5B; loss 1..2.2 -> raw step 0.24 -> 0.25 (needs two decimals).
  std::tie(x, y) = labels(3e9, 1, 2.2);
  EXPECT_EQ(x.back(), "3.0B");
  EXPECT_EQ(y, (std::vector<std::string>{"1.00", "1.25", "1.50", "1.75", "2.00", "2.25"}));
  // 600 tokens: plain numbers, step 100.
  std::tie(x, y) = labels(600, 5, 9);
  EXPECT_EQ(x, (std::vector<std::string>{"0", "100", "200", "300", "400", "500", "600"}));
}

TEST(LossCurveSvg, DegenerateInputsStillDrawAxes) {
  for (const Points& train : {Points{}, Points{{kNaN, kNaN}, {1, kInf}}}) {
    const std::string svg = loss_curve_svg(train, {}, "empty");
    EXPECT_EQ(xml_problem(svg), "");
    EXPECT_NE(svg.find(">no data</text>"), std::string::npos);
    EXPECT_EQ(svg.find("<polyline"), std::string::npos);
    EXPECT_FALSE(tick_labels(svg, "x-axis").empty());
  }
  // One point: a one-vertex line plus a visible marker; the flat loss still gets a range.
  const std::string one = loss_curve_svg({{1000, 4.2}}, {}, "one");
  EXPECT_EQ(xml_problem(one), "");
  EXPECT_EQ(polyline_vertices(one, "train"), 1u);
  EXPECT_EQ(count(one, "class=\"train-point\""), 1u);
  EXPECT_GE(tick_labels(one, "y-axis").size(), 2u);
  // Only eval points.
  const std::string ev = loss_curve_svg({}, {{10, 3}, {20, 2}}, "eval only");
  EXPECT_EQ(xml_problem(ev), "");
  EXPECT_EQ(count(ev, "<circle class=\"eval\""), 2u);
  EXPECT_EQ(ev.find(">train</text>"), std::string::npos);
}

TEST(LossCurveSvg, TextIsEscaped) {
  const std::string svg = loss_curve_svg(decaying_loss(5, 10), {}, "a & b < c > \"d\" 'e'");
  EXPECT_EQ(xml_problem(svg), "");
  EXPECT_NE(svg.find("a &amp; b &lt; c &gt; &quot;d&quot; &apos;e&apos;"), std::string::npos);
  EXPECT_EQ(xml_escape("<&>"), "&lt;&amp;&gt;");
}

TEST(MemoryChartSvg, OneBarPerCategoryAndSeriesProportionalToBytes) {
  std::vector<std::string> names;
  for (int c = 0; c < kNumMemCategories; ++c)
    names.emplace_back(mem_category_name(static_cast<MemCategory>(c)));
  const int64_t MiB = int64_t{1} << 20;
  const std::vector<int64_t> planned = {400 * MiB, 400 * MiB, 800 * MiB, 1536 * MiB, 64 * MiB,
                                        0,         0,         300 * MiB, 32 * MiB};
  const std::vector<int64_t> measured = {400 * MiB, 400 * MiB, 800 * MiB, 1200 * MiB, 70 * MiB,
                                         0,         5 * 1024,  300 * MiB, 32 * MiB};
  ASSERT_EQ(planned.size(), names.size());
  const std::string svg = memory_chart_svg(names, planned, measured, "device <peak> & plan");

  ASSERT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_EQ(xml_problem(svg), "");
  EXPECT_EQ(count(svg, "<rect class=\"planned\""), names.size());
  EXPECT_EQ(count(svg, "<rect class=\"measured\""), names.size());
  EXPECT_NE(svg.find("device &lt;peak&gt; &amp; plan"), std::string::npos);
  for (const auto& n : names) EXPECT_NE(svg.find(">" + n + "</text>"), std::string::npos) << n;
  // Value labels use the ledger's units; the axis uses one unit for all ticks.
  EXPECT_NE(svg.find(">1.50 GiB</text>"), std::string::npos);
  EXPECT_NE(svg.find(">400.0 MiB</text>"), std::string::npos);
  EXPECT_NE(svg.find(">5.0 KiB</text>"), std::string::npos);
  EXPECT_NE(svg.find(">0 B</text>"), std::string::npos);
  // 1.5 GiB over ~6 ticks -> step 0.5 GiB.
  EXPECT_EQ(tick_labels(svg, "x-axis"),
            (std::vector<std::string>{"0", "0.5 GiB", "1.0 GiB", "1.5 GiB"}));

  const double unit = rect_width(svg, "planned", 0) / 400.0;  // pixels per MiB
  ASSERT_GT(unit, 0);
  EXPECT_NEAR(rect_width(svg, "planned", 3), 1536 * unit, 0.2);
  EXPECT_NEAR(rect_width(svg, "measured", 3), 1200 * unit, 0.2);
  EXPECT_NEAR(rect_width(svg, "measured", 4), 70 * unit, 0.2);
  EXPECT_EQ(rect_width(svg, "planned", 5), 0.0);
}

TEST(MemoryChartSvg, EmptyZeroAndMismatchedInputs) {
  EXPECT_EQ(xml_problem(memory_chart_svg({}, {}, {}, "nothing")), "");
  const std::string zero = memory_chart_svg({"a&b"}, {0}, {-5}, "zeros");
  EXPECT_EQ(xml_problem(zero), "");
  EXPECT_NE(zero.find(">a&amp;b</text>"), std::string::npos);
  EXPECT_EQ(rect_width(zero, "measured", 0), 0.0);
  try {
    memory_chart_svg({"a", "b"}, {1}, {1, 2}, "bad");
    ADD_FAILURE() << "mismatched lengths accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInternal);
  }
}

TEST(WriteFileAtomic, ReplacesTheFileAndLeavesNoTemporary) {
  const fs::path dir =
      shardlm::test::scratch_root() / ("shardlm_report_" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string path = (dir / "loss.svg").string();
  for (const std::string content : {"first version, longer", "second"}) {
    write_file_atomic(path, content);
    std::ifstream f(path);
    EXPECT_EQ(std::string(std::istreambuf_iterator<char>(f), {}), content);
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1);
  try {
    write_file_atomic((dir / "absent" / "x.svg").string(), "x");
    ADD_FAILURE() << "write into a missing directory succeeded";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kData);
    EXPECT_NE(std::string(e.what()).find((dir / "absent").string()), std::string::npos);
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace shardlm
