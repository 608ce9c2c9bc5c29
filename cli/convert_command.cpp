// `shardlm convert hf-import DIR --output CKPT [--dtype bf16|fp32]`,
// `shardlm convert hf-export CKPT --output DIR [--dtype bf16|fp32] [--architecture A]
// [--max-shard-size GB]` and `shardlm convert gguf-export CKPT --output FILE
// [--type f16|bf16|q8_0] [--architecture A]`: Hugging Face directories to shardlm checkpoints
// and back, and checkpoints to llama.cpp's GGUF, streamed (hf/hf.h, checkpoint/hf_convert.h,
// checkpoint/gguf_export.h). Option checks here; the work is in the library.
#include <iostream>

#include "commands.h"
#include "shardlm/checkpoint/checkpoint.h"
#include "shardlm/checkpoint/gguf_export.h"
#include "shardlm/checkpoint/hf_convert.h"
#include "shardlm/checkpoint/model_io.h"
#include "shardlm/hf/hf.h"

namespace shardlm::cli {
namespace {

DType parse_dtype(const std::string& s, const std::string& fallback) {
  const std::string v = s.empty() ? fallback : s;
  if (v == "bf16" || v == "bfloat16") return DType::kBF16;
  if (v == "fp32" || v == "float32") return DType::kF32;
  SHARDLM_FAIL(ErrorKind::kConfig, "--dtype must be bf16 or fp32, got '{}'", v);
}

GgufType parse_gguf_type(const std::string& s) {
  if (s == "f16") return GgufType::kF16;
  if (s == "bf16") return GgufType::kBF16;
  if (s == "q8_0") return GgufType::kQ8_0;
  SHARDLM_FAIL(ErrorKind::kConfig, "--type must be f16, bf16 or q8_0, got '{}'", s);
}

// `convert gguf-export`'s options and action.
CLI::App* add_gguf_export(CLI::App* sub, std::function<int()>& action) {
  struct Options {
    std::string input, output, type = "f16", architecture;
  };
  auto o = std::make_shared<Options>();
  CLI::App* g = sub->add_subcommand("gguf-export",
                                    "a checkpoint -> one GGUF file that llama.cpp and Ollama run");
  g->add_option("checkpoint", o->input,
                "a step directory or a checkpoints directory (a LoRA "
                "checkpoint is written merged into its base)")
      ->required();
  g->add_option("--output", o->output, "the .gguf file to write")->required();
  g->add_option("--type", o->type,
                "the matrices' type: f16, bf16 or q8_0 (norms and biases stay f32)")
      ->capture_default_str();
  g->add_option("--architecture", o->architecture,
                "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, "
                "Gemma2ForCausalLM or Gemma3ForCausalLM (default: as hf-export)");
  action = [o] {
    const GgufExportInfo info =
        gguf_export(o->input, o->output, parse_gguf_type(o->type), o->architecture);
    std::cout << "exported " << o->input << " as GGUF " << info.architecture << " (" << info.tensors
              << " tensors, " << o->type << ", " << info.bytes << " bytes of weights) to "
              << o->output << "\n";
    return 0;
  };
  return g;
}

}  // namespace

Command add_convert_command(CLI::App& app) {
  struct Options {
    std::string input, output, dtype, architecture;
    double max_shard_gb = 5;
    bool merge = false;
  };
  auto imp = std::make_shared<Options>();
  auto exp = std::make_shared<Options>();
  CLI::App* sub = app.add_subcommand("convert",
                                     "convert between Hugging Face directories and "
                                     "shardlm checkpoints, and checkpoints to GGUF");
  sub->require_subcommand(1);
  CLI::App* i = sub->add_subcommand(
      "hf-import", "a Hugging Face model directory (config.json + safetensors) -> a checkpoint");
  i->add_option("dir", imp->input, "the Hugging Face directory")->required();
  i->add_option("--output", imp->output, "checkpoints directory to write (step 0)")->required();
  i->add_option("--dtype", imp->dtype,
                "parameter dtype of the checkpoint: bf16 or fp32 (default: bf16 when the model's "
                "torch_dtype is bfloat16 or float16, else fp32)");
  CLI::App* e = sub->add_subcommand(
      "hf-export", "a checkpoint -> a Hugging Face directory that transformers loads");
  e->add_option("checkpoint", exp->input, "a step directory or a checkpoints directory")
      ->required();
  e->add_option("--output", exp->output, "the directory to write")->required();
  e->add_option("--dtype", exp->dtype, "bf16 or fp32 (default: the checkpoint's)");
  e->add_option("--architecture", exp->architecture,
                "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM "
                "(default: the imported model's, else Qwen3 with q/k norms, Qwen2 with q/k/v "
                "biases, Llama otherwise)");
  e->add_flag("--merge", exp->merge,
              "a LoRA checkpoint: write the merged model (W + alpha/r B A) instead of the "
              "PEFT adapter");
  e->add_option("--max-shard-size", exp->max_shard_gb,
                "GB per safetensors file before a new shard starts (default 5)")
      ->check(CLI::PositiveNumber);
  std::function<int()> gguf_action;
  CLI::App* g = add_gguf_export(sub, gguf_action);
  return {sub, [sub, i, g, gguf_action, imp, exp] {
            if (sub->got_subcommand(g)) return gguf_action();
            if (sub->got_subcommand(i)) {
              const HfModelInfo info = read_hf_config(imp->input);
              const bool half = info.torch_dtype == "bfloat16" || info.torch_dtype == "float16";
              const std::string dir = hf_import(imp->input, imp->output,
                                                parse_dtype(imp->dtype, half ? "bf16" : "fp32"));
              std::cout << "imported " << imp->input << " (" << info.architecture << ") into "
                        << dir << "\n";
              return 0;
            }
            // Its metadata only: hf_export verifies what it reads.
            const CheckpointReader ckpt(exp->input, CheckpointReader::Verify::kSizesOnly);
            const StoredModel stored = read_stored_model(ckpt);
            // A LoRA adapter keeps its f32 unless asked; the merged model takes the base's dtype.
            const bool adapter = stored.lora.enabled() && !exp->merge;
            hf_export(exp->input, exp->output,
                      parse_dtype(exp->dtype,
                                  stored.param_dtype == DType::kBF16 && !adapter ? "bf16" : "fp32"),
                      exp->architecture, size_t(exp->max_shard_gb * 1e9), exp->merge);
            std::cout << "exported " << ckpt.dir()
                      << (adapter      ? " (LoRA adapter, PEFT format)"
                          : exp->merge ? " (LoRA merged into the base)"
                                       : "")
                      << " to " << exp->output << "\n";
            return 0;
          }};
}

}  // namespace shardlm::cli
