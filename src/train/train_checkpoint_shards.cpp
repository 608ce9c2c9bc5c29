// TrainRun's sharded checkpoints: every rank writes its own share of each state vector
// (parameters, Adam m and v, f32 master; with LoRA the adapters) as element ranges of the whole
// model's flat vectors, so the files do not depend on the grid; the commit is one collective.
// Resuming picks the checkpoint on every rank together (the contents verified with the files
// split over the ranks) and each rank preads only the ranges it holds, on any grid.
#include <algorithm>
#include <cstring>

#include "shardlm/planner/plan_inputs.h"
#include "state_shards.h"
#include "train_run.h"

namespace shardlm::trainer_detail {
namespace {

struct StateVector {
  ZeroEngine::State state;
  const char* name;
};
constexpr StateVector kStateVectors[] = {{ZeroEngine::State::kParams, "params"},
                                         {ZeroEngine::State::kAdamM, "adam_m"},
                                         {ZeroEngine::State::kAdamV, "adam_v"},
                                         {ZeroEngine::State::kMaster, "master"}};

// Each piece's overlap with the stretch [begin, begin + count) of the shard arena (pieces sorted
// by shard offset, disjoint): fn(offset in the whole vector, elements, offset in the stretch).
template <typename Fn>
void for_each_piece_overlap(const std::vector<ShardPiece>& pieces, int64_t begin, int64_t count,
                            Fn&& fn) {
  const int64_t end = begin + count;
  auto it = std::upper_bound(pieces.begin(), pieces.end(), begin,
                             [](int64_t x, const ShardPiece& p) { return x < p.shard; });
  if (it != pieces.begin()) --it;
  for (; it != pieces.end() && it->shard < end; ++it) {
    const int64_t lo = std::max(begin, it->shard), hi = std::min(end, it->shard + it->count);
    if (lo < hi) fn(it->full + (lo - it->shard), hi - lo, lo - begin);
  }
}

// [b, e) less the sorted, disjoint intervals `taken`, as (begin, end) runs.
std::vector<std::pair<int64_t, int64_t>> subtract(
    int64_t b, int64_t e, const std::vector<std::pair<int64_t, int64_t>>& taken) {
  std::vector<std::pair<int64_t, int64_t>> out;
  auto it = std::upper_bound(taken.begin(), taken.end(), std::make_pair(b, INT64_MAX));
  if (it != taken.begin() && std::prev(it)->second > b) b = std::prev(it)->second;
  for (; b < e && it != taken.end() && it->first < e; ++it) {
    if (it->first > b) out.emplace_back(b, it->first);
    b = std::max(b, it->second);
  }
  if (b < e) out.emplace_back(b, e);
  return out;
}

}  // namespace

std::vector<ShardPiece> TrainRun::coordinate_pieces(int64_t stage, int64_t tp_rank) const {
  const ModelConfig sc = stage_model_for(cfg_, stage);
  if (!lora_.enabled())
    return stage_shard_pieces(cfg_.model, sc.pp_begin, sc.stage_end(), tp_, tp_rank);
  // LoRA: the stage's adapters, each split with its base projection by tp rank.
  return lora_stage_shard_pieces(cfg_.model, lora_, sc.pp_begin, sc.stage_end(), tp_, tp_rank);
}

std::vector<ShardPiece> TrainRun::checkpoint_pieces() const {
  // With the engine's arena in the whole vector's order, the ZeRO group of coordinate
  // (pp, tp) = (0, 0) holds all of it (the only one there is at tp = pp = 1).
  if (state_in_whole_order()) {
    if (pp_rank_ != 0 || tp_rank_ != 0) return {};
    return {ShardPiece{0, 0, engine_layout().total}};
  }
  // Tensors several (pp, tp) coordinates hold alike (norms and an adapter's unsplit half on
  // every tp rank, tied embeddings on the first and last stage) are written by the first one.
  std::vector<std::pair<int64_t, int64_t>> taken;
  for (int64_t st = 0; st <= pp_rank_; ++st)
    for (int64_t r = 0; r < (st == pp_rank_ ? tp_rank_ : tp_); ++r)
      for (const ShardPiece& p : coordinate_pieces(st, r))
        taken.emplace_back(p.full, p.full + p.count);
  std::sort(taken.begin(), taken.end());
  std::vector<std::pair<int64_t, int64_t>> merged;
  for (const auto& t : taken) {
    if (!merged.empty() && t.first <= merged.back().second)
      merged.back().second = std::max(merged.back().second, t.second);
    else
      merged.push_back(t);
  }
  std::vector<ShardPiece> out;
  for (const ShardPiece& p : engine_pieces())
    for (const auto& [b, e] : subtract(p.full, p.full + p.count, merged))
      out.push_back(ShardPiece{b, p.shard + (b - p.full), e - b});
  return out;
}

void write_state_shards(CheckpointWriter& w, const StateShardSpec& spec, const OwnedSource& owned) {
  for (const StateShardSpec::Vector& v : spec.vectors) {
    const size_t eb = v.elem_bytes;
    w.declare_vector(v.name, eb, spec.total);
    w.begin_vector_file(fmt::format("{}-{:05d}-of-{:05d}.bin", v.name, spec.rank, spec.world),
                        v.name);
    owned(v.state, [&](int64_t begin, int64_t count, const void* data) {
      // x [count] of the arena from `begin`: the parts this rank writes, at their whole offsets
      for_each_piece_overlap(spec.pieces, begin, count, [&](int64_t full, int64_t n, int64_t at) {
        w.append_elements(full, static_cast<const std::byte*>(data) + size_t(at) * eb, n);
      });
    });
    w.end_file();
  }
}

StateShardSpec TrainRun::state_shard_spec() const {
  StateShardSpec spec;
  for (const StateVector& sv : kStateVectors)
    if (sv.state != ZeroEngine::State::kMaster || zero_->has_master())
      spec.vectors.push_back({sv.state, sv.name, state_elem_bytes(sv.state)});
  spec.total = whole_engine_layout().total;
  spec.pieces = checkpoint_pieces();  // by arena (shard) offset
  spec.rank = world_.rank();
  spec.world = world_.size();
  return spec;
}

json TrainRun::checkpoint_layout_json() const {
  return {{"order", "whole model arena (model.json's parameter table)"},
          {"world", world_.size()},
          {"grid", {{"dp", dp_size_}, {"cp", cfg_.parallel.cp}, {"tp", tp_}, {"pp", pp_}}},
          {"zero_stage", cfg_.zero.stage}};
}

void TrainRun::save_checkpoint(int64_t step) {
  // Every rank writes its share and fsyncs it; commit is the one collective that agrees all
  // succeeded before rank 0 writes the manifest and moves `latest`. A rank's failure travels
  // through commit, so that no rank is left waiting in it.
  finish_async_checkpoint();  // the save in flight is committed first: `latest` moves in order
  const Clock::time_point t0 = Clock::now();
  if (interactive_)  // the line the result replaces
    log_line(fmt::format("checkpoint: step {}: writing {:.1f} MiB of state ...", step,
                         double(state_vector_bytes()) / double(1 << 20)),
             false);
  CheckpointWriter w((dir_ / "checkpoints").string(), step, world_);
  std::string failure;
  try {
    if (lead_) {
      w.add_json("model.json", model_to_json(cfg_.model, whole_engine_layout(), model_->options(),
                                             tok_->name(), lora_base()));
      w.add_json("state.json", checkpoint_state_json(step));
    }
    w.set_layout(checkpoint_layout_json());
    write_state_shards(w, state_shard_spec(), [&](ZeroEngine::State s, const OwnedSink& sink) {
      zero_->save_owned(s, sink);
    });
  } catch (const std::exception& e) {
    failure = e.what();
  }
  last_checkpoint_ = w.commit(cfg_.checkpoint.keep_last, failure);
  const double seconds = seconds_since(t0);
  const double mib = double(state_vector_bytes()) / double(1 << 20);
  log_line(fmt::format("checkpoint: step {}: {:.1f} MiB of state by {} rank{} in {:.3f} s ({:.0f} "
                       "MiB/s)",
                       step, mib, world_.size(), world_.size() > 1 ? "s" : "", seconds,
                       mib / std::max(seconds, 1e-9)),
           true);
  if (lead_) write_reports(step);
  world_.barrier();
}

int64_t TrainRun::state_vector_bytes() const {
  const int64_t total = whole_engine_layout().total;
  const int64_t pb = int64_t(state_elem_bytes(ZeroEngine::State::kParams));
  return total * (pb + 4 * (zero_->has_master() ? 3 : 2));
}

json TrainRun::checkpoint_state_json(int64_t step) const {
  return {{"step", step},
          {"optimizer_steps", zero_->steps_taken()},
          {"zero", {{"stage", cfg_.zero.stage}, {"ranks", grid_->zero().size()}}},
          {"parallel", {{"tp", tp_}, {"pp", pp_}, {"cp", cfg_.parallel.cp}, {"dp", dp_size_}}},
          {"seed", cfg_.train.seed},
          {"tokens_seen", tokens_seen_},
          {"tokens_per_epoch", tokens_per_epoch_},
          {"data",
           {{"tokens", train_set_->num_tokens()},
            {"seq_len", T_},
            {"packing", packing_name(train_set_->packing().packing)},
            {"windows", train_set_->num_windows()},
            {"rows_per_step", B_ * accum_ * dp_size_},
            {"position",
             {{"epoch", step / steps_per_epoch_}, {"step_in_epoch", step % steps_per_epoch_}}}}},
          {"loss_points", loss_points_},
          {"eval_points", eval_points_},
          {"config", run_config_to_json(cfg_)}};
}

// The state vectors into this rank's shards: sharded vectors ("params", "adam_m", ...) or the
// single files of older checkpoints (params.bin; optimizer.bin holding m, v and the master).
void TrainRun::load_resumed_state(const CheckpointReader& ckpt) {
  const int64_t total = whole_engine_layout().total;
  const bool sharded = ckpt.has_vector("adam_m");
  for (const StateVector& sv : kStateVectors) {
    const bool wanted = sv.state != ZeroEngine::State::kMaster || zero_->has_master();
    const size_t eb = state_elem_bytes(sv.state);
    if (sharded || sv.state == ZeroEngine::State::kParams) {
      if (wanted && ckpt.vector_bytes(sv.name) != size_t(total) * eb)
        SHARDLM_FAIL(ErrorKind::kData,
                     "{}: vector \"{}\" holds {} bytes but this model's needs {} bytes", ckpt.dir(),
                     sv.name, ckpt.vector_bytes(sv.name), size_t(total) * eb);
      if (sharded && wanted != ckpt.has_vector(sv.name))
        SHARDLM_FAIL(ErrorKind::kData, "{}: {} the f32 master weights this run {}", ckpt.dir(),
                     wanted ? "lacks" : "holds", wanted ? "needs" : "does not keep");
      if (!wanted) continue;
      load_state(sv.state, [&](int64_t begin, int64_t count, void* dst) {
        ckpt.read_vector(sv.name, uint64_t(begin) * eb, dst, size_t(count) * eb);
      });
      continue;
    }
    // optimizer.bin: m, v (and the f32 master weights with bf16 parameters), each [total].
    const int n_states = zero_->has_master() ? 3 : 2;
    if (ckpt.size("optimizer.bin") != size_t(total) * 4 * n_states)
      SHARDLM_FAIL(ErrorKind::kData, "{}/optimizer.bin: holds {} bytes, this run needs {}",
                   ckpt.dir(), ckpt.size("optimizer.bin"), size_t(total) * 4 * n_states);
    if (!wanted) continue;
    const uint64_t i = uint64_t(&sv - &kStateVectors[1]);  // 0 m, 1 v, 2 master
    load_state(sv.state, [&](int64_t begin, int64_t count, void* dst) {
      ckpt.read_range("optimizer.bin", (i * uint64_t(total) + uint64_t(begin)) * 4, dst,
                      size_t(count) * 4);
    });
  }
}

void TrainRun::load_state(
    ZeroEngine::State s,
    const std::function<void(int64_t begin, int64_t count, void* dst)>& source) {
  if (state_in_whole_order()) return zero_->load(s, source);
  // The engine asks for stretches of its (stage, tp shard) arena, or its stage's adapters; each
  // is read piece by piece from the whole vector: only the elements this rank holds.
  const std::vector<ShardPiece>& pieces = engine_pieces();
  const size_t eb = state_elem_bytes(s);
  zero_->load(s, [&](int64_t begin, int64_t count, void* dst) {
    for_each_piece_overlap(pieces, begin, count, [&](int64_t full, int64_t n, int64_t at) {
      source(full, n, static_cast<std::byte*>(dst) + size_t(at) * eb);
    });
  });
}

// The checkpoint to resume from as train.resume says ("" for none), on every rank: rank 0
// lists the candidates (with train.resume_fallback the older ones after the latest), and every
// rank verifies its part of each candidate's files until one verifies on all of them.
std::string TrainRun::choose_checkpoint(const std::string& ckdir) {
  const std::string& mode = cfg_.train.resume;
  if (mode == "none") return "";
  const bool fallback = cfg_.train.resume_fallback && mode == "auto";
  std::string listing;  // candidates, one a line; or "!" and the error
  if (lead_) {
    bool latest_broken = false;
    try {
      const std::string target = mode == "auto" ? latest_checkpoint(ckdir) : mode;
      if (!target.empty()) listing = target + "\n";
    } catch (const Error& e) {
      if (!fallback || e.kind() != ErrorKind::kData) listing = std::string("!") + e.what();
      latest_broken = listing.empty();
      if (latest_broken)
        out_ << fmt::format(
            "resume: the latest checkpoint is unusable ({}); falling back "
            "(train.resume_fallback)\n",
            e.what());
    }
    if (fallback && (latest_broken || !listing.empty()))
      for (const std::string& older : list_checkpoints(ckdir)) listing += older + "\n";
  }
  if (world_.size() > 1) listing = broadcast_text(world_, listing, 0);
  if (!listing.empty() && listing[0] == '!')
    SHARDLM_FAIL(ErrorKind::kData, "{}", listing.substr(1));
  std::vector<std::string> seen;
  for (size_t at = 0; at < listing.size();) {
    const size_t nl = listing.find('\n', at);
    const std::string candidate = listing.substr(at, nl - at);
    at = nl + 1;
    if (std::find(seen.begin(), seen.end(), candidate) != seen.end()) continue;
    seen.push_back(candidate);
    std::string dir, error;
    try {
      const CheckpointReader r(candidate, CheckpointReader::Verify::kSizesOnly);
      r.verify_contents(world_.rank(), world_.size());
      dir = r.dir();
    } catch (const Error& e) {
      error = e.what();
    }
    int64_t first_bad = error.empty() ? world_.size() : world_.rank();
    world_.all_reduce(Tensor(&first_bad, DType::kI64, {1}, MemPool::kHost), ReduceOp::kMin);
    if (first_bad == world_.size()) return dir;
    if (world_.size() > 1) error = broadcast_text(world_, error, int(first_bad));
    if (!fallback) SHARDLM_FAIL(ErrorKind::kData, "{}", error);
    out_ << fmt::format("resume: {} is unusable ({}); falling back (train.resume_fallback)\n",
                        candidate, error);
  }
  if (seen.empty()) return "";
  SHARDLM_FAIL(ErrorKind::kData, "{}: no complete checkpoint verifies", ckdir);
}

}  // namespace shardlm::trainer_detail
