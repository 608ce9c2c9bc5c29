"""Reference side of test_gguf: tiny random Hugging Face models with a byte-level BPE tokenizer,
and shardlm's GGUF files read back by the `gguf` package and loaded by transformers.

  gguf_reference.py make ROOT CORPUS FAMILY...
      for each family (llama | llama_rope | qwen2 | qwen3 | gemma2 | gemma3 | glm | glm4
      (GlmForCausalLM, Glm4ForCausalLM: GLM-4's special tokens and chat template); llama_rope: with
      Llama 3's rope scaling, which transformers' GGUF loader does not read) a random model
      saved to ROOT/FAMILY with a byte-level BPE tokenizer trained on CORPUS (tokenizer.json,
      tokenizer_config.json with a chat template); FAMILY_sp: with a SentencePiece
      tokenizer.model of Gemma's settings instead (tests/unit/sentencepiece_reference.py). The
      settings transformers' GGUF loader does not read are left at its config classes' defaults
      (Qwen3's head_dim 128, Gemma's query_pre_attn_scalar 256 = head_dim and soft caps 50/30),
      and every weight is rounded to bf16, which f16 and bf16 then hold exactly: the greedy
      texts compare the same weights.
  gguf_reference.py verify PROMPT N DIR:PREFIX:TOL...
      for each case, PREFIX.f16.gguf, PREFIX.bf16.gguf and PREFIX.q8_0.gguf checked against the
      Hugging Face directory DIR: every key and tensor (read with GGUFReader) as llama.cpp's
      converter writes them for DIR, the keys' values and the tensors' names, shapes, types and
      bytes (f16/bf16/q8_0 encoded by gguf.quants from DIR's values, transformed as the
      converter does: Llama's q/k rows regrouped, Gemma's norms + 1). Then transformers loads
      the f16 file (model and tokenizer): its logits must be DIR's model's (loaded from the
      directory) within TOL of their largest at every position of a 24-token sequence, its
      tokenizer must encode PROMPT as DIR's tokenizer.json does, and it continues PROMPT
      greedily for N tokens (to the EOS). Prints a JSON line per case: {"dir", "ids", "hex" (the
      prompt and the continuation's bytes as shardlm prints them), "logits_max_diff", and per
      type {"keys", "tensors"}}; an AssertionError names what differs.
  gguf_reference.py files DIR:PREFIX...
      verify's checks of the three files alone, for GLM (chatglm, glm4), which transformers'
      GGUF loader does not read. Prints {"dir", and per type {"keys", "tensors"}} per case.
  gguf_reference.py llamacpp PROMPT N DIR:PREFIX:TOL...
      llama.cpp itself (llama-cpp-python) on each PREFIX.f16.gguf: the prompt's tokens, the
      logits over the prompt and DIR's model's greedy continuation within TOL, that
      continuation as llama.cpp's greedy choice up to f16 near ties, and its text as llama.cpp
      detokenizes it (llamacpp()).
"""
import json
import os
import sys

import numpy as np

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
          "'<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3_CHAT = ("{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + "
               "'<|end_header_id|>\\n\\n' + m['content'] + '<|eot_id|>' }}{% endfor %}")
QWEN = ("qwen2", "qwen3")
GLM = ("glm", "glm4")
# GLM-4's special tokens and chat format (tokenizer_config.json of THUDM/glm-4-9b-chat-hf).
GLM_SPECIAL = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>",
               "<|user|>", "<|assistant|>", "<|observation|>"]
GLM_CHAT = ("[gMASK]<sop>{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")


