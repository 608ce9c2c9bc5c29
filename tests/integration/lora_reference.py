"""Reference side of test_lora_hf: a shardlm LoRA export through transformers + peft.

  lora_reference.py logits BASE_DIR ADAPTER_DIR MERGED_DIR TOKENS_JSON
      prints {"peft": ..., "merged": ..., "base": ...} as JSON: the logits of every position of
      PeftModel(base, adapter), of the merged directory and of the base alone
"""
import json
import sys

import torch
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM


def load(path):
    # Gemma 2's soft-capping is applied by the eager attention only (sdpa has no softcap).
    eager = AutoConfig.from_pretrained(path).model_type == "gemma2"
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, **({"attn_implementation": "eager"} if eager else {}))


def run(model, tokens):
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].tolist()


def logits(base_dir, adapter_dir, merged_dir, tokens):
    out = {"base": run(load(base_dir), tokens)}
    out["peft"] = run(PeftModel.from_pretrained(load(base_dir), adapter_dir), tokens)
    out["merged"] = run(load(merged_dir), tokens)
    print(json.dumps(out))


if __name__ == "__main__":
    logits(sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5]))
