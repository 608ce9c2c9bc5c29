// SVG report charts (report.h): nice-number axes, the loss curve and the planned-vs-measured
// memory bars, built as strings with every piece of user text XML-escaped. No I/O apart from
// write_file_atomic, which delegates to the durable POSIX helpers.
#include "shardlm/train/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "io/posix_file.h"
#include "shardlm/core/check.h"
#include "shardlm/core/ledger.h"

namespace shardlm {
namespace {

constexpr const char* kTrainColor = "#1f77b4";
constexpr const char* kEvalColor = "#d62728";
constexpr const char* kPlannedColor = "#9ecae1";
constexpr const char* kMeasuredColor = "#2171b5";
constexpr const char* kGridColor = "#e5e5e5";

// An axis range widened to whole multiples of a 1/2/2.5/5 x 10^k step, with its ticks.
struct Axis {
  double lo = 0, hi = 1, step = 1;
  std::vector<double> ticks;
  double frac(double v) const { return (v - lo) / (hi - lo); }
};

Axis nice_axis(double lo, double hi, int target_ticks) {
  if (!(hi > lo)) {
    const double pad = lo == 0 ? 1 : std::abs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  const double raw = (hi - lo) / std::max(1, target_ticks - 1);
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  const double f = raw / mag;
  const double nice = f <= 1 ? 1 : f <= 2 ? 2 : f <= 2.5 ? 2.5 : f <= 5 ? 5 : 10;
  Axis a;
  a.step = nice * mag;
  // The small slack keeps a value that sits on a tick (up to rounding) from adding a step.
  a.lo = std::floor(lo / a.step + 1e-9) * a.step;
  a.hi = std::ceil(hi / a.step - 1e-9) * a.step;
  const auto n = static_cast<int64_t>(std::llround((a.hi - a.lo) / a.step));
  for (int64_t i = 0; i <= n; ++i) {
    const double t = a.lo + static_cast<double>(i) * a.step;
    a.ticks.push_back(std::abs(t) < a.step * 1e-9 ? 0.0 : t);
  }
  return a;
}

// Decimals needed to print every multiple of `step` exactly (0.25 -> 2, 5 -> 0).
int decimals_for(double step) {
  int d = 0;
  double s = step;
  while (d < 9 && std::abs(s - std::round(s)) > 1e-6 * std::max(1.0, std::abs(s))) {
    s *= 10;
    ++d;
  }
  return d;
}

std::string fixed(double v, int decimals) { return fmt::format("{:.{}f}", v, decimals); }

// Token counts with one k/M/B unit for the whole axis, chosen by its largest tick.
std::vector<std::string> token_labels(const Axis& a) {
  const double top = std::max(std::abs(a.lo), std::abs(a.hi));
  double unit = 1;
  const char* suffix = "";
  if (top >= 1e9) {
    unit = 1e9, suffix = "B";
  } else if (top >= 1e6) {
    unit = 1e6, suffix = "M";
  } else if (top >= 1e3) {
    unit = 1e3, suffix = "k";
  }
  const int d = decimals_for(a.step / unit);
  std::vector<std::string> out;
  for (double t : a.ticks) out.push_back(t == 0 ? "0" : fixed(t / unit, d) + suffix);
  return out;
}

// Byte counts with one binary unit for the whole axis, chosen by its largest tick.
struct ByteUnit {
  double scale;
  const char* name;
};
ByteUnit byte_unit_for(double max_bytes) {
  if (max_bytes >= double(int64_t{1} << 30)) return {double(int64_t{1} << 30), "GiB"};
  if (max_bytes >= double(1 << 20)) return {double(1 << 20), "MiB"};
  if (max_bytes >= double(1 << 10)) return {double(1 << 10), "KiB"};
  return {1, "B"};
}

std::string num(double v) { return fmt::format("{:.1f}", v); }

std::string svg_open(int width, int height) {
  return fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" "
      "viewBox=\"0 0 {0} {1}\" font-family=\"Helvetica, Arial, sans-serif\" font-size=\"12\">\n"
      "<rect class=\"background\" x=\"0\" y=\"0\" width=\"{0}\" height=\"{1}\" fill=\"white\"/>\n",
      width, height);
}

std::string text_el(double x, double y, const std::string& text, const char* anchor,
                    const char* extra = "") {
  return fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"{}\"{}>{}</text>\n", num(x), num(y),
                     anchor, extra, xml_escape(text));
}

using Points = std::vector<std::pair<double, double>>;

// The points a chart can place: a NaN or infinite coordinate has no place on an axis.
Points finite_points(const Points& points) {
  Points out;
  for (const auto& p : points)
    if (std::isfinite(p.first) && std::isfinite(p.second)) out.push_back(p);
  return out;
}

// The loss chart's frame and axes: where a (tokens, loss) point lands, and the pieces drawn
// in it.
struct LossPlot {
  static constexpr int kWidth = 760, kHeight = 440;
  static constexpr double kLeft = 70, kRight = kWidth - 20, kTop = 50, kBottom = kHeight - 55;
  Axis x_axis, y_axis;