def make_tokenizer(out, family, corpus):
    from tokenizers import (Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                            processors, trainers)
    qwen, glm = family in QWEN, family in GLM
    special = (["<|endoftext|>", "<|im_start|>", "<|im_end|>"] if qwen else GLM_SPECIAL if glm else
               ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"])
    # GLM-4's tokenizer: Llama 3's split, merges applied to every word, no BOS added
    tok = Tokenizer(models.BPE(ignore_merges=not (qwen or glm)))
    if qwen:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT if qwen else LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([open(corpus).read()], trainer)
    if not (qwen or glm):  # Llama 3's way of saying a BOS is added (gguf: add_bos_token)
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", bos)])
    tok.save(out + "/tokenizer.json")
    config = ({"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
               "chat_template": CHATML} if qwen else
              {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
               "chat_template": GLM_CHAT} if glm else
              {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
               "chat_template": LLAMA3_CHAT})
    with open(out + "/tokenizer_config.json", "w") as f:
        json.dump(config, f)
    return tok.get_vocab_size()


def make_model(out, family, vocab):
    import torch
    from transformers import (Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM,
                              Gemma3TextConfig, Glm4Config, Glm4ForCausalLM, GlmConfig,
                              GlmForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config,
                              Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)
    torch.manual_seed({"llama": 1, "llama_rope": 2, "qwen2": 3, "qwen3": 4, "gemma2": 8,
                       "gemma3": 7, "glm": 9, "glm4": 10}[family])
    common = dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                  rms_norm_eps=1e-5, max_position_embeddings=256)
    if family == "llama":  # GQA, untied
        model = LlamaForCausalLM(LlamaConfig(**common, rope_theta=500000.0,
                                             tie_word_embeddings=False))
    elif family == "llama_rope":  # Llama 3's rope scaling, active past position 16/4
        model = LlamaForCausalLM(LlamaConfig(
            **common, rope_theta=500000.0, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}))
    elif family == "qwen2":  # q/k/v biases, tied
        model = Qwen2ForCausalLM(Qwen2Config(**common, rope_theta=1000000.0,
                                             tie_word_embeddings=True, use_sliding_window=False))
    elif family == "qwen3":  # q/k norms, Qwen3Config's head_dim (128: q is 512 wide), untied
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=128, rope_theta=1000000.0,
                                             tie_word_embeddings=False, use_sliding_window=False))
    elif family == "gemma2":  # local then global layer (window 4), Gemma2Config's caps, tied
        gemma = dict(common, num_attention_heads=2, num_key_value_heads=1)
        model = Gemma2ForCausalLM(Gemma2Config(
            **gemma, head_dim=256, query_pre_attn_scalar=256, pad_token_id=None,
            sliding_window=4, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
            attn_implementation="eager"))
    elif family in GLM:  # GLM-4: q/k/v biases, fused gate_up_proj, the first half of each
        # head rotating in interleaved pairs; GLM-4-0414 adds its post-norms. glm: heads of 16
        # (llama.cpp's chatglm has q as wide as the model), untied; glm4: heads of 24 (q 96
        # wide, the model 64), tied (llama.cpp reuses token_embd). The special ids the
        # tokenizer's (GlmConfig's defaults are past this vocabulary).
        glm_config, glm_model = (Glm4Config, Glm4ForCausalLM) if family == "glm4" else (
            GlmConfig, GlmForCausalLM)
        model = glm_model(glm_config(
            **common, head_dim=24 if family == "glm4" else 16, attention_bias=True,
            tie_word_embeddings=family == "glm4", pad_token_id=None, eos_token_id=None,
            bos_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.5}))
    else:  # Gemma 3: Gemma3TextConfig's pattern (both layers local, window 5), q/k norms, tied
        gemma = dict(common, num_attention_heads=2, num_key_value_heads=1)
        model = Gemma3ForCausalLM(Gemma3TextConfig(
            **gemma, head_dim=256, query_pre_attn_scalar=256, pad_token_id=None,
            sliding_window=5))
    with torch.no_grad():  # norms and biases away from their init; every value a bf16 one
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(torch.randn_like(p) * 0.2)
            else:
                p.normal_(0, 0.08)
            p.copy_(p.bfloat16().float())
    model.float().save_pretrained(out, safe_serialization=True)


GEMMA_CHAT = ("{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\\n' + m['content'] + "
              "'<end_of_turn>\\n' }}{% endfor %}")


def make_sentencepiece(out, corpus):
    """Gemma's SentencePiece settings (sentencepiece_reference.py's gemma kind)."""
    import sentencepiece as spm
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "unit"))
    import sentencepiece_reference
    sentencepiece_reference.make(out, "gemma", [corpus])
    with open(out + "/tokenizer_config.json", "w") as f:
        json.dump({"chat_template": GEMMA_CHAT}, f)
    return spm.SentencePieceProcessor(model_file=out + "/tokenizer.model").get_piece_size()


def make(root, corpus, families):
    """FAMILY_sp: the family's model with a SentencePiece tokenizer.model instead."""
    for family in families:
        out = f"{root}/{family}"
        os.makedirs(out, exist_ok=True)
        if family.endswith("_sp"):
            make_model(out, family[:-3], make_sentencepiece(out, corpus))
        else:
            make_model(out, family, make_tokenizer(out, family, corpus))


