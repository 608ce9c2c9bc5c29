// TrainRun's asynchronous checkpoints (checkpoint.async): at a save step every rank copies its
// share of each state vector into the snapshot buffer (held for the run, planned; the vectors
// past checkpoint.async_snapshot_gib are written at the step instead), a background
// thread writes and fsyncs the rank's files from it while training continues, and the commit
// (manifest, rename, `latest`) happens at a later step boundary, once one collective agrees that
// every rank's files are durable. The background thread does file I/O only: every collective
// stays on the training thread. The files and the commit are the synchronous save's
// (train_checkpoint_shards.cpp, checkpoint.cpp), so a crash at any moment leaves `latest` on the
// last committed checkpoint and the next writer removes the temporary directory.
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

#include "shardlm/plan/zero_layout.h"
#include "train_run.h"

namespace shardlm::trainer_detail {
namespace {

// The background thread's work: the lead's JSON files, then this rank's share of every vector
// replayed from the snapshot, each file fsynced. Errors go to save.failure (commit passes them
// on to every rank); `written` is set last, with release order, whatever happened.
void write_from_snapshot(AsyncSave& save, const StateShardSpec& spec,
                         const std::vector<SnapshotVector>& vectors, const std::byte* snapshot,
                         const std::vector<std::pair<std::string, json>>& json_files) {
  const auto t0 = std::chrono::steady_clock::now();
  // The writer takes the cores' spare cycles only: its CRCs and the kernel's page copies and
  // block allocation (in fsync) otherwise come out of the training thread's share of the CPU
  // (the process's threads share one scheduling group). On Linux the nice value of a thread id
  // is that thread's alone; failing to lower it is harmless.
  (void)::setpriority(PRIO_PROCESS, static_cast<id_t>(::syscall(SYS_gettid)), 19);
  try {
    if (!save.failure.empty()) throw std::runtime_error(save.failure);  // the synchronous part's
    for (const auto& [name, value] : json_files) save.writer->add_json(name, value);
    write_state_shards(*save.writer, spec, [&](ZeroEngine::State s, const OwnedSink& sink) {
      for (const SnapshotVector& v : vectors) {
        if (v.state != s) continue;
        for (const SnapshotStretch& st : v.stretches)
          sink(st.begin, st.count, snapshot + st.offset);
      }
    });
  } catch (const std::exception& e) {
    save.failure = e.what();
  }
  save.write_s.store(seconds_since(t0), std::memory_order_relaxed);
  save.written.store(true, std::memory_order_release);
}

}  // namespace

void TrainRun::allocate_checkpoint_snapshot() {
  if (!cfg_.checkpoint.async_snapshot()) return;
  // The rank's chunk of every bucket of the vectors that fit checkpoint.async_snapshot_gib:
  // what save_owned streams of them.
  const int64_t bytes = zero_checkpoint_snapshot_bytes(
      zero_->zero_layout(), state_elem_bytes(ZeroEngine::State::kParams), zero_->has_master(),
      cfg_.checkpoint.async_snapshot_budget_bytes());
  if (bytes > 0)
    snapshot_ =
        Buffer(*backend_, ledger_, MemCategory::kHostOffload, MemPool::kHost, size_t(bytes));
}

// The vectors past the snapshot's budget, written now by the training thread (through the
// engine's staging buffer, as a synchronous save), then the snapshot of the others: the
// thread's part. An error of the synchronous part goes to the thread, and on to commit.
std::vector<SnapshotVector> TrainRun::snapshot_state(AsyncSave& save) {
  StateShardSpec spec = state_shard_spec();
  const size_t n = size_t(zero_checkpoint_snapshot_vectors(
      zero_->zero_layout(), state_elem_bytes(ZeroEngine::State::kParams), zero_->has_master(),
      cfg_.checkpoint.async_snapshot_budget_bytes()));
  if (n < spec.vectors.size()) {
    StateShardSpec now = spec;
    now.vectors.erase(now.vectors.begin(), now.vectors.begin() + std::ptrdiff_t(n));
    try {
      write_state_shards(*save.writer, now, [&](ZeroEngine::State s, const OwnedSink& sink) {
        zero_->save_owned(s, sink);
      });
    } catch (const std::exception& e) {
      save.failure = e.what();
    }
  }
  std::vector<SnapshotVector> vectors;
  size_t at = 0;
  for (size_t i = 0; i < n; ++i) {
    const StateShardSpec::Vector& v = spec.vectors[i];
    SnapshotVector& sv = vectors.emplace_back(SnapshotVector{v.state, {}});
    zero_->save_owned(v.state, [&](int64_t begin, int64_t count, const void* data) {
      const size_t bytes = size_t(count) * v.elem_bytes;  // x [count] of the vector
      SHARDLM_CHECK(at + bytes <= snapshot_.bytes(),
                    "checkpoint snapshot: {} bytes of \"{}\" past its {} bytes (step {})", bytes,
                    v.name, snapshot_.bytes(), save.step);
      std::memcpy(snapshot_.data() + at, data, bytes);
      sv.stretches.push_back({begin, count, at});
      at += bytes;
    });
  }
  return vectors;
}

void TrainRun::start_async_checkpoint(int64_t step) {
  finish_async_checkpoint();  // one save in flight at a time: the snapshot is reused
  auto save = std::make_unique<AsyncSave>();
  save->step = step;
  save->started = Clock::now();
  save->writer = std::make_unique<CheckpointWriter>((dir_ / "checkpoints").string(), step, world_);
  save->writer->set_layout(checkpoint_layout_json());
  std::vector<std::pair<std::string, json>> json_files;
  if (lead_) {  // the progress as of this step: training moves it on before the thread writes
    json_files.emplace_back("model.json",
                            model_to_json(cfg_.model, whole_engine_layout(), model_->options(),
                                          tok_->name(), lora_base()));
    json_files.emplace_back("state.json", checkpoint_state_json(step));
  }
  StateShardSpec spec = state_shard_spec();
  std::vector<SnapshotVector> vectors = snapshot_state(*save);
  std::string written_now;  // the vectors past the budget, for the log line
  for (size_t i = vectors.size(); i < spec.vectors.size(); ++i)
    written_now += std::string(written_now.empty() ? "" : ", ") + spec.vectors[i].name;
  spec.vectors.resize(vectors.size());  // the thread's: the snapshot's vectors
  save->snapshot_s = seconds_since(save->started);
  AsyncSave& s = *save;
  const std::byte* snapshot = snapshot_.data();
  save->thread = std::thread(
      [&s, spec, vectors = std::move(vectors), snapshot, json_files = std::move(json_files)] {
        write_from_snapshot(s, spec, vectors, snapshot, json_files);
      });
  inflight_ = std::move(save);
  log_line(
      fmt::format("checkpoint: step {}: snapshot of {:.1f} MiB of state in {:.3f} s{}; writing in "
                  "the background",
                  step, double(state_vector_bytes()) / double(1 << 20), inflight_->snapshot_s,
                  written_now.empty()
                      ? ""
                      : fmt::format(" ({} written at the step: past checkpoint.async_snapshot_gib)",
                                    written_now)),
      true);
}

void TrainRun::poll_async_checkpoint() {
  if (!inflight_) return;
  // One collective a step while a save is in flight: a flag each, no waiting on the disk.
  const bool mine = inflight_->written.load(std::memory_order_acquire);
  if (grid_->any(!mine)) return;
  commit_async_checkpoint();
}

void TrainRun::finish_async_checkpoint() {
  if (!inflight_) return;
  const Clock::time_point t0 = Clock::now();
  inflight_->thread.join();
  const double waited = seconds_since(t0);
  if (waited > 1e-3)
    out_ << fmt::format("checkpoint: step {}: waited {:.3f} s for the background write\n",
                        inflight_->step, waited);
  commit_async_checkpoint();
}

void TrainRun::commit_async_checkpoint() {
  AsyncSave& save = *inflight_;
  if (save.thread.joinable()) save.thread.join();  // done writing: this is immediate
  const Clock::time_point t0 = Clock::now();
  // Whatever the outcome, the save is over: a failed commit throws past a cleared inflight_.
  std::unique_ptr<AsyncSave> done = std::move(inflight_);
  last_checkpoint_ = done->writer->commit(cfg_.checkpoint.keep_last, done->failure);
  const double mib = double(state_vector_bytes()) / double(1 << 20);
  const double total = seconds_since(done->started);
  log_line(fmt::format(
               "checkpoint: step {}: {:.1f} MiB of state by {} rank{} committed {:.3f} s after "
               "the snapshot (written in {:.3f} s, {:.0f} MiB/s; commit {:.3f} s)",
               done->step, mib, world_.size(), world_.size() > 1 ? "s" : "", total,
               done->write_s.load(), mib / std::max(done->write_s.load(), 1e-9), seconds_since(t0)),
           true);
  if (lead_) write_reports(step_);
}

}  // namespace shardlm::trainer_detail
