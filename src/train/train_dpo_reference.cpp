// TrainRun's side of full fine-tuning DPO's reference (preference_reference.h): the table's key
// for this run, its reuse or computation before the first step (and before a resume loads
// trained weights), the held-out set's table beside it (evaluation), and `shardlm dpo-reference`.
#include <numeric>

#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/hf/hf.h"
#include "train_run.h"

namespace shardlm::trainer_detail {

json TrainRun::dpo_reference_key(Dataset& set, const std::vector<int64_t>& order,
                                 std::span<int32_t> rows) {
  json model = {
      {"weights_crc32", initial_weights_crc_},
      {"param_dtype", cfg_.precision.param},
      {"activation_dtype", std::string(dtype_name(cfg_.precision.activation_dtype()))},
      {"config", hf_config_json(cfg_.model, default_hf_architecture(cfg_.model), DType::kF32)}};
  if (cfg_.model_hf_dir.empty())
    model["init_seed"] = cfg_.train.seed;
  else
    model["hf_dir"] = fs::absolute(cfg_.model_hf_dir).lexically_normal().string();
  // The sums do not depend on beta or the loss type: any dpo run of the same data and model
  // reads them.
  return {{"objective", "dpo"}, {"data", reference_data_key(set, order, rows)}, {"model", model}};
}

void TrainRun::prepare_dpo_reference(bool refuse_stale) {
  // The pass reads the windows in order: the training set's from the epoch order's buffer, which
  // holds no epoch yet (the first step fills it), so that the pass holds no order of its own
  // outside the ledger; the held-out set's from the evaluation's.
  std::iota(epoch_order_.begin(), epoch_order_.end(), int64_t{0});
  prepare_reference_table(*train_set_, epoch_order_, *reference_table_, reference_file(dir_),
                          refuse_stale, "dpo reference");
  // The held-out set's sums, for evaluation under the objective (preference_eval.h): a second
  // keyed file rather than a section of the training one, so that a changed held-out set
  // recomputes only its own sums and never refuses a resume (no step was taken against them),
  // and the training table's format and key stay what `dpo-reference` and older runs wrote.
  prepare_reference_table(*valid_set_, eval_order_, *valid_reference_table_,
                          dir_ / "dpo_reference_valid.json", false, "dpo reference (held-out)");
}

void TrainRun::prepare_reference_table(Dataset& set, const std::vector<int64_t>& order,
                                       ReferenceTable& table, const fs::path& path,
                                       bool refuse_stale, std::string_view what) {
  const Clock::time_point t0 = Clock::now();
  const json key = dpo_reference_key(set, order, table.key_rows);
  // Rank 0 reads the file (the run directory may be rank 0's alone); the others learn whether
  // it served and receive its sums through an exact sum with their zeros.
  std::string why;
  bool found = false;
  if (lead_) {
    if (std::optional<ReferenceTable> read = read_reference(path, key, table, why)) {
      table = std::move(*read);
      found = true;
    }
  }
  const bool compute = grid_->any(lead_ && !found);
  const bool stale = grid_->any(lead_ && !found && fs::exists(path));
  if (grid_->any(lead_ && refuse_stale && stale))
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "{}: this run resumes from a checkpoint of {} trained against DPO reference "
                 "sums of another key ({}); the data or the initial model changed since. Restore "
                 "them, or start over with train.resume = \"none\" (the sums are then computed "
                 "anew)",
                 path.string(), (dir_ / "checkpoints").string(), why.empty() ? "see rank 0" : why);
  if (!compute) {
    if (!lead_) {
      std::fill(table.chosen.begin(), table.chosen.end(), 0.0);
      std::fill(table.rejected.begin(), table.rejected.end(), 0.0);
    }
    grid_->sum(table.chosen);
    grid_->sum(table.rejected);
    out_ << fmt::format("{}: {} pairs' sums read from {}\n", what, table.pairs(), path.string());
    return;
  }
  out_ << fmt::format("{}: {}: {}; computing {} pairs' sums with the initial weights\n", what,
                      path.string(), why, table.pairs());
  auto progress = [&](int64_t done, int64_t total) {
    if (interactive_) log_line(fmt::format("{}: batch {}/{}", what, done, total), false);
  };
  // One rank per replica gives its sums: the last stage's first tp and cp rank.
  const bool counts = grid_->coord(Axis::kTp) == 0 && grid_->coord(Axis::kCp) == 0 &&
                      grid_->coord(Axis::kPp) == grid_->size(Axis::kPp) - 1;
  compute_reference({.model = *model_,
                     .data = set,
                     .backend = *backend_,
                     .staging = input_staging_,
                     .order = order,
                     .rows = eval_rows_.get(),  // the evaluation's, idle until the first step
                     .B = B_,
                     .Tl = Tl_,
                     .dp_rank = dp_rank_,
                     .dp_size = dp_size_,
                     .cp = cp_.get(),
                     .cp_group = cp_ ? &grid_->group(Axis::kCp) : nullptr,
                     .pipe = pipe_.get(),
                     .stage_output_elems = stage_output_elems(),
                     .counts = counts,
                     .reduce = [&](std::span<double> v) { grid_->sum(v); },
                     .progress = progress},
                    table);
  zero_->drain();
  if (lead_) write_reference(path, key, table);
  if (interactive_) out_ << "\r\033[K";
  out_ << fmt::format(
      "{}: {} pairs over {} windows, a forward pass each, in {:.2f} s; kept in {}\n", what,
      table.pairs(), set.num_windows(), seconds_since(t0), path.string());
}

std::string TrainRun::dpo_reference() {
  if (!reference_table())
    SHARDLM_FAIL(ErrorKind::kConfig,
                 "dpo-reference computes the reference sums of full fine-tuning DPO: it needs "
                 "train.objective = \"dpo\" and lora.rank = 0 (got \"{}\" and {}); with LoRA the "
                 "reference is the frozen base, read during each step",
                 cfg_.train.objective, cfg_.lora.rank);
  setup();
  prepare_dpo_reference(/*refuse_stale=*/false);
  return reference_file(dir_).string();
}

}  // namespace shardlm::trainer_detail