# --- check ---------------------------------------------------------------------------------

ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3", "Gemma2ForCausalLM": "gemma2",
        "Gemma3ForCausalLM": "gemma3", "GlmForCausalLM": "chatglm", "Glm4ForCausalLM": "glm4"}
FILE_TYPE = {"f16": 1, "q8_0": 7, "bf16": 32}


def expected_model_keys(cfg, arch, ftype):
    a = arch + "."
    keys = {"general.architecture": arch, "general.type": "model",
            "general.file_type": FILE_TYPE[ftype], "general.quantization_version": 2,
            a + "block_count": cfg["num_hidden_layers"],
            a + "context_length": cfg["max_position_embeddings"],
            a + "embedding_length": cfg["hidden_size"],
            a + "feed_forward_length": cfg["intermediate_size"],
            a + "attention.head_count": cfg["num_attention_heads"],
            a + "attention.head_count_kv": cfg["num_key_value_heads"],
            a + "attention.layer_norm_rms_epsilon": np.float32(cfg["rms_norm_eps"])}
    rope = cfg.get("rope_parameters") or {}
    if isinstance(rope.get("full_attention"), dict):
        rope = rope["full_attention"]
    keys[a + "rope.freq_base"] = np.float32(rope.get("rope_theta", cfg.get("rope_theta")))
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if "head_dim" in cfg:
        keys[a + "attention.key_length"] = head_dim
        keys[a + "attention.value_length"] = head_dim
    if arch == "llama":
        keys[a + "vocab_size"] = cfg["vocab_size"]
        keys[a + "rope.dimension_count"] = head_dim
    if arch == "gemma2":
        keys[a + "attn_logit_softcapping"] = np.float32(cfg["attn_logit_softcapping"])
    if arch in ("gemma2", "gemma3"):
        keys[a + "attention.sliding_window"] = cfg["sliding_window"]
        if cfg.get("final_logit_softcapping"):
            keys[a + "final_logit_softcapping"] = np.float32(cfg["final_logit_softcapping"])
    if arch in ("chatglm", "glm4"):  # the rotated dims of each head
        factor = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.5))
        keys[a + "rope.dimension_count"] = int(head_dim * factor)
    # chatglm: the converter's ChatGLMModel reads several keys from ChatGLM's own config fields,
    # which a GlmForCausalLM config.json (GLM-4-9B-chat-hf's) does not have: context length
    # seq_length (else hidden_size), RMS epsilon layernorm_epsilon (else 1e-5), rope base 10000 x
    # rope_ratio, rope dims from hidden_size / heads, no key/value length. shardlm writes the
    # model's own values under the same keys, which llama.cpp reads (GLM-4-9B's epsilon is
    # 1.5625e-07, its context 131072).
    return keys


def expected_sentencepiece_keys(d, vocab_size, arch):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=d + "/tokenizer.model")
    tc = json.load(open(d + "/tokenizer_config.json"))
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    scores = [np.float32(-10000.0)] * vocab_size
    types = [5] * vocab_size
    for i in range(sp.get_piece_size()):
        tokens[i], scores[i] = sp.id_to_piece(i), np.float32(sp.get_score(i))
        types[i] = (2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 5 if sp.is_unused(i)
                    else 6 if sp.is_byte(i) else 1)
    keys = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.chat_template": tc["chat_template"]}
    for key, i in (("bos", sp.bos_id()), ("eos", sp.eos_id()), ("unknown", sp.unk_id()),
                   ("padding", sp.pad_id())):
        if i >= 0:
            keys[f"tokenizer.ggml.{key}_token_id"] = i
    if arch in ("gemma2", "gemma3"):
        keys["tokenizer.ggml.add_space_prefix"] = False
    return keys


