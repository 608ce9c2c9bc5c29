"""Reference side of test_lora_hf: a shardlm LoRA export through transformers + peft.

  lora_reference.py logits BASE_DIR ADAPTER_DIR MERGED_DIR TOKENS_JSON
      prints {"peft": ..., "merged": ..., "base": ...} as JSON: the logits of every position of
      PeftModel(base, adapter), of the merged directory and of the base alone
"""
import json
import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM


def run(model, tokens):
    model.eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0].tolist()


def logits(base_dir, adapter_dir, merged_dir, tokens):
    out = {"base": run(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), tokens)}
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    out["peft"] = run(PeftModel.from_pretrained(base, adapter_dir), tokens)
    out["merged"] = run(AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32),
                        tokens)
    print(json.dumps(out))


if __name__ == "__main__":
    logits(sys.argv[2], sys.argv[3], sys.argv[4], json.loads(sys.argv[5]))