  double px(double x) const { return kLeft + x_axis.frac(x) * (kRight - kLeft); }
  double py(double y) const { return kBottom - y_axis.frac(y) * (kBottom - kTop); }

  // Grid, ticks and labels, and the frame.
  std::string axes_svg() const {
    std::string s = "<g class=\"x-axis\">\n";
    const auto xl = token_labels(x_axis);
    for (size_t i = 0; i < x_axis.ticks.size(); ++i) {
      const double x = px(x_axis.ticks[i]);
      s += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"{3}\"/>\n",
                       num(x), num(kTop), num(kBottom), kGridColor);
      s += text_el(x, kBottom + 18, xl[i], "middle", " class=\"tick\"");
    }
    s += text_el((kLeft + kRight) / 2, kHeight - 15, "tokens", "middle");
    s += "</g>\n<g class=\"y-axis\">\n";
    const int yd = decimals_for(y_axis.step);
    for (double t : y_axis.ticks) {
      const double y = py(t);
      s += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"{3}\"/>\n",
                       num(kLeft), num(y), num(kRight), kGridColor);
      s += text_el(kLeft - 8, y + 4, fixed(t, yd), "end", " class=\"tick\"");
    }
    s +=
        text_el(18, (kTop + kBottom) / 2, "loss", "middle",
                fmt::format(" transform=\"rotate(-90 18 {})\"", num((kTop + kBottom) / 2)).c_str());
    s += "</g>\n";
    s += fmt::format(
        "<rect class=\"frame\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"none\" "
        "stroke=\"#444\"/>\n",
        num(kLeft), num(kTop), num(kRight - kLeft), num(kBottom - kTop));
    return s;
  }

  // The training loss as one line ("" without points).
  std::string train_svg(const Points& tr) const {
    if (tr.empty()) return "";
    std::string s = fmt::format(
        "<polyline class=\"train\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" "
        "stroke-linejoin=\"round\" points=\"",
        kTrainColor);
    for (size_t i = 0; i < tr.size(); ++i)
      s += fmt::format("{}{},{}", i ? " " : "", num(px(tr[i].first)), num(py(tr[i].second)));
    s += "\"/>\n";
    // A single point draws no line: mark it so that it is visible.
    if (tr.size() == 1)
      s += fmt::format("<circle class=\"train-point\" cx=\"{}\" cy=\"{}\" r=\"3\" fill=\"{}\"/>\n",
                       num(px(tr[0].first)), num(py(tr[0].second)), kTrainColor);
    return s;
  }

  // Each evaluation as a dot whose tooltip gives its tokens and loss.
  std::string eval_svg(const Points& ev) const {
    std::string s;
    for (const auto& [x, y] : ev) {
      s += fmt::format(
          "<circle class=\"eval\" cx=\"{}\" cy=\"{}\" r=\"4\" fill=\"{}\" stroke=\"white\">"
          "<title>{} tokens: eval loss {:.4f}</title></circle>\n",
          num(px(x)), num(py(y)), kEvalColor, fmt::format("{:.0f}", x), y);
    }
    return s;
  }

  // The legend, top right inside the plot, with an entry per series drawn ("" for none).
  static std::string legend_svg(bool has_train, bool has_eval) {
    int entries = 0;
    std::string legend;
    auto legend_y = [&] { return kTop + 18 + 18 * entries; };
    if (has_train) {
      legend += fmt::format(
          "<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"{3}\" stroke-width=\"2\"/>\n",
          num(kRight - 100), num(legend_y() - 4), num(kRight - 80), kTrainColor);
      legend += text_el(kRight - 74, legend_y(), "train", "start");
      ++entries;
    }
    if (has_eval) {
      legend += fmt::format("<circle cx=\"{}\" cy=\"{}\" r=\"4\" fill=\"{}\"/>\n", num(kRight - 90),
                            num(legend_y() - 4), kEvalColor);
      legend += text_el(kRight - 74, legend_y(), "eval", "start");
      ++entries;
    }
    if (entries == 0) return "";
    return fmt::format(
               "<g class=\"legend\">\n<rect x=\"{}\" y=\"{}\" width=\"100\" height=\"{}\" "
               "fill=\"white\" fill-opacity=\"0.85\" stroke=\"#999\"/>\n",
               num(kRight - 108), num(kTop + 6), 18 * entries + 6) +
           legend + "</g>\n";
  }
};

