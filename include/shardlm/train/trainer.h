// Trainer: one training run from a RunConfig: data, model, optimizer, the step loop with
// gradient accumulation, evaluation, progress output and the run directory's reports
// (metrics.jsonl, memory_rank0.json, summary.json), then sampling.
#pragma once

#include <csignal>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <random>
#include <string>
#include <vector>

#include "shardlm/config/config.h"
#include "shardlm/io/tokenizer.h"
#include "shardlm/model/decoder.h"
#include "shardlm/model/llama.h"

namespace shardlm {

class Communicator;

struct TrainResult {
  int64_t steps = 0;        // the last step completed (counting resumed ones)
  int64_t first_step = 1;   // the first step this call ran (> 1 after a resume)
  int64_t tokens_seen = 0;  // non-ignored targets trained on, over the whole run
  double final_loss = 0;    // mean loss of the last step
  double final_eval_loss = 0;
  std::vector<double> losses;  // per step run by this call
  bool interrupted = false;    // stopped early by a signal, after writing a checkpoint
  std::string checkpoint;      // the last checkpoint written ("" if none)
};

// Runs the whole configured training, resuming from a checkpoint as train.resume says.
// Progress goes to `out`; errors are thrown. When *stop_signal becomes non-zero (set by a
// signal handler), the current step finishes, a checkpoint is written and train() returns
// with interrupted = true. With a `world` communicator of N ranks (all running train() with
// the same config), the run is data parallel: each step's sequences are split over the ranks,
// gradients are all-reduced, rank 0 alone prints and writes the run files and checkpoints, and
// every rank writes its memory_rank{R}.json. Null: a single process.
TrainResult train(const RunConfig& cfg, std::ostream& out,
                  const volatile std::sig_atomic_t* stop_signal = nullptr,
                  Communicator* world = nullptr);

// What a dry run measured on this rank.
struct DryRunResult {
  int64_t device_peak_bytes = 0;  // the ledger's device-pool peak
  int64_t host_peak_bytes = 0;    // the ledger's host-pool peak (offloaded state)
  std::string memory_report;      // the memory_rank{R}.json written
};

// Builds everything train() would allocate for `cfg` (data, model, ZeRO engine: every buffer
// through the memory ledger, under memory.budget_gib), writes memory_rank{R}.json on every
// rank, and returns without training, resuming or checkpointing. The engine allocates every
// buffer at construction and a step allocates nothing, so the peaks are the run's footprint.
// A configuration over budget throws Error(kOutOfMemory), as the real run would. `world` as
// for train().
DryRunResult dry_run(const RunConfig& cfg, std::ostream& out, Communicator* world = nullptr);

// Full fine-tuning DPO (train.objective = "dpo", lora.rank = 0): sets the run up as train()
// would, then computes the reference log-probability sums of every training pair with the
// initial weights (a forward pass each, the pairs dealt over the ranks) into
// log.dir/dpo_reference.json, keyed by the data and the initial model, or leaves a file of the
// same key as it is; train() then reads it instead of computing it at start-up. Returns the
// file's path. Error(kConfig) for any other objective. `world` as for train().
std::string dpo_reference(const RunConfig& cfg, std::ostream& out, Communicator* world = nullptr);

// Samples up to max_new_tokens after `prompt` (temperature 0 = greedy; top_k 0 = all;
// top_p 1 = all), stopping at <eos>; `on_token` receives the text of each new token as it is
// produced. Runs on a KV cache of the model's max_seq positions (train/sampler.cpp).
std::string sample_text(LlamaModel& model, const Tokenizer& tok, const std::string& prompt,
                        const SampleConfig& cfg, std::mt19937_64& rng,
                        const std::function<void(const std::string&)>& on_token = {});
// The same on a caller's decoder (its max_len is the window); the decoder is reset first.
std::string sample_text(KvDecoder& decoder, const Tokenizer& tok, const std::string& prompt,
                        const SampleConfig& cfg, std::mt19937_64& rng,
                        const std::function<void(const std::string&)>& on_token = {});
// The same from prompt token ids (a chat's generation prompt, encode_chat), stopping at <eos>
// or at `stop_id` (an end-of-turn token; -1 = none). cfg.prompt is not read.
std::string sample_tokens(KvDecoder& decoder, const Tokenizer& tok, std::vector<int32_t> prompt,
                          const SampleConfig& cfg, std::mt19937_64& rng,
                          const std::function<void(const std::string&)>& on_token = {},
                          int32_t stop_id = -1);

// The machine's GEMM rate in FLOP/s through the backend for operands of `dtype` (a run's
// activation dtype: bf16 runs on tensor cores, f32 does not): the best of three n^3 products,
// n = 512 doubled (up to 8192) while one product takes under 5 ms, so that a fast device is
// timed on a product large enough to reach its rate (a small CPU stays at 512).
double measure_gemm_flops(Backend& backend, MemoryLedger& ledger, DType dtype = DType::kF32);

}  // namespace shardlm
