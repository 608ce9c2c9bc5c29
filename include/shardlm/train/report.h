// Run reports a person opens in a browser: the loss curve and the planned-vs-measured memory
// chart as self-contained SVG (no scripts, no external fonts or styles), and the atomic file
// write the trainer uses for every report. Pure string building: no I/O except
// write_file_atomic, no dependency on the model or the trainer.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace shardlm {

// A line chart of training loss against tokens seen, with evaluation losses as markers.
// Points whose tokens or loss is not finite are skipped; empty series draw empty axes.
// Axes carry "nice" ticks (1/2/2.5/5 x 10^k): tokens in k/M/B, loss in plain decimals.
std::string loss_curve_svg(const std::vector<std::pair<double, double>>& train,  // (tokens, loss)
                           const std::vector<std::pair<double, double>>& eval,   // (tokens, loss)
                           const std::string& title);

// Grouped horizontal bars, one row per category with a planned and a measured bar, each
// labelled in B/KiB/MiB/GiB. The three vectors have one entry per category (kInternal if
// not); negative byte counts are drawn as zero.
std::string memory_chart_svg(const std::vector<std::string>& categories,
                             const std::vector<int64_t>& planned,
                             const std::vector<int64_t>& measured, const std::string& title);

// `text` with & < > " ' replaced by XML entities.
std::string xml_escape(const std::string& text);

// Writes path + ".tmp", fsyncs it and renames it over `path` (then fsyncs the directory), so
// a reader sees the old file or the new one, never a part. Throws Error(kData) naming the path.
void write_file_atomic(const std::string& path, const std::string& content);

}  // namespace shardlm
