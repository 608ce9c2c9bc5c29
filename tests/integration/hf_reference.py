"""Reference side of test_hf: tiny random Hugging Face models, their logits and one training
step's gradients, with transformers.

  hf_reference.py make DIR FAMILY [TOKENS_JSON]
                                          llama | mistral | qwen2 | qwen3 | gemma2 | gemma3 |
                                          glm | glm4 | mistral_swa | qwen2_swa: a random model
                                          saved to DIR
                                          (the _swa ones with sliding windows shorter than the
                                          test sequences: Mistral's on every layer, Qwen2's from
                                          max_window_layers = 1 on); with tokens, then the saved
                                          model's logits as `logits` prints them (one process:
                                          importing transformers is most of the time)
  hf_reference.py logits DIR TOKENS_JSON  prints the logits of every position as JSON
  hf_reference.py grads ROOT DOCS_JSON    for each family: a random model saved to ROOT/FAMILY and
                                          ROOT/FAMILY/grads.safetensors, the gradient of every
                                          parameter (Hugging Face names; a tied embedding's
                                          includes the head's) of the mean next-token
                                          cross-entropy over the documents
                                          ([{"tokens": [...], "targets": [...]}, ...], target -1
                                          ignored), each document its own sequence; the loss is
                                          the file's metadata "loss"
  hf_reference.py loss DIR DOCS_FILE      prints {"sum": S, "count": N}: the summed next-token
                                          cross-entropy (f64) of the model at DIR over the
                                          documents (a JSON file, as grads takes), each its own
                                          sequence, and the number of targets
  hf_reference.py tokenizer DIR CORPUS    a byte-level BPE tokenizer.json trained on CORPUS with
                                          exactly config.json's vocab_size ids (<|endoftext|>
                                          the EOS, in tokenizer_config.json) written to DIR
  hf_reference.py generate DIR PROMPT N TOL
                                          transformers' greedy continuation of PROMPT (DIR's
                                          tokenizer, no special tokens added) for N tokens or to
                                          the EOS; at every step the chosen token's logit leads
                                          the next one's by more than 2 TOL of the step's largest
                                          (two forwards within TOL of it pick the same token),
                                          else an AssertionError names the step. Prints
                                          {"ids", "hex" (the prompt and each token's bytes, as
                                          shardlm generate prints them), "min_margin"}
  hf_reference.py make_generate DIR FAMILY CORPUS PROMPT N
                                          make, tokenizer and generate (TOL 0: the caller checks
                                          min_margin against its bound) in one process
"""
import json
import sys

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, Gemma2Config, Gemma2ForCausalLM,
                          Gemma3ForCausalLM, Gemma3TextConfig, Glm4Config, Glm4ForCausalLM,
                          GlmConfig, GlmForCausalLM, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
                          Qwen3Config, Qwen3ForCausalLM)

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "glm", "glm4", "mistral_swa",
            "qwen2_swa")


def load(path):
    # Gemma 2's soft-capping is applied by the eager attention only (sdpa has no softcap).
    eager = AutoConfig.from_pretrained(path).model_type == "gemma2"
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, **({"attn_implementation": "eager"} if eager else {}))


def make(out, family):
    torch.manual_seed({"llama": 1, "mistral": 2, "qwen2": 3, "qwen3": 4, "mistral_swa": 5,
                       "qwen2_swa": 6, "gemma3": 7, "gemma2": 8, "glm": 9, "glm4": 10}[family])
    common = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                  rms_norm_eps=1e-5, max_position_embeddings=256)
    if family == "llama":  # GQA, Llama-3 frequency scaling, untied head
        cfg = LlamaConfig(**common, rope_theta=500000.0, tie_word_embeddings=False,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 16})
        model = LlamaForCausalLM(cfg)
    elif family == "mistral":
        cfg = MistralConfig(**common, rope_theta=10000.0, sliding_window=None)
        model = MistralForCausalLM(cfg)
    elif family == "mistral_swa":  # every layer sees the 4 latest tokens
        cfg = MistralConfig(**common, rope_theta=10000.0, sliding_window=4)
        model = MistralForCausalLM(cfg)
    elif family == "qwen2_swa":  # layer 0 full, layer 1 the 3 latest tokens
        cfg = Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True,
                          use_sliding_window=True, sliding_window=3, max_window_layers=1)
        model = Qwen2ForCausalLM(cfg)
    elif family == "qwen2":  # q/k/v biases, tied embeddings
        cfg = Qwen2Config(**common, rope_theta=1000000.0, tie_word_embeddings=True,
                          use_sliding_window=False)
        model = Qwen2ForCausalLM(cfg)
    elif family == "qwen3":  # q/k norms, heads of 24 (q is 96 wide, the model 64), untied head
        cfg = Qwen3Config(**common, head_dim=24, rope_theta=1000000.0, tie_word_embeddings=False,
                          use_sliding_window=False, attention_bias=False)
        model = Qwen3ForCausalLM(cfg)
    elif family == "gemma2":  # Gemma 2: Gemma2Config's default layer_types (layer 0 local over
        # the 4 latest tokens, layer 1 global), heads of 24, query_pre_attn_scalar other than
        # head_dim, tied, and soft caps below the random model's scores (~0.5) and logits
        # (~0.7) so that tanh bends them. No pad token (as Gemma 3's).
        cfg = Gemma2Config(**common, head_dim=24, query_pre_attn_scalar=20, pad_token_id=None,
                           sliding_window=4, attn_logit_softcapping=0.5,
                           final_logit_softcapping=1.0, attn_implementation="eager")
        model = Gemma2ForCausalLM(cfg)
    elif family in ("glm", "glm4"):  # GLM-4: q/k/v biases, heads of 24 (q 96 wide, the model
        # 64) of which the first 12 dims rotate in interleaved pairs (partial_rotary_factor 0.5),
        # fused gate_up_proj, untied; GLM-4-0414 adds its post-norms. No pad token (GlmConfig's
        # default id is past this vocabulary).
        glm_config, glm_model = (Glm4Config, Glm4ForCausalLM) if family == "glm4" else (
            GlmConfig, GlmForCausalLM)
        cfg = glm_config(**common, head_dim=24, pad_token_id=None, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.5})
        model = glm_model(cfg)
    else:  # Gemma 3: a local layer (the 5 latest tokens) then a global one with
        # linear rope scaling, heads of 24, query_pre_attn_scalar other than head_dim, tied. No
        # pad token: torch's padding_idx would drop the lookup's gradient of token 0, which
        # the test's random ids use (real Gemma inputs never hold <pad> where a loss is taken).
        cfg = Gemma3TextConfig(**common, head_dim=24, query_pre_attn_scalar=20, pad_token_id=None,
                               sliding_window=5,
                               layer_types=["sliding_attention", "full_attention"],
                               rope_scaling={"rope_type": "linear", "factor": 2.0})
        model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():  # norms and biases away from their init so that they matter
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.normal_(0, 0.08)
    model.float().save_pretrained(out, safe_serialization=True)


