"""The bitsandbytes side of test_qlora_hf.

  bnb4bit_reference.py make OUT_DIR
      4-bit Hugging Face directories: a tiny seeded LlamaForCausalLM saved by transformers
      (f32, `dense/`), loaded with bitsandbytes' 4-bit NF4 (CPU path) and saved again, with
      double quantization (`nf4_dq/`) and without (`nf4/`). Beside each 4-bit directory,
      `reference.safetensors` holds per quantized weight W what bitsandbytes computes with:
      W.codes (its packed codes, U8) and W.values (dequantize_4bit of W in f32).
  bnb4bit_reference.py logits BASE_4BIT_DIR ADAPTER_DIR MERGED_DIR TOKENS_JSON
      prints {"base": ..., "peft": ..., "merged": ...} as JSON: the logits of every position of
      the 4-bit base as transformers loads it, of PeftModel(that base, adapter) and of the
      merged directory
"""
import copy
import json
import os
import sys

# bitsandbytes wraps its generic dequantizer in torch.compile; eager gives the same values.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import torch
import bitsandbytes as bnb
import bitsandbytes.functional as F
from safetensors.torch import save_file
from peft import PeftModel
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM


def main(out):
    torch.manual_seed(26)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=320,
                      max_position_embeddings=256, tie_word_embeddings=False,
                      rms_norm_eps=1e-5, rope_theta=10000.0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # heavier tails than the default init, and norms off 1
        for name, p in model.named_parameters():
            p.copy_(p * 3 if "norm" not in name else 1 + 0.1 * torch.randn_like(p))
    dense = os.path.join(out, "dense")
    model.save_pretrained(dense, safe_serialization=True)
    for sub, double in (("nf4", False), ("nf4_dq", True)):
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_use_double_quant=double,
                               bnb_4bit_compute_dtype=torch.float32,
                               bnb_4bit_quant_storage=torch.uint8)
        m = LlamaForCausalLM.from_pretrained(dense, quantization_config=q, device_map="cpu")
        d = os.path.join(out, sub)
        m.save_pretrained(d, safe_serialization=True)
        ref = {}
        for name, mod in m.named_modules():
            if isinstance(mod, bnb.nn.Linear4bit):
                w = mod.weight
                ref[name + ".weight.codes"] = w.data.contiguous().view(torch.uint8).flatten()
                # Dequantized as one flat tensor (the format's definition): bitsandbytes 0.50's
                # CPU dequantize_4bit of a 2-D weight whose rows are not a multiple of 64 long
                # misplaces the blocks (a [64, 160] round trip erred by 0.14 where the flat one
                # did by 0.03), so the model's rows here are multiples of 64 (its own forward,
                # which test_qlora_hf's PEFT comparison runs, dequantizes in 2-D).
                flat = copy.copy(w.quant_state)
                flat.shape = torch.Size([w.quant_state.shape.numel()])
                ref[name + ".weight.values"] = F.dequantize_4bit(
                    w.data, flat).to(torch.float32).reshape(w.quant_state.shape).contiguous()
        save_file(ref, os.path.join(d, "reference.safetensors"))
    print("ok")


def load_4bit(base_dir):
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    for mod in model.modules():
        # On a CPU with AVX512-BF16, bitsandbytes' inference repacks the weights in bf16
        # (logits 0.015 off here); without it, it dequantizes in f32 as shardlm does.
        if isinstance(mod, bnb.nn.Linear4bit):
            mod.support_avx512bf16_for_cpu = False
    model.eval()
    return model


def run(model, tokens):
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].tolist()


def logits(base_dir, adapter_dir, merged_dir, tokens):
    out = {"base": run(load_4bit(base_dir), tokens)}
    out["peft"] = run(PeftModel.from_pretrained(load_4bit(base_dir), adapter_dir).eval(), tokens)
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    out["merged"] = run(merged, tokens)
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1] == "make":
        main(sys.argv[2])
    else:
        logits(sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5]))
