// The run config's key table (config_keys.h): each key with its RunConfig field and its
// documentation (docs/config.md is generated from it), the refused keys with their reasons, the
// aliases other trainers use, and the suggestions for unknown keys.
#include "config_keys.h"

#include <algorithm>
#include <iterator>
#include <limits>
#include <utility>

#include "name_distance.h"

namespace shardlm::config_keys {
namespace {

#define SHARDLM_KEY(key_path, member, ...)                                                     \
  KeySpec {                                                                                    \
    .path = key_path, .field = [](RunConfig& c) -> FieldRef { return &c.member; }, __VA_ARGS__ \
  }

// Every valid key, in the order run_config_to_json writes them, each with its documentation
// (docs/config.md is generated from it: `shardlm config --doc`). Sections and nested objects
// (model.rope_scaling) are the path prefixes of these keys.
const KeySpec kKeys[] = {
    SHARDLM_KEY("model.preset", model_preset,
                .meaning = "The model's shape, one of the presets `tiny`, `llama3.2-1b`, "
                           "`llama3.1-8b`, `llama3.1-70b`, `mistral-7b`, `qwen2.5-0.5b`, "
                           "`qwen2.5-7b`, `qwen3-0.6b`, `qwen3-8b`, `qwen3-32b`, `gemma2-2b`, "
                           "`gemma2-9b`, `gemma2-27b`, `gemma3-1b`, `gemma3-4b`, `gemma3-12b`, "
                           "`gemma3-27b`, `glm4-9b`, `glm4-9b-0414`. The other `model.*` keys "
                           "override its values; with "
                           "`model.hf_dir` it is ignored."),
    SHARDLM_KEY("model.hf_dir", model_hf_dir, .relative_to_config_dir = true,
                .default_text = "none",
                .meaning = "A Hugging Face model directory (config.json + safetensors): the "
                           "model's shape comes from its config.json (`model.preset` is ignored; "
                           "other `model.*` keys must agree with it) and a fresh run starts from "
                           "its weights.\n\n"
                           "A directory bitsandbytes saved in 4-bit NF4 (`quantization_config` "
                           "with `load_in_4bit`, `bnb_4bit_quant_type` nf4, uint8 storage, with "
                           "or without double quantization) is read too: an NF4 base "
                           "(`lora.base_dtype = nf4`) holds its codes as saved, any other base "
                           "bitsandbytes' dequantized values. Other quantization configs are "
                           "refused."),
    SHARDLM_KEY("model.dim", model.dim, .default_text = "preset",
                .meaning = "The model width (the hidden size); overrides the preset's shape."),
    SHARDLM_KEY("model.n_layers", model.n_layers, .default_text = "preset",
                .meaning = "The number of decoder layers; overrides the preset's shape."),
    SHARDLM_KEY("model.n_heads", model.n_heads, .default_text = "preset",
                .meaning = "The number of attention (query) heads; overrides the preset's "
                           "shape."),
    SHARDLM_KEY("model.n_kv_heads", model.n_kv_heads, .default_text = "preset",
                .meaning = "The number of key and value heads (grouped-query attention when "
                           "fewer than `model.n_heads`); overrides the preset's shape."),
    SHARDLM_KEY("model.ffn_dim", model.ffn_dim, .default_text = "preset",
                .meaning = "The MLP's hidden width; overrides the preset's shape."),
    SHARDLM_KEY("model.vocab_size", model.vocab_size, .default_text = "preset",
                .meaning = "The vocabulary size (the rows of the embedding table and of the LM "
                           "head); overrides the preset's shape."),
    SHARDLM_KEY("model.rope_theta", model.rope_theta, .default_text = "preset",
                .meaning = "The rotary position embedding's base (under Gemma's layer pattern, "
                           "`model.global_layer_every`, the global layers'; the local layers "
                           "use `model.rope_local_theta`)."),
    SHARDLM_KEY("model.rope_scaling.type", model.rope_scaling.type, .default_text = "preset ({})",
                .meaning = "How the rotary frequencies are rescaled: `none`, `llama3` (Llama "
                           "3's scaling: long wavelengths slowed by `factor`, short ones kept, "
                           "smooth between; see the keys below) or `linear` (every frequency / "
                           "`factor`: Gemma 3's global layers). Under Gemma's layer pattern "
                           "(`model.global_layer_every`) only the global layers are scaled."),
    SHARDLM_KEY("model.rope_scaling.factor", model.rope_scaling.factor,
                .default_text = "preset ({})",
                .meaning = "`linear`: every frequency is divided by it (> 0). `llama3`: the "
                           "frequencies of wavelengths longer than `original_max_position / "
                           "low_freq_factor` are divided by it (>= 1)."),
    SHARDLM_KEY("model.rope_scaling.low_freq_factor", model.rope_scaling.low_freq_factor,
                .default_text = "preset ({})",
                .meaning = "`llama3` only: wavelengths longer than `original_max_position / "
                           "low_freq_factor` are slowed by `factor`; between that and "
                           "`original_max_position / high_freq_factor` the frequency moves "
                           "smoothly from slowed to kept (> 0)."),
    SHARDLM_KEY("model.rope_scaling.high_freq_factor", model.rope_scaling.high_freq_factor,
                .default_text = "preset ({})",
                .meaning = "`llama3` only: wavelengths shorter than `original_max_position / "
                           "high_freq_factor` keep their frequency; must be greater than "
                           "`low_freq_factor`."),
    SHARDLM_KEY("model.rope_scaling.original_max_position",
                model.rope_scaling.original_max_position, .default_text = "preset ({})",
                .meaning = "`llama3` only: the context length the two wavelength bounds above "
                           "are fractions of (>= 1)."),
    SHARDLM_KEY("model.rope_partial_factor", model.rope_partial_factor,
                .default_text = "preset ({})",
                .meaning = "The fraction of each head's dims that rotate (transformers' "
                           "`partial_rotary_factor`; GLM: 0.5): the first `int(head_dim x "
                           "factor)` dims (an even count) turn, the rest pass through. 1 = the "
                           "whole head."),
    SHARDLM_KEY("model.rope_interleaved", model.rope_interleaved, .default_text = "preset ({})",
                .meaning = "How the rotated dims pair up: `false`, Llama's rotate_half (dim i "
                           "with i + R/2 of the R rotated dims); `true`, GLM's interleaved pairs "
                           "(dims 2i and 2i + 1)."),
    SHARDLM_KEY("model.norm_eps", model.norm_eps, .default_text = "preset",
                .meaning = "The RMSNorms' epsilon."),
    SHARDLM_KEY("model.tie_embeddings", model.tie_embeddings, .default_text = "preset",
                .meaning = "The LM head shares the embedding table's weights."),
    SHARDLM_KEY("model.attn_bias", model.attn_bias, .default_text = "preset",
                .meaning = "Biases on the q, k and v projections (Qwen2)."),
    SHARDLM_KEY("model.head_dim", model.explicit_head_dim,
                .meaning = "The width of one attention head when it is not `dim / n_heads` "
                           "(Qwen3: 128); 0 = `dim / n_heads`. q and the attention output are "
                           "`n_heads x head_dim` wide."),
    SHARDLM_KEY("model.qk_norm", model.qk_norm, .default_text = "preset ({})",
                .meaning = "Qwen3's RMSNorm over each head of q and of k before RoPE (weights "
                           "`[head_dim]`, read from config.json)."),
    SHARDLM_KEY("model.sliding_window", model.sliding_window,
                .meaning = "The window of sliding-window attention (0 = none): token `t` sees "
                           "the tokens `t - window + 1 .. t` of its document, on every layer "
                           "(Gemma: its local layers, `model.global_layer_every`).\n\n"
                           "A model that mixes sliding and full layers (Qwen's "
                           "`max_window_layers`, `layer_types`) takes its per-layer windows from "
                           "`model.hf_dir`'s config.json. Any `data.seq_len` works; a ring "
                           "(`parallel.cp_kind`) skips the blocks outside the window."),
    SHARDLM_KEY("model.global_layer_every", model.global_layer_every, .default_text = "preset ({})",
                .meaning = "Gemma's layer pattern: layer l is global (full attention, "
                           "`rope_theta`, `rope_scaling`) when l + 1 is a multiple of it, else "
                           "local (`sliding_window`, `rope_local_theta`); 0 = every layer "
                           "alike."),
    SHARDLM_KEY("model.rope_local_theta", model.rope_local_theta, .default_text = "preset ({})",
                .meaning = "The rotary base of the local layers (`model.global_layer_every`)."),
    SHARDLM_KEY("model.norm_one_plus_weight", model.norm_one_plus_weight,
                .default_text = "preset ({})",
                .meaning = "Gemma's RMSNorm weights `(1 + w)`, in f32."),
    SHARDLM_KEY("model.embed_scale", model.embed_scale, .default_text = "preset ({})",
                .meaning = "Gemma: the embedding output times sqrt(`dim`), rounded to the "
                           "activation dtype."),
    SHARDLM_KEY(
        "model.post_norms", model.post_norms, .default_text = "preset ({})",
        .meaning =
            "Gemma, GLM-4-0414: RMSNorms of the attention's and the MLP's "
            "outputs before the residual add (4 norms a layer). Under `parallel.tp` > 1 they apply "
            "to the outputs summed over the tp group (with "
            "`parallel.sequence_parallel`, the MLP's summed output rows are kept "
            "by every checkpointing mode: `[B*T/tp, dim]` a layer)."),
    SHARDLM_KEY("model.post_norm_names", model.post_norm_names, .default_text = "preset ({})",
                .meaning = "The Hugging Face names of a layer's norms under `model.post_norms`: "
                           "`gemma` (post_attention_layernorm on the attention's output, "
                           "pre_feedforward_layernorm the MLP's input, "
                           "post_feedforward_layernorm on its output) or `glm4` (GLM-4-0414: "
                           "post_self_attn_layernorm, post_attention_layernorm the MLP's input, "
                           "post_mlp_layernorm). The computation is the same."),
    SHARDLM_KEY("model.mlp_activation", model.mlp_activation, .default_text = "preset ({})",
                .meaning = "`silu` (SwiGLU) or `gelu_tanh` (Gemma's GeGLU)."),
    SHARDLM_KEY("model.query_pre_attn_scalar", model.query_pre_attn_scalar,
                .default_text = "preset ({})",
                .meaning = "Gemma: attention scores scaled by its -1/2 power; 0 = `head_dim`."),
    SHARDLM_KEY("model.attn_softcap", model.attn_softcap, .default_text = "preset ({})",
                .meaning = "Gemma 2: every scaled attention score becomes `cap * tanh(score / "
                           "cap)` before the mask and softmax (0 = none). The cuDNN attention "
                           "declines such calls (the own kernels run them)."),
    SHARDLM_KEY("model.final_softcap", model.final_softcap, .default_text = "preset ({})",
                .meaning = "Gemma 2: the LM head's logits become `cap * tanh(logit / cap)` "
                           "before the loss and sampling (0 = none)."),
    SHARDLM_KEY("data.train", data.train, .relative_to_config_dir = true,
                .default_text = "required",
                .meaning = "The training data: a token-shard directory (`shardlm tokenize`), "
                           "a `.jsonl` / `.json` file of records (`data.format`) or a text file; "
                           "files are tokenized in memory at start-up."),
    SHARDLM_KEY("data.valid", data.valid, .relative_to_config_dir = true,
                .meaning = "Held-out data for the evaluations; `\"\"` = the tail "
                           "`data.valid_fraction` of the training documents is held out "
                           "instead."),
    SHARDLM_KEY("data.valid_fraction", data.valid_fraction,
                .meaning = "The tail fraction of the training documents held out when "
                           "`data.valid` is `\"\"`; in [0, 1)."),
    SHARDLM_KEY("data.seq_len", data.seq_len,
                .meaning = "Tokens per sequence (at least 2: an input and a next token)."),
    SHARDLM_KEY("data.packing", data.packing,
                .meaning = "How documents become sequences of `data.seq_len` tokens: "
                           "`samples` places whole documents (chats, instruction records) into "
                           "sequences by best-fit decreasing, padding the rest, so that no "
                           "sample is split; `stream` cuts the token stream every "
                           "`data.seq_len` tokens, documents crossing sequences (pre-training "
                           "text); `auto` = `samples` for data with a loss mask, else "
                           "`stream`."),
    SHARDLM_KEY("data.overlong", data.overlong,
                .meaning = "Under `samples` packing, a document longer than `data.seq_len`: "
                           "`truncate` keeps its first `data.seq_len` tokens, `drop` leaves it "
                           "out, `error` stops with the document's number. Truncated and "
                           "dropped documents are counted at start and in summary.json."),
    SHARDLM_KEY("data.tokenizer", data.tokenizer,
                .meaning = "`byte`, a `tokenizer.json` or a directory holding one (byte-level "
                           "BPE); `\"\"` = `model.hf_dir`'s tokenizer.json when it has one, else "
                           "`byte`. Text inputs are tokenized with it, samples decoded with it, "
                           "and checkpoints name it."),
    SHARDLM_KEY("data.format", data.format,
                .meaning = "How the records of a `.jsonl` or `.json` data file (`data.train`, "
                           "`data.valid`, `shardlm tokenize --format`) are read: `auto` (each "
                           "record by its keys), `messages`, `alpaca`, `sharegpt`, "
                           "`prompt_completion` or `text`; see docs/data.md. Plain-text files "
                           "ignore it."),
    SHARDLM_KEY("data.columns.messages", data.columns.messages,
                .meaning = "The record key holding a chat's message list; `\"\"` = `messages` "
                           "(OpenAI messages), `conversations` else `messages` (ShareGPT)."),
    SHARDLM_KEY("data.columns.instruction", data.columns.instruction,
                .meaning = "Alpaca: the key of the instruction (LLaMA-Factory's `prompt` "
                           "column)."),
    SHARDLM_KEY("data.columns.input", data.columns.input,
                .meaning = "Alpaca: the key of the optional input, appended to the instruction "
                           "after a newline (LLaMA-Factory's `query`)."),
    SHARDLM_KEY("data.columns.output", data.columns.output,
                .meaning = "Alpaca: the key of the response trained on (LLaMA-Factory's "
                           "`response`)."),
    SHARDLM_KEY("data.columns.system", data.columns.system,
                .meaning = "Alpaca and ShareGPT: the key of the optional system prompt."),
    SHARDLM_KEY("data.columns.history", data.columns.history,
                .meaning = "Alpaca: the key of the optional earlier turns, a list of "
                           "`[instruction, response]` pairs."),
    SHARDLM_KEY("data.columns.prompt", data.columns.prompt,
                .meaning = "Prompt/completion: the key of the prompt (a string, or a list of "
                           "messages)."),
    SHARDLM_KEY("data.columns.completion", data.columns.completion,
                .meaning = "Prompt/completion: the key of the completion trained on (a string, "
                           "or a list of messages ending with the assistant's)."),
    SHARDLM_KEY("data.columns.text", data.columns.text,
                .meaning = "Text records: the key of the text."),
    SHARDLM_KEY("data.tags.role", data.tags.role,
                .meaning = "ShareGPT: the key of a turn's role tag."),
    SHARDLM_KEY("data.tags.content", data.tags.content,
                .meaning = "ShareGPT: the key of a turn's text."),
    SHARDLM_KEY("data.tags.user", data.tags.user,
                .meaning = "ShareGPT: the role tag of the user's turns."),
    SHARDLM_KEY("data.tags.assistant", data.tags.assistant,
                .meaning = "ShareGPT: the role tag of the assistant's turns (trained on)."),
    SHARDLM_KEY("data.tags.system", data.tags.system,
                .meaning = "ShareGPT: the role tag of a first turn that is the system prompt."),
    SHARDLM_KEY("data.skip_bad_records", data.skip_bad_records,
                .meaning = "A bad record in a `.jsonl` / `.json` data file (a missing or "
                           "mistyped field, an empty output, roles out of order, nothing to "
                           "train on) is skipped and counted (the count per file and the first "
                           "messages are printed at start-up) instead of stopping the run with "
                           "an error naming the file, line and field."),
    SHARDLM_KEY("train.micro_batch", train.micro_batch, .meaning = "Sequences per micro-batch."),
    SHARDLM_KEY("train.grad_accum", train.grad_accum,
                .meaning = "Micro-batches per optimizer step (gradient accumulation)."),
    SHARDLM_KEY("train.epochs", train.epochs,
                .meaning = "How long to train, in passes over the training data (0 = not "
                           "set). Set this or `train.max_steps`; when both are set, "
                           "`train.stop` says which wins."),
    SHARDLM_KEY("train.max_steps", train.max_steps,
                .meaning = "How long to train, in optimizer steps (0 = not set). Set this or "
                           "`train.epochs`; when both are set, `train.stop` says which wins."),
    SHARDLM_KEY("train.stop", train.stop,
                .meaning = "Which of `train.epochs` and `train.max_steps` wins when both are "
                           "set: `epochs` or `max_steps` (the key it names must be set). "
                           "`\"\"`: setting both is an error."),
    SHARDLM_KEY("train.resume", train.resume,
                .meaning = "`auto` continues from `log.dir`'s latest checkpoint, `none` starts "
                           "over, or a checkpoint path."),
    SHARDLM_KEY("train.resume_fallback", train.resume_fallback,
                .meaning = "With `train.resume = auto`: when the latest checkpoint is unusable "
                           "(its files do not verify), resume from an older one of `log.dir` "
                           "that does, naming each one skipped; false: an unusable checkpoint "
                           "is an error."),
    SHARDLM_KEY("train.max_bad_steps", train.max_bad_steps,
                .meaning = "Consecutive non-finite steps before the run aborts."),
    SHARDLM_KEY("train.device", train.device,
                .meaning = "`cpu`, `cuda` (one GPU per rank; `make build-cuda`) or "
                           "`cpu-queued`: the CPU's kernels run as a GPU's queue runs them (each "
                           "op when the host waits for it), bit for bit `cpu` where the engine "
                           "orders its work right; a test of that ordering, slower. Several "
                           "ranks need `parallel.device_comm = \"host\"`."),
    SHARDLM_KEY("train.attention", train.attention,
                .meaning = "The attention kernels:\n\n"
                           "- `auto`: cuDNN's fused SDPA for the calls it takes (CUDA built with "
                           "cuDNN; bf16, whole rows, packed documents as cuDNN's ragged "
                           "sequences, head dims a multiple of 8 up to 256), the own kernels "
                           "for the rest (context parallelism's blocks cut by the diagonal, "
                           "packed documents under ring context parallelism);\n"
                           "- `cudnn`: the same, but an error where the build or node has no "
                           "cuDNN;\n"
                           "- `own`: the own kernels only (the reference).\n\n"
                           "The start-up line `attention:` says which runs."),
    SHARDLM_KEY("checkpoint.every_steps", checkpoint.every_steps,
                .meaning = "Steps between periodic checkpoints; 0 = only at the end and on a "
                           "signal."),
    SHARDLM_KEY("checkpoint.keep_last", checkpoint.keep_last,
                .meaning = "How many of the latest complete checkpoints are kept; 0 = all."),
    SHARDLM_KEY("checkpoint.at_end", checkpoint.at_end,
                .meaning = "false: no checkpoint when the run completes (benchmarks, node "
                           "checks); periodic ones and a signal's are still written."),
    SHARDLM_KEY("checkpoint.async", checkpoint.async,
                .meaning = "true: periodic checkpoints are snapshotted into host memory (the "
                           "rank's share of every state vector, counted by the plan) and "
                           "written by a background thread while training continues; committed "
                           "at a later step once every rank's files are durable.\n\n"
                           "Only with `checkpoint.every_steps` (a stop's and the end's saves are "
                           "synchronous; without periodic saves no snapshot is planned or "
                           "held)."),
    SHARDLM_KEY("checkpoint.async_snapshot_gib", checkpoint.async_snapshot_gib,
                .meaning = "The most host memory the snapshot of `checkpoint.async` may take, "
                           "0 = the rank's whole share (bf16 parameters: 14 bytes an element of "
                           "it). The state vectors past it, in the order params, adam_m, "
                           "adam_v, master, are written synchronously at the save step."),
    SHARDLM_KEY("checkpoint.on_save_error", checkpoint.on_save_error,
                .meaning = "What a failed periodic save does (a disk full, an I/O error): "
                           "`stop` ends the run with the disk's error (exit 3; the last committed "
                           "checkpoint is intact and the run resumes from it), `continue` reports "
                           "it and trains on to the next save. A periodic save a rank's disk has "
                           "no room for (statvfs, against the bytes the rank writes) is skipped "
                           "with both numbers either way; the final and a stop's saves always "
                           "stop the run when they fail."),
    SHARDLM_KEY("train.objective", train.objective,
                .meaning = "What the run minimises. `sft`: the next-token cross-entropy of every "
                           "target token (pre-training text, or the completions of instruction "
                           "records). `dpo`: Direct Preference Optimization on preference records "
                           "(`prompt`, `chosen`, `rejected`): each pair's chosen and rejected "
                           "completions in one row, the reference log-probabilities from the "
                           "same forward with the LoRA adapters off, or, with full fine-tuning "
                           "(`lora.rank` = 0), the initial weights' sums computed once before "
                           "the first step and kept in `log.dir`/dpo_reference.json (`shardlm "
                           "dpo-reference` writes it ahead), the loss of `train.dpo.*`. `simpo`: "
                           "SimPO, reference-free, on the same records (`train.simpo.*`). The "
                           "preference objectives run under data parallelism at every ZeRO "
                           "stage, tensor and pipeline parallelism and every context-parallel "
                           "kind (full fine-tuning DPO's reference pass too); each step logs "
                           "TRL's rewards/chosen, rewards/rejected, rewards/margins, "
                           "rewards/accuracies, logps/chosen and logps/rejected."),
    SHARDLM_KEY("train.dpo.beta", train.dpo.beta,
                .meaning = "DPO's beta (> 0): the loss is a function of beta times the "
                           "policy's log-ratio margin over the reference; for `ipo`, the "
                           "regularisation tau of the IPO paper."),
    SHARDLM_KEY("train.dpo.loss_type", train.dpo.loss_type,
                .meaning = "`sigmoid`: -log sigmoid(beta * margin), the DPO paper's loss; with "
                           "`train.dpo.label_smoothing` = e, conservative DPO: -(1 - e) log "
                           "sigmoid(beta * margin) - e log sigmoid(-beta * margin). `ipo`: "
                           "(margin of the length-averaged log-ratios - 1 / (2 beta))^2, as TRL "
                           "computes it."),
    SHARDLM_KEY("train.dpo.label_smoothing", train.dpo.label_smoothing,
                .meaning = "cDPO's probability that a preference label is flipped, in [0, 0.5); "
                           "only with `train.dpo.loss_type` = `sigmoid`."),
    SHARDLM_KEY("train.simpo.beta", train.simpo.beta,
                .meaning = "SimPO's beta (> 0): the scale of the length-averaged "
                           "log-probabilities' margin."),
    SHARDLM_KEY("train.simpo.gamma", train.simpo.gamma,
                .meaning = "SimPO's target reward margin gamma: the loss is -log sigmoid(beta * "
                           "(mean log p(chosen) - mean log p(rejected)) - gamma)."),
    SHARDLM_KEY("train.lr", train.lr,
                .meaning = "The peak learning rate: a linear warmup to it over "
                           "`train.warmup_steps`, then a cosine decay to `train.min_lr`."),
    SHARDLM_KEY("train.min_lr", train.min_lr,
                .meaning = "The floor of the cosine decay (at most `train.lr`)."),
    SHARDLM_KEY("train.warmup_steps", train.warmup_steps,
                .meaning = "Steps of linear warmup from 0 to `train.lr`."),
    SHARDLM_KEY("train.weight_decay", train.weight_decay,
                .meaning = "AdamW's weight decay, on the matrices only (not norms or "
                           "biases)."),
    SHARDLM_KEY("train.beta1", train.beta1,
                .meaning = "AdamW's decay rate of the first moment; in [0, 1)."),
    SHARDLM_KEY("train.beta2", train.beta2,
                .meaning = "AdamW's decay rate of the second moment; in [0, 1)."),
    SHARDLM_KEY("train.eps", train.eps, .meaning = "AdamW's epsilon (> 0)."),
    SHARDLM_KEY("train.grad_clip", train.grad_clip,
                .meaning = "Gradients are clipped to this global L2 norm; 0 = no clipping."),
    SHARDLM_KEY("train.seed", train.seed,
                .meaning = "Seeds the weights' initialization and the data order."),
    SHARDLM_KEY("train.eval_every", train.eval_every,
                .meaning = "Steps between evaluations on the held-out data (0 = only at the "
                           "end); an evaluation reports loss and perplexity."),
    SHARDLM_KEY("train.eval_batches", train.eval_batches,
                .meaning = "Micro-batches per evaluation; 0 = all of the held-out data."),
    SHARDLM_KEY("precision.param", precision.param,
                .meaning = "`fp32`, or `bf16`: the working weights are stored in bf16; master "
                           "weights and moments stay fp32."),
    SHARDLM_KEY("precision.activations", precision.activations,
                .meaning = "`bf16`: activations, checkpoints (kept, offloaded, recomputed), the "
                           "residual stream, attention inputs and outputs, the "
                           "vocabulary-parallel loss chunk's logits and the activation "
                           "gradients are stored in bf16 (half the bytes); arithmetic stays f32 "
                           "inside every kernel and parameter gradients accumulate in f32.\n\n"
                           "`auto` = `precision.param`; `fp32` is the gradient-check mode."),
    SHARDLM_KEY("parallel.tp", parallel.tp,
                .meaning = "The tensor-parallel size: ranks that split each layer. The "
                           "data-parallel size is the world size divided by `parallel.tp x "
                           "parallel.pp x parallel.cp`. With LoRA, tp splits the adapters with "
                           "their base projections, on every pipeline stage too (a dense or an "
                           "NF4 base)."),
    SHARDLM_KEY("parallel.pp", parallel.pp,
                .meaning = "The pipeline-parallel size: stages the decoder layers are split "
                           "into. The data-parallel size is the world size divided by "
                           "`parallel.tp x parallel.pp x parallel.cp`."),
    SHARDLM_KEY("parallel.cp", parallel.cp,
                .meaning = "The context-parallel size: ranks that split each sequence (how: "
                           "`parallel.cp_kind`). The data-parallel size is the world size "
                           "divided by `parallel.tp x parallel.pp x parallel.cp`."),
    SHARDLM_KEY("parallel.cp_kind", parallel.cp_kind,
                .meaning = "How context parallelism splits attention: `ulysses`, `ring` or "
                           "`hybrid` (all-to-all inside groups of `parallel.cp_ulysses` ranks "
                           "and a ring across them)."),
    SHARDLM_KEY("parallel.cp_ulysses", parallel.cp_ulysses,
                .meaning = "The hybrid's all-to-all group size (0 = auto); only with "
                           "`parallel.cp_kind = \"hybrid\"`, and it must divide `parallel.cp`."),
    SHARDLM_KEY("parallel.cp_keep_gathered", parallel.cp_keep_gathered,
                .meaning = "`ulysses`, `hybrid`: the backward reuses the forward's gathered q, "
                           "k, v (kept per layer, planned) instead of all-to-all'ing them "
                           "again."),
    SHARDLM_KEY("parallel.sequence_parallel", parallel.sequence_parallel,
                .meaning = "Under `parallel.tp` > 1, split the residual stream and the norms' "
                           "activations by rows across the tp ranks (Megatron's sequence "
                           "parallelism); needs tp to divide `train.micro_batch x data.seq_len "
                           "/ parallel.cp`. Ignored at tp = 1."),
    SHARDLM_KEY("parallel.device_comm", parallel.device_comm,
                .meaning = "How device tensors cross ranks:\n\n"
                           "- `\"nccl\"`: with `train.device = cuda` NCCL, one GPU per rank; on "
                           "the CPU the host world itself;\n"
                           "- `\"host\"`: the host world (MPI under mpirun/srun, or TCP under "
                           "`shardlm launch`), with device tensors staged through a host buffer: "
                           "several ranks may share one GPU, e.g. `shardlm launch --nproc 2` on "
                           "a single GPU; on the CPU it runs the same staging;\n"
                           "- `\"mpi\"`: an alias of `\"host\"`."),
    SHARDLM_KEY("parallel.device_comm_staging_kib", parallel.device_comm_staging_kib,
                .meaning = "With `parallel.device_comm = \"host\"`: the host staging buffer "
                           "per rank, in KiB (8 slots; larger tensors go in chunks), counted in "
                           "the plan's host comm."),
    SHARDLM_KEY("zero.stage", zero.stage,
                .meaning = "The ZeRO stage, 0-3: 0 replicates the training state on every "
                           "data-parallel rank, 1 shards the optimizer state, 2 also the "
                           "gradients, 3 also the parameters. With LoRA, stage "
                           "3 on several ranks also shards the frozen base's decoder layers (a "
                           "layer gathered on use)."),
    SHARDLM_KEY("zero.offload_optimizer", zero.offload_optimizer,
                .meaning = "`none`, or `cpu`: the optimizer state lives in host memory. From "
                           "stage 2 an offloaded optimizer's f32 gradient shard is on the host "
                           "too, each bucket's reduced chunk copied there while backward goes on "
                           "(the device keeps only the rotating bucket buffers)."),
    SHARDLM_KEY("zero.offload_params", zero.offload_params,
                .meaning = "`none`, or `cpu`: the parameters live in host memory; needs "
                           "`zero.stage = 3` with `zero.offload_optimizer = \"cpu\"`."),
    SHARDLM_KEY("zero.overlap_comm", zero.overlap_comm,
                .meaning = "Communication runs on its own thread."),
    SHARDLM_KEY("zero.reduce_bucket_bytes", zero.reduce_bucket_bytes,
                .meaning = "A bucket holds at most this many bytes of f32 gradients (a bucket "
                           "is the unit of both the gradient reduction and the stage-3 "
                           "gathering)."),
    SHARDLM_KEY("zero.allgather_bucket_bytes", zero.allgather_bucket_bytes,
                .meaning = "A bucket holds at most this many bytes of parameters."),
    SHARDLM_KEY("zero.prefetch_layers", zero.prefetch_layers,
                .meaning = "Stage-3 buckets gathered ahead (0: none). With LoRA at stage 3 on "
                           "several ranks, >= 1 also gathers the sharded dense base's next "
                           "decoder layer ahead, into a second layer-sized buffer."),
    SHARDLM_KEY("zero.reduce_dtype", zero.reduce_dtype,
                .meaning = "The wire format of the gradient reductions: `fp32`, or `bf16` "
                           "(stage 2 or 3), which rounds each micro-batch's bucket gradients to "
                           "bf16 before the reduce-scatter (half the traffic, and half the host "
                           "copy when streamed) and accumulates the reduced chunks in f32. More "
                           "than one rank needs a communicator that reduces bf16."),
    SHARDLM_KEY("memory.checkpointing", memory.checkpointing,
                .meaning = "What each layer keeps for its backward:\n\n"
                           "- `none`: everything;\n"
                           "- `selective`: input, attention output and softmax statistics; the "
                           "rest is recomputed;\n"
                           "- `full`: input only; the layer is recomputed.\n\n"
                           "Gradients are bitwise the same in every mode."),
    SHARDLM_KEY("memory.offload_checkpoints", memory.offload_checkpoints,
                .meaning = "Where the kept layers' checkpoints wait (needs `selective` or "
                           "`full` checkpointing):\n\n"
                           "- `true`: all in host memory (two layers' worth of slots on the "
                           "device);\n"
                           "- a fraction in [0, 1]: that share of the kept layers, the first "
                           "ones, on the host; the rest in device slots of their own;\n"
                           "- `\"auto\"`: the fewest on the host that keep the device within "
                           "`memory.budget_gib`; all without a budget.\n\n"
                           "`plan --fit` chooses the fraction."),
    SHARDLM_KEY("memory.checkpoint_every", memory.checkpoint_every,
                .meaning = "With `full` checkpointing, keep only every k-th layer's input and "
                           "recompute the layers between from it in backward (one more forward "
                           "for k - 1 of every k layers): k times fewer checkpoints. Gradients "
                           "stay bitwise the same."),
    SHARDLM_KEY("memory.loss_chunk_tokens", memory.loss_chunk_tokens,
                .meaning = "Rows of the fused LM head + loss per chunk."),
    SHARDLM_KEY("memory.mlp_chunk_tokens", memory.mlp_chunk_tokens,
                .meaning = "Rows of the MLP per chunk (forward and backward), bounding its "
                           "transients to `[chunk, ffn_dim]`."),
    SHARDLM_KEY("memory.budget_gib", memory.budget_gib,
                .meaning = "A cap on the device pool per rank (0 = none): a run whose plan "
                           "exceeds it does not start (exit 4 with the planned breakdown and "
                           "what to change); the ledger enforces it on every allocation too."),
    SHARDLM_KEY("log.dir", log.dir, .relative_to_config_dir = true,
                .meaning = "The run directory."),
    SHARDLM_KEY("log.every_steps", log.every_steps,
                .meaning = "Steps between the lines of `metrics.jsonl` and of the progress "
                           "output."),
    SHARDLM_KEY("log.profile", log.profile,
                .meaning = "Adds the time per op family (to `summary.json`)."),
    SHARDLM_KEY("log.tensorboard", log.tensorboard,
                .meaning = "TensorBoard event files (rank 0): every scalar of `metrics.jsonl` "
                           "at its step (tags as its keys, nested ones `key/sub`), the plan's "
                           "bytes per pool and category (`plan/device/params`, ...) and the "
                           "resolved config as text at the run's first step. A resumed run first "
                           "drops the events past its checkpoint's step, so no step is logged "
                           "twice. `wandb sync --sync-tensorboard DIR` uploads them to Weights & "
                           "Biases."),
    SHARDLM_KEY("log.tensorboard_dir", log.tensorboard_dir,
                .meaning = "Where the event files go; `\"\"` = `log.dir`/tb. DeepSpeed's "
                           "`tensorboard.output_path`/`job_name` map here."),
    SHARDLM_KEY("sample.prompt", sample.prompt,
                .meaning = "The prompt of the text sampled after training (`\"\"`: no sample). "
                           "The sample runs on rank 0 from the final checkpoint read through its "
                           "manifest (LoRA: its base merged with the adapters layer by layer), "
                           "after every rank has freed its training buffers. It is planned "
                           "apart (`shardlm plan` shows it; over `memory.budget_gib` the run "
                           "stops at start-up) and measured (`memory_rank0.json`, `\"sample\"`). "
                           "Needs `checkpoint.at_end = true`."),
    SHARDLM_KEY("sample.max_new_tokens", sample.max_new_tokens,
                .meaning = "Tokens generated per sample (0: no sample)."),
    SHARDLM_KEY("sample.temperature", sample.temperature,
                .meaning = "The sampling temperature; 0 = greedy."),
    SHARDLM_KEY("sample.top_k", sample.top_k,
                .meaning = "Sample among the k most likely tokens; 0 = all tokens."),
    SHARDLM_KEY("sample.top_p", sample.top_p,
                .meaning = "Nucleus sampling: the probability mass kept, in (0, 1]; 1 = all."),
    SHARDLM_KEY("sample.count", sample.count, .meaning = "How many samples are drawn (0: none)."),
    SHARDLM_KEY("lora.rank", lora.rank,
                .meaning = "LoRA fine-tuning: adapters of rank r on the projections of "
                           "`lora.targets`, the base frozen; 0 = off (full training)."),
    SHARDLM_KEY("lora.alpha", lora.alpha,
                .meaning = "The adapters' update is scaled by alpha / r (`lora.rank`)."),
    SHARDLM_KEY("lora.dropout", lora.dropout,
                .meaning = "Dropout on the adapters' input, in training; in [0, 1)."),
    SHARDLM_KEY("lora.targets", lora.targets,
                .meaning = "The projections with adapters: a comma-separated list of "
                           "`q,k,v,o,gate,up,down`, PEFT's names (`q_proj`...), or `all`."),
    SHARDLM_KEY("lora.offload_base", lora.offload_base,
                .meaning = "Keep the frozen base in host memory, two layer-sized device slots "
                           "holding the unit in use (a decoder layer, or a piece of rows of the "
                           "embedding or LM head) and the next one, fetched while the current "
                           "one computes. Under `parallel.tp` > 1 the slots hold the largest "
                           "unit (the vocabulary slice whole).\n\n"
                           "At `zero.stage = 3` on several ranks a rank keeps only its chunk of "
                           "each decoder layer on the host, staged and then gathered into a "
                           "device buffer of a layer."),
    SHARDLM_KEY("lora.base_dtype", lora.base_dtype,
                .meaning = "The frozen base's storage: `auto` or `bf16`/`fp32` "
                           "(`precision.param`'s dtype, which they must name), or `nf4` "
                           "(QLoRA): every decoder projection (q, k, v, o, gate, up, down) "
                           "quantized at load to bitsandbytes' NF4 (blocks of 64, absmax per "
                           "block) and dequantized one decoder layer at a time into a workspace "
                           "of `precision.param`'s dtype, forward and backward; norms, biases, "
                           "embeddings and the LM head stay in `precision.param`.\n\n"
                           "With `lora.offload_base` the codes, absmax and dense parts stay in "
                           "host memory and each decoder layer is staged in 4 bits (its absmax, "
                           "norms and codes) through two device slots of the largest staged "
                           "layer, the tables in pieces of rows no larger.\n\n"
                           "Under `zero.stage = 3` on more than one rank the codes and absmax "
                           "are sharded over the ZeRO ranks (on the device, or with "
                           "`lora.offload_base` in host memory, a rank's chunk staged with the "
                           "layer's norms), each layer all-gathered on the device before it is "
                           "dequantized; the dense parts stay whole. Under `parallel.tp` each "
                           "rank quantizes its shard of each projection (refused, naming the "
                           "projection, when a shard would not hold whole blocks of 64); under "
                           "`parallel.pp` each stage holds its layers' NF4 codes, ZeRO-3 chunks "
                           "and workspace only."),
};

#undef SHARDLM_KEY

// Keys the architecture names but this version cannot honour: an error that says so, rather
// than "unknown key" with a misleading suggestion.
const PlannedKey kPlannedKeys[] = {
    {"lora.bias", "LoRA adapters train no biases (PEFT's bias = \"none\")"},
};

// Keys other tools have that are not keys here, with the reason (instead of a suggestion
// that would be wrong: parallel.dp is one letter from parallel.tp).
const PlannedKey kNotKeys[] = {
    {"parallel.dp",
     "the data-parallel size is derived: world size / (parallel.tp x parallel.cp x parallel.pp)"},
};

// Names other trainers (Hugging Face, nanoGPT) use for our keys' last component.
const std::pair<std::string_view, std::string_view> kLeafAliases[] = {
    {"batch_size", "micro_batch"},
    {"micro_batch_size", "micro_batch"},
    {"gradient_accumulation_steps", "grad_accum"},
    {"hidden_size", "dim"},
    {"intermediate_size", "ffn_dim"},
    {"num_attention_heads", "n_heads"},
    {"num_key_value_heads", "n_kv_heads"},
    {"num_hidden_layers", "n_layers"},
    {"max_seq_len", "seq_len"},
    {"seq_length", "seq_len"},
    {"block_size", "seq_len"},
    {"rms_norm_eps", "norm_eps"},
    {"tie_word_embeddings", "tie_embeddings"},
    {"num_epochs", "epochs"},
};

}  // namespace

std::span<const KeySpec> all_keys() { return kKeys; }
std::span<const PlannedKey> planned_keys() { return kPlannedKeys; }
std::span<const PlannedKey> not_keys() { return kNotKeys; }

const KeySpec* find_key(std::string_view path) {
  for (const auto& k : kKeys)
    if (k.path == path) return &k;
  return nullptr;
}

// "a.b.c" -> "a/b/c" (a JSON pointer without its leading slash).
std::string dotted_to_pointer(std::string_view path) {
  std::string p(path);
  std::replace(p.begin(), p.end(), '.', '/');
  return p;
}

// Whether `path` lies inside `group` ("train.lr" is under "train", "trainer.x" is not).
bool is_under(std::string_view path, std::string_view group) {
  return path.size() > group.size() && path.starts_with(group) && path[group.size()] == '.';
}

// A section or nested object: a proper prefix of some key.
bool is_group(std::string_view path) {
  return std::any_of(std::begin(kKeys), std::end(kKeys),
                     [&](const KeySpec& k) { return is_under(k.path, path); });
}

std::string_view parent_of(std::string_view path) {
  const size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? std::string_view{} : path.substr(0, dot);
}

std::string_view leaf_of(std::string_view path) {
  const size_t dot = path.rfind('.');
  return dot == std::string_view::npos ? path : path.substr(dot + 1);
}

// Valid groups and keys one level below `parent` ("" = the sections), in table order.
std::vector<std::string> children_of(std::string_view parent) {
  std::vector<std::string> out;
  for (const auto& k : kKeys) {
    std::string_view rest = k.path;
    if (!parent.empty()) {
      if (!is_under(rest, parent)) continue;
      rest.remove_prefix(parent.size() + 1);
    }
    std::string child(rest.substr(0, rest.find('.')));
    if (std::find(out.begin(), out.end(), child) == out.end()) out.push_back(child);
  }
  return out;
}

std::string join(const std::vector<std::string>& items, std::string_view sep) {
  std::string out;
  for (const auto& s : items) out += (out.empty() ? "" : std::string(sep)) + s;
  return out;
}

// The valid key or section nearest to an unknown one, or "" when none is reasonably close.
std::string suggest(std::string_view unknown) {
  const std::string_view parent = parent_of(unknown), leaf = leaf_of(unknown);
  if (leaf.size() > 64) return "";  // nothing is close, and the distance table would be large
  std::vector<std::string> candidates;
  if (parent.empty()) {
    candidates = children_of("");
  } else {
    for (const auto& k : kKeys) {
      candidates.emplace_back(k.path);
      if (std::string_view group = parent_of(k.path); group.find('.') != std::string_view::npos)
        candidates.emplace_back(group);  // nested objects such as model.rope_scaling
    }
  }
  const size_t threshold = std::max<size_t>(1, leaf.size() / 3);
  std::string best;
  size_t best_score = std::numeric_limits<size_t>::max();
  for (const auto& cand : candidates) {
    const std::string_view cand_leaf = leaf_of(cand);
    size_t score = edit_distance(leaf, cand_leaf);
    for (const auto& [alias, target] : kLeafAliases)
      if (leaf == alias && cand_leaf == target) score = 0;
    if (score > 1 && abbreviates(leaf, cand_leaf)) score = 1;
    if (parent_of(cand) != parent) score += 1;  // same leaf in another section: close, not equal
    if (score <= threshold && score < best_score) {
      best = cand;
      best_score = score;
    }
  }
  return best;
}

}  // namespace shardlm::config_keys