def logits(path, tokens):
    model = load(path)
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens])).logits[0]
    print(json.dumps(out.tolist()))


def grads(root, docs):
    from safetensors.torch import save_file
    for family in FAMILIES:
        path = f"{root}/{family}"
        make(path, family)
        model = load(path)
        model.train()  # dropout is 0 in these configs: train and eval compute the same
        total = torch.zeros((), dtype=torch.float64)
        count = 0
        for doc in docs:
            targets = torch.tensor(doc["targets"])
            logits = model(torch.tensor([doc["tokens"]])).logits[0]  # [T, V]
            keep = targets >= 0
            total = total + torch.nn.functional.cross_entropy(
                logits[keep], targets[keep], reduction="sum").double()
            count += int(keep.sum())
        loss = (total / count).float()
        loss.backward()
        out = {n: p.grad.detach().contiguous() for n, p in model.named_parameters()}
        save_file(out, f"{path}/grads.safetensors", metadata={"loss": repr(loss.item())})


def loss(path, docs):
    model = load(path)
    model.eval()
    total = 0.0
    count = 0
    with torch.no_grad():
        for doc in docs:
            targets = torch.tensor(doc["targets"])
            logits = model(torch.tensor([doc["tokens"]])).logits[0]  # [T, V]
            keep = targets >= 0
            total += torch.nn.functional.cross_entropy(
                logits[keep].double(), targets[keep], reduction="sum").item()
            count += int(keep.sum())
    print(json.dumps({"sum": total, "count": count}))


def tokenizer(out, corpus):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    vocab = json.load(open(f"{out}/config.json"))["vocab_size"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([open(corpus).read()], trainer)
    assert tok.get_vocab_size() == vocab, f"{tok.get_vocab_size()} ids, the model has {vocab}"
    tok.save(f"{out}/tokenizer.json")
    with open(f"{out}/tokenizer_config.json", "w") as f:
        json.dump({"eos_token": "<|endoftext|>"}, f)


def generate(path, prompt, n, tol):
    from tokenizers import Tokenizer
    from gguf_reference import token_bytes  # the bytes shardlm prints for each token
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    eos = tok.token_to_id("<|endoftext|>")
    ids = tok.encode(prompt, add_special_tokens=False).ids
    model = load(path)
    model.eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos, return_dict_in_generate=True,
                             output_logits=True)
    new = out.sequences[0, len(ids):].tolist()
    min_margin = float("inf")
    for step, logits in enumerate(out.logits[:len(new)]):
        top = torch.topk(logits[0].double(), 2).values
        margin = float(top[0] - top[1]) / float(logits[0].abs().max())
        assert margin > 2 * tol, f"step {step}: a near tie ({margin} of the largest logit)"
        min_margin = min(min_margin, margin)
    if eos in new:
        new = new[:new.index(eos)]
    text = token_bytes(json.load(open(f"{path}/tokenizer.json")), new)
    print(json.dumps({"ids": new, "hex": (prompt.encode() + text).hex(),
                      "min_margin": min_margin}))


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3])
        if len(sys.argv) > 4:
            logits(sys.argv[2], json.loads(sys.argv[4]))
    elif sys.argv[1] == "grads":
        grads(sys.argv[2], json.loads(sys.argv[3]))
    elif sys.argv[1] == "loss":
        loss(sys.argv[2], json.loads(open(sys.argv[3]).read()))
    elif sys.argv[1] == "tokenizer":
        tokenizer(sys.argv[2], sys.argv[3])
    elif sys.argv[1] == "make_generate":
        make(sys.argv[2], sys.argv[3])
        tokenizer(sys.argv[2], sys.argv[4])
        generate(sys.argv[2], sys.argv[5], int(sys.argv[6]), 0.0)
    elif sys.argv[1] == "generate":
        generate(sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5]))
    else:
        logits(sys.argv[2], json.loads(sys.argv[3]))
