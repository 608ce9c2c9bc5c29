// `shardlm generate --checkpoint DIR --prompt TEXT [--chat [--system TEXT]]
// [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--context L]`:
// loads a checkpoint's model and streams the prompt and a sampled continuation to stdout
// through a KV-cache decoder. --chat: the prompt is a user message, rendered with the
// tokenizer's chat template and its generation prompt (encode_chat), and only the reply is
// printed, ending at the template's end of turn. Option checks here; loading, decoding and
// sampling live in the library.
#include <algorithm>
#include <iostream>
#include <random>

#include "commands.h"
#include "shardlm/backend/backend.h"
#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/checkpoint/model_io.h"
#include "shardlm/io/tokenize.h"
#include "shardlm/io/tokenizer.h"
#include "shardlm/model/decoder.h"
#include "shardlm/train/trainer.h"

namespace shardlm::cli {
namespace {

// Prompt tokens per prefill chunk: GEMM-shaped work with a few MiB of chunk scratch.
constexpr int64_t kPrefillChunk = 256;

struct GenerateOptions {
  std::string checkpoint;
  std::string prompt;
  bool chat = false;
  std::string system;  // --system: the chat's system message ("" = none)
  int64_t max_new_tokens = 200;
  double temperature = 0.8;
  int64_t top_k = 40;
  double top_p = 1.0;
  uint64_t seed = 0;
  int64_t context = 2048;
};

void check_options(const GenerateOptions& o) {
  if (o.max_new_tokens < 0)
    SHARDLM_FAIL(ErrorKind::kConfig, "--max-new-tokens must be >= 0, got {}", o.max_new_tokens);
  if (!(o.temperature >= 0))
    SHARDLM_FAIL(ErrorKind::kConfig, "--temperature must be >= 0 (0 = greedy), got {}",
                 o.temperature);
  if (o.top_k < 0)
    SHARDLM_FAIL(ErrorKind::kConfig, "--top-k must be >= 0 (0 = all tokens), got {}", o.top_k);
  if (!(o.top_p > 0 && o.top_p <= 1))
    SHARDLM_FAIL(ErrorKind::kConfig, "--top-p must be in (0, 1] (1 = off), got {}", o.top_p);
  if (o.context < 2)
    SHARDLM_FAIL(ErrorKind::kConfig, "--context must be >= 2 positions, got {}", o.context);
  if (!o.system.empty() && !o.chat)
    SHARDLM_FAIL(ErrorKind::kConfig, "--system is a chat's system message; add --chat");
}

int run_generate(const GenerateOptions& o) {
  check_options(o);
  // The parameters' files and the metadata verified: the optimizer's state is never read.
  const CheckpointReader ckpt(o.checkpoint, CheckpointReader::Verify::kSizesOnly);
  ckpt.verify_contents_for({"params"});
  const StoredModel stored = read_stored_model(ckpt);
  // The tokenizer the model was trained with: "byte", or the tokenizer.json it names.
  const std::unique_ptr<Tokenizer> tok_owner = load_tokenizer(stored.tokenizer);
  const Tokenizer& tok = *tok_owner;
  if (stored.config.vocab_size < tok.vocab_size())
    SHARDLM_FAIL(ErrorKind::kData,
                 "{}/model.json: vocab_size {} is smaller than the tokenizer's {} ids ({})",
                 ckpt.dir(), stored.config.vocab_size, tok.vocab_size(), tok.name());

  auto backend = make_backend(DeviceKind::kCpu);
  MemoryLedger ledger;
  // The model only holds the weights here; the decoder runs them forward.
  ModelOptions model_opt;
  model_opt.param_dtype = stored.param_dtype;
  model_opt.activation_dtype = stored.param_dtype;  // precision.activations = auto: the KV cache
  model_opt.activations = false;
  LlamaModel model(stored.config, model_opt, *backend, ledger);
  read_params(ckpt, model, *backend);
  KvDecoder decoder(model, *backend, ledger, o.context, std::min(o.context, kPrefillChunk));

  SampleConfig sample;
  sample.prompt = o.prompt;
  sample.max_new_tokens = o.max_new_tokens;
  sample.temperature = o.temperature;
  sample.top_k = o.top_k;
  sample.top_p = o.top_p;
  std::mt19937_64 rng(o.seed);
  const auto print = [](const std::string& piece) {
    std::cout << piece;
    std::cout.flush();
  };
  if (o.chat) {
    std::vector<ChatMessage> messages;
    if (!o.system.empty()) messages.push_back({"system", o.system});
    messages.push_back({"user", o.prompt});
    const DocumentTokens prompt = encode_chat(messages, tok, /*generation_prompt=*/true);
    sample_tokens(decoder, tok, prompt.tokens, sample, rng, print, chat_end_of_turn(tok));
  } else {
    print(o.prompt);
    sample_text(decoder, tok, o.prompt, sample, rng, print);
  }
  std::cout << "\n";
  return 0;
}

}  // namespace

Command add_generate_command(CLI::App& app) {
  auto opt = std::make_shared<GenerateOptions>();
  CLI::App* sub = app.add_subcommand("generate", "sample text from a trained checkpoint");
  sub->add_option("--checkpoint", opt->checkpoint,
                  "a checkpoint step directory, or a checkpoints directory (its latest)")
      ->required();
  sub->add_option("--prompt", opt->prompt, "text to continue (with --chat: the user's message)")
      ->required();
  sub->add_flag("--chat", opt->chat,
                "render the prompt with the tokenizer's chat template and print the reply");
  sub->add_option("--system", opt->system, "with --chat: a system message");
  sub->add_option("--max-new-tokens", opt->max_new_tokens, "tokens to generate at most")
      ->capture_default_str();
  sub->add_option("--temperature", opt->temperature, "softmax temperature (0 = greedy)")
      ->capture_default_str();
  sub->add_option("--top-k", opt->top_k, "sample among the k likeliest tokens (0 = all)")
      ->capture_default_str();
  sub->add_option("--top-p", opt->top_p,
                  "nucleus: the likeliest tokens holding this mass (1 = all)")
      ->capture_default_str();
  sub->add_option("--seed", opt->seed, "random seed")->capture_default_str();
  sub->add_option("--context", opt->context,
                  "KV cache length; when full, generation continues from the last half")
      ->capture_default_str();
  return {sub, [opt] { return run_generate(*opt); }};
}

}  // namespace shardlm::cli