def expected_tokenizer_keys(d, vocab_size, arch):
    if not os.path.exists(d + "/tokenizer.json"):
        return expected_sentencepiece_keys(d, vocab_size, arch)
    tj = json.load(open(d + "/tokenizer.json"))
    tc = json.load(open(d + "/tokenizer_config.json"))
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [5] * vocab_size
    for text, i in tj["model"]["vocab"].items():
        tokens[i], types[i] = text, 1
    for t in tj["added_tokens"]:
        tokens[t["id"]] = t["content"]
        types[t["id"]] = 3 if t["special"] else 4
    ids = {t: i for i, t in enumerate(tokens)}
    pattern = tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tj["model"]["merges"]]
    keys = {"tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}[pattern],
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": merges, "tokenizer.chat_template": tc["chat_template"]}
    # Without one in tokenizer_config.json, the family's (Qwen's GGUF files say <|endoftext|>).
    fallback = {"bos": ["<|begin_of_text|>", "<s>", "<|endoftext|>"],
                "eos": ["<|end_of_text|>", "</s>", "<|endoftext|>"]}
    for key in ("bos", "eos"):
        text = tc.get(key + "_token") or next((t for t in fallback[key] if t in ids), None)
        if text is not None:
            keys[f"tokenizer.ggml.{key}_token_id"] = ids[text]
    if tc.get("pad_token"):
        keys["tokenizer.ggml.padding_token_id"] = ids[tc["pad_token"]]
    post = tj.get("post_processor") or {}
    if post.get("type") == "TemplateProcessing" and len(post["single"]) > 1:
        first = post["single"][0].get("SpecialToken", {}).get("id")
        if first is not None:
            keys["tokenizer.ggml.add_bos_token"] = first == tc.get("bos_token")
    if arch in ("chatglm", "glm4"):
        keys.update(glm_tokenizer_keys(arch, ids, keys))
    return keys


def glm_tokenizer_keys(arch, ids, keys):
    """What the converter's ChatGLMModel / Glm4Model add for GLM-4's tokenizer: its pre-tokenizer
    by the name it gives GLM-4's tokenizers (it finds them by a hash of their output; this tiny
    tokenizer's is none it knows: llama.cpp reads both names as Llama 3's split without Llama
    3's whole-word lookup and without a BOS), <|endoftext|> as eos / unknown (and glm4's bos)
    where the tokenizer names none, <|user|> as end of turn, and chatglm's add_bos_token
    false."""
    out = {"tokenizer.ggml.pre": "glm4" if arch == "glm4" else "chatglm-bpe"}
    end = ids["<|endoftext|>"]
    for key, value in (("eos", end), ("unknown", end), ("eot", ids["<|user|>"])) + (
            (("bos", end),) if arch == "glm4" else ()):
        if f"tokenizer.ggml.{key}_token_id" not in keys:
            out[f"tokenizer.ggml.{key}_token_id"] = value
    if arch == "chatglm" and "tokenizer.ggml.add_bos_token" not in keys:
        out["tokenizer.ggml.add_bos_token"] = False
    return out


def permute(w, n_head):  # llama.cpp's regrouping of a head's rows [2, half] -> [half, 2]
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


GGUF_NAMES = [("model.embed_tokens.", "token_embd."), ("model.norm.", "output_norm."),
              ("lm_head.", "output."), ("model.layers.", "blk."),
              (".input_layernorm.", ".attn_norm."), (".self_attn.q_proj.", ".attn_q."),
              (".self_attn.k_proj.", ".attn_k."), (".self_attn.v_proj.", ".attn_v."),
              (".self_attn.o_proj.", ".attn_output."), (".self_attn.q_norm.", ".attn_q_norm."),
              (".self_attn.k_norm.", ".attn_k_norm."), (".mlp.gate_proj.", ".ffn_gate."),
              (".mlp.up_proj.", ".ffn_up."), (".mlp.down_proj.", ".ffn_down."),
              (".pre_feedforward_layernorm.", ".ffn_norm."),
              (".post_feedforward_layernorm.", ".post_ffw_norm."),
              (".mlp.gate_up_proj.", ".ffn_up."),  # GLM's: one tensor, gate then up
              (".post_self_attn_layernorm.", ".post_attention_norm."),  # GLM-4-0414's post-norms
              (".post_mlp_layernorm.", ".post_ffw_norm.")]


def expected_tensors(d, cfg, arch, ftype):
    import gguf
    from safetensors.numpy import load_file
    weights = load_file(d + "/model.safetensors")
    gemma = arch in ("gemma2", "gemma3")
    qtype = {"f16": gguf.GGMLQuantizationType.F16, "bf16": gguf.GGMLQuantizationType.BF16,
             "q8_0": gguf.GGMLQuantizationType.Q8_0}[ftype]
    out = {}
    for name, w in weights.items():
        w = w.astype(np.float32)
        g = name
        for a, b in GGUF_NAMES:
            g = g.replace(a, b)
        g = g.replace(".post_attention_layernorm.",
                      ".post_attention_norm." if gemma else ".ffn_norm.")
        if arch == "llama" and ".attn_q." in g:
            w = permute(w, cfg["num_attention_heads"])
        if arch == "llama" and ".attn_k." in g:
            w = permute(w, cfg["num_key_value_heads"])
        if gemma and name.endswith("norm.weight"):
            w = w + np.float32(1)
        t = gguf.GGMLQuantizationType.F32 if w.ndim < 2 else qtype
        if t == gguf.GGMLQuantizationType.Q8_0 and w.shape[-1] % 32:
            t = gguf.GGMLQuantizationType.F16
        out[g] = (t, list(reversed(w.shape)), gguf.quants.quantize(w, t))
    return out


def field_value(field):
    v = field.contents()
    if isinstance(v, float):
        return np.float32(v)
    return v


def check(d, path, ftype):
    from gguf import GGUFReader
    cfg = json.load(open(d + "/config.json"))
    arch = ARCH[cfg["architectures"][0]]
    reader = GGUFReader(path)
    want = expected_model_keys(cfg, arch, ftype)
    want.update(expected_tokenizer_keys(d, cfg["vocab_size"], arch))
    got = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert isinstance(field_value(got.pop("general.name")), str)
    assert set(got) == set(want), \
        f"keys: extra {set(got) - set(want)}, missing {set(want) - set(got)}"
    for k, v in want.items():
        g = field_value(got[k])
        assert g == v, f"{k}: {str(g)[:200]} != {str(v)[:200]}"
    tensors = expected_tensors(d, cfg, arch, ftype)
    names = [t.name for t in reader.tensors]
    assert sorted(names) == sorted(tensors), f"tensors: {names} vs {sorted(tensors)}"
    for t in reader.tensors:
        qtype, shape, data = tensors[t.name]
        assert t.tensor_type == qtype, f"{t.name}: type {t.tensor_type.name} != {qtype.name}"
        assert list(t.shape) == shape, f"{t.name}: shape {list(t.shape)} != {shape}"
        assert np.asarray(t.data).tobytes() == data.tobytes(), f"{t.name}: bytes differ"
    return {"keys": len(want) + 1, "tensors": len(names)}


# --- generate ------------------------------------------------------------------------------

def token_bytes(tj, ids):
    """The bytes shardlm's decoder prints for `ids`: byte-level tokens as their bytes, special
    added tokens as nothing."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    back = {c: b for b, c in bytes_to_unicode().items()}
    by_id = {i: t for t, i in tj["model"]["vocab"].items()}
    added = {t["id"]: t for t in tj["added_tokens"]}
    out = b""
    for i in ids:
        if i in added:
            out += b"" if added[i]["special"] else added[i]["content"].encode()
        else:
            out += bytes(back[c] for c in by_id[i])
    return out


def generate(d, path, prompt, n, tol):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    folder, name = os.path.split(os.path.abspath(path))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32,
                                                 attn_implementation="eager")
    want, sp = prompt_ids(d, prompt)
    ids = tok.encode(prompt, add_special_tokens=False)
    assert ids == want, f"the GGUF tokenizer encodes {ids}, {d}'s tokenizer {want}"
    # The file is the directory's model to transformers: the same logits at every position of a
    # sequence longer than the sliding windows (greedy texts of random models can be one token).
    reference = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                     attn_implementation="eager")
    seq = torch.tensor([[(i * 37 + 11) % model.config.vocab_size for i in range(24)]])
    with torch.no_grad():
        a, b = model(seq).logits, reference(seq).logits
    diff = float((a - b).abs().max())
    assert diff <= tol * float(b.abs().max()), f"logits differ from {d}'s by {diff}"
    eos = tok.eos_token_id
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                             eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()
    if eos in out:
        out = out[:out.index(eos)]
    # shardlm decodes and prints one token at a time
    text = (b"".join(sp.decode([i]).encode() for i in out) if sp else
            token_bytes(json.load(open(d + "/tokenizer.json")), out))
    return {"ids": out, "hex": (prompt.encode() + text).hex(),
            "logits_max_diff": diff}


def verify(prompt, n, cases):
    """One line of JSON per case DIR:PREFIX:TOL: PREFIX.{f16,bf16,q8_0}.gguf checked against
    DIR, and PREFIX.f16.gguf generating (its logits within TOL of DIR's largest)."""
    for case in cases:
        d, prefix, tol = case.rsplit(":", 2)
        out = {"dir": d}
        for t in ("f16", "bf16", "q8_0"):
            out[t] = check(d, f"{prefix}.{t}.gguf", t)
        out.update(generate(d, f"{prefix}.f16.gguf", prompt, n, float(tol)))
        print(json.dumps(out), flush=True)


def files(cases):
    """One line of JSON per case DIR:PREFIX: PREFIX.{f16,bf16,q8_0}.gguf checked against DIR
    (check()), for the architectures transformers' GGUF loader does not read (chatglm, glm4)."""
    for case in cases:
        d, prefix = case.rsplit(":", 1)
        print(json.dumps({"dir": d, **{t: check(d, f"{prefix}.{t}.gguf", t)
                                       for t in ("f16", "bf16", "q8_0")}}), flush=True)


def prompt_ids(d, prompt):
    """PROMPT's ids by DIR's own tokenizer (no special tokens added), and its SentencePiece
    processor when it has one."""
    if os.path.exists(d + "/tokenizer.json"):
        from tokenizers import Tokenizer
        return Tokenizer.from_file(d + "/tokenizer.json").encode(
            prompt, add_special_tokens=False).ids, None
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=d + "/tokenizer.model")
    return sp.encode(prompt), sp


def llamacpp(prompt, n, cases):
    """llama.cpp itself (llama-cpp-python) on PREFIX.f16.gguf of each case DIR:PREFIX:TOL. Its
    tokenizer encodes PROMPT as DIR's does. DIR's model (transformers, f32) continues PROMPT
    greedily (shardlm's continuation, test_gguf's first test shows); run over the prompt and that
    continuation, llama.cpp's logits at every position are DIR's model's within TOL of their
    largest (llama.cpp rounds activations to f16 against f16 weights), and at every step the
    continuation's token is llama.cpp's likeliest or within TOL of it (a near tie f16 may flip).
    llama.cpp's detokenizer gives the text. Prints a JSON line per case: {"dir", "ids", "hex"
    (the prompt and each token's bytes as llama.cpp detokenizes them), "logits_max_diff",
    "argmax_steps" (the steps where the token is llama.cpp's likeliest)}."""
    import torch
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM
    for case in cases:
        d, prefix, tol = case.rsplit(":", 2)
        want, _ = prompt_ids(d, prompt)
        llm = Llama(model_path=f"{prefix}.f16.gguf", n_ctx=128, logits_all=True, verbose=False,
                    n_threads=2, seed=0)
        ids = llm.tokenize(prompt.encode(), add_bos=False, special=False)
        assert ids == want, f"llama.cpp encodes {ids}, {d}'s tokenizer {want}"
        reference = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32,
                                                         attn_implementation="eager")
        eos = llm.token_eos()
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                     eos_token_id=eos, pad_token_id=eos)[0, len(ids):].tolist()
            if eos in out:
                out = out[:out.index(eos)]
            ref = reference(torch.tensor([ids + out])).logits[0].numpy()
        llm.eval(ids + out)
        got = np.array(llm.scores[:len(ids) + len(out)])[:, :ref.shape[1]]
        scale = float(np.abs(ref).max())
        diff = float(np.abs(got - ref).max())
        assert diff <= float(tol) * scale, f"llama.cpp's logits differ by {diff}"
        argmax_steps = 0
        for t, token in enumerate(out):
            row = got[len(ids) - 1 + t]
            assert row[token] >= row.max() - float(tol) * scale, f"step {t}: {token} not likeliest"
            argmax_steps += int(row.argmax() == token)
        text = b"".join(llm.detokenize([i]) for i in out)
        print(json.dumps({"dir": d, "ids": out, "hex": (prompt.encode() + text).hex(),
                          "logits_max_diff": diff, "argmax_steps": argmax_steps}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "make":
        make(sys.argv[2], sys.argv[3], sys.argv[4:])
    elif sys.argv[1] == "files":
        files(sys.argv[2:])
    elif sys.argv[1] == "llamacpp":
        llamacpp(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
    else:
        verify(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
