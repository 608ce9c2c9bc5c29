// Trainer: one training run from a RunConfig: data, model, optimizer, the step loop with
// gradient accumulation, evaluation, progress output and the run directory's reports
// (metrics.jsonl, memory_rank0.json, summary.json), then sampling.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <random>
#include <string>
#include <vector>

#include "shardlm/io/tokenizer.h"
#include "shardlm/model/decoder.h"
#include "shardlm/model/llama.h"
#include "shardlm/train/config.h"

namespace shardlm {

struct TrainResult {
  int64_t steps = 0;
  int64_t tokens_seen = 0;  // non-ignored targets trained on
  double final_loss = 0;    // mean loss of the last step
  double final_eval_loss = 0;
  std::vector<double> losses;  // per step
};

// Runs the whole configured training. Progress goes to `out`; errors are thrown.
TrainResult train(const RunConfig& cfg, std::ostream& out);

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

// The machine's f32 GEMM rate in FLOP/s through the backend (a few 1024^3 products).
double measure_gemm_flops(Backend& backend, MemoryLedger& ledger);

}  // namespace shardlm