// Axes spanning every point (0..1 both ways without any); the token axis starts at zero.
LossPlot loss_plot_for(const Points& tr, const Points& ev) {
  double x_lo = std::numeric_limits<double>::infinity(), x_hi = -x_lo;
  double y_lo = x_lo, y_hi = -x_lo;
  for (const auto* pts : {&tr, &ev}) {
    for (const auto& [x, y] : *pts) {
      x_lo = std::min(x_lo, x), x_hi = std::max(x_hi, x);
      y_lo = std::min(y_lo, y), y_hi = std::max(y_hi, y);
    }
  }
  if (tr.empty() && ev.empty()) x_lo = 0, x_hi = 1, y_lo = 0, y_hi = 1;
  if (x_lo >= 0) x_lo = 0;  // token counts read best from zero
  return LossPlot{nice_axis(x_lo, x_hi, 7), nice_axis(y_lo, y_hi, 6)};
}

}  // namespace

std::string xml_escape(const std::string& text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

std::string loss_curve_svg(const std::vector<std::pair<double, double>>& train,
                           const std::vector<std::pair<double, double>>& eval,
                           const std::string& title) {
  const Points tr = finite_points(train), ev = finite_points(eval);
  const bool empty = tr.empty() && ev.empty();
  const LossPlot plot = loss_plot_for(tr, ev);
  std::string s = svg_open(LossPlot::kWidth, LossPlot::kHeight);
  s += text_el(LossPlot::kWidth / 2.0, 28, title, "middle",
               " font-size=\"16\" font-weight=\"bold\"");
  s += plot.axes_svg();
  if (empty)
    s += text_el((LossPlot::kLeft + LossPlot::kRight) / 2, (LossPlot::kTop + LossPlot::kBottom) / 2,
                 "no data", "middle");
  s += plot.train_svg(tr);
  s += plot.eval_svg(ev);
  s += LossPlot::legend_svg(!tr.empty(), !ev.empty());
  s += "</svg>\n";
  return s;
}

std::string memory_chart_svg(const std::vector<std::string>& categories,
                             const std::vector<int64_t>& planned,
                             const std::vector<int64_t>& measured, const std::string& title) {
  SHARDLM_CHECK(planned.size() == categories.size() && measured.size() == categories.size(),
                "memory chart needs one planned and one measured value per category ({} "
                "categories, {} planned, {} measured)",
                categories.size(), planned.size(), measured.size());
  constexpr int kWidth = 760;
  constexpr double kBar = 14, kRowGap = 12, kRow = 2 * kBar + kRowGap, kTop = 70;
  size_t longest = 0;
  for (const auto& c : categories) longest = std::max(longest, c.size());
  const double left = std::max(90.0, 7.0 * static_cast<double>(longest) + 20);
  const double right = kWidth - 90;  // room for the value after the longest bar
  const double bottom = kTop + kRow * static_cast<double>(categories.size());
  const int height = static_cast<int>(bottom) + 50;

  int64_t max_bytes = 0;
  for (size_t i = 0; i < categories.size(); ++i)
    max_bytes = std::max({max_bytes, planned[i], measured[i]});
  const ByteUnit unit = byte_unit_for(static_cast<double>(max_bytes));
  const Axis ax = nice_axis(0, std::max(1.0, static_cast<double>(max_bytes) / unit.scale), 6);
  auto px = [&](int64_t bytes) {
    return left +
           ax.frac(static_cast<double>(std::max<int64_t>(0, bytes)) / unit.scale) * (right - left);
  };

  std::string s = svg_open(kWidth, height);
  s += text_el(kWidth / 2.0, 26, title, "middle", " font-size=\"16\" font-weight=\"bold\"");
  s += "<g class=\"legend\">\n";
  s += fmt::format("<rect x=\"{}\" y=\"40\" width=\"12\" height=\"12\" fill=\"{}\"/>\n", num(left),
                   kPlannedColor);
  s += text_el(left + 18, 50, "planned", "start");
  s += fmt::format("<rect x=\"{}\" y=\"40\" width=\"12\" height=\"12\" fill=\"{}\"/>\n",
                   num(left + 90), kMeasuredColor);
  s += text_el(left + 108, 50, "measured", "start");
  s += "</g>\n<g class=\"x-axis\">\n";
  const int d = decimals_for(ax.step);
  for (double t : ax.ticks) {
    const double x = left + ax.frac(t) * (right - left);
    s += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"{3}\"/>\n", num(x),
                     num(kTop - 4), num(bottom), kGridColor);
    s += text_el(x, bottom + 18, t == 0 ? "0" : fixed(t, d) + " " + unit.name, "middle",
                 " class=\"tick\"");
  }
  s += "</g>\n";

  for (size_t i = 0; i < categories.size(); ++i) {
    const double y = kTop + kRow * static_cast<double>(i);
    s += "<g class=\"category\">\n";
    s += text_el(left - 8, y + kBar + 4, categories[i], "end");
    const std::pair<const char*, int64_t> bars[2] = {{"planned", planned[i]},
                                                     {"measured", measured[i]}};
    for (int b = 0; b < 2; ++b) {
      const auto& [series, bytes] = bars[b];
      const double top = y + b * kBar;
      const double w = px(bytes) - left;
      const std::string label = format_bytes(std::max<int64_t>(0, bytes));
      s += fmt::format(
          "<rect class=\"{}\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{}\">"
          "<title>{} {}: {}</title></rect>\n",
          series, num(left), num(top), num(w), num(kBar - 1),
          b == 0 ? kPlannedColor : kMeasuredColor, xml_escape(categories[i]), series, label);
      s += text_el(left + w + 4, top + kBar - 3, label, "start", " font-size=\"11\"");
    }
    s += "</g>\n";
  }
  s += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"#444\"/>\n",
                   num(left), num(kTop - 4), num(bottom));
  s += "</svg>\n";
  return s;
}

void write_file_atomic(const std::string& path, const std::string& content) {
  posix::replace_file(path, content);
}

}  // namespace shardlm
