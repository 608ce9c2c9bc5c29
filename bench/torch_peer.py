#!/usr/bin/env python3
"""PyTorch peer of a shardlm CPU run: the same Llama shapes, batch and tokens, trained eagerly in
fp32 with torch.optim.AdamW, timed per step. Reads the shardlm JSON config so that the shapes
cannot drift apart; prints one JSON line on stdout (progress goes to stderr). Not a test.

Usage: torch_peer.py --config bench/configs/cpu_6l_512.json [--steps N] [--threads N]

Also a module: fsdp_peer.py and deepspeed_peer.py import load_config, import_torch,
build_model, param_groups, load_corpus, batch_at and lr_at from here, so that every peer trains
the same model on the same rows with the same optimizer settings.
"""

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time

# Every model.* key the peer needs, spelled out in the config rather than taken from a preset
# whose values only the C++ side knows.
MODEL_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "rope_theta",
              "norm_eps", "tie_embeddings", "attn_bias")
WARMUP_STEPS = 2  # excluded from the timing, as in bench/run.sh's reading of shardlm


def die(msg, prog="torch_peer"):
    print(f"{prog}: {msg}", file=sys.stderr)
    sys.exit(2)


def load_config(path):
    with open(path) as f:
        cfg = json.load(f)
    model = cfg.get("model", {})
    missing = [k for k in MODEL_KEYS if k not in model]
    if missing:
        die(f"{path}: model section lacks {', '.join(missing)}; the peer needs every shape "
            "explicit (a preset's values are known only to shardlm)")
    if model.get("rope_scaling", {}).get("type", "none") != "none":
        die(f"{path}: model.rope_scaling is not supported by the peer")
    data, train = cfg.get("data", {}), cfg.get("train", {})
    if "train" not in data:
        die(f"{path}: data.train is missing")
    base = os.path.dirname(os.path.abspath(path))
    return {
        "model": {k: model[k] for k in MODEL_KEYS},
        "data": os.path.normpath(os.path.join(base, data["train"])),
        "seq_len": int(data.get("seq_len", 256)),
        "micro_batch": int(train.get("micro_batch", 8)),
        "grad_accum": int(train.get("grad_accum", 1)),
        "max_steps": int(train.get("max_steps", 0)),
        "lr": float(train.get("lr", 3e-3)),
        "min_lr": float(train.get("min_lr", 3e-4)),
        "warmup_steps": int(train.get("warmup_steps", 20)),
        "weight_decay": float(train.get("weight_decay", 0.1)),
        "betas": (float(train.get("beta1", 0.9)), float(train.get("beta2", 0.95))),
        "eps": float(train.get("eps", 1e-8)),
        "grad_clip": float(train.get("grad_clip", 1.0)),
        "seed": int(train.get("seed", 1234)),
    }


def lr_at(c, step, total):
    """shardlm's schedule (src/train/optimizer.cpp): linear warmup, cosine decay to min_lr."""
    if c["warmup_steps"] > 0 and step <= c["warmup_steps"]:
        return c["lr"] * step / c["warmup_steps"]
    decay = max(1, total - c["warmup_steps"])
    p = min(max((step - c["warmup_steps"]) / decay, 0.0), 1.0)
    return c["min_lr"] + 0.5 * (c["lr"] - c["min_lr"]) * (1.0 + math.cos(math.pi * p))


def train_flops_per_token(m, T):
    """train_flops_per_token in src/model/layout.cpp: 6 x matmul parameters + causal attention."""
    D, F, V, L = m["dim"], m["ffn_dim"], m["vocab_size"], m["n_layers"]
    hd = D // m["n_heads"]
    qd, kvd = m["n_heads"] * hd, m["n_kv_heads"] * hd
    matmul = L * (qd * D + 2 * kvd * D + D * qd + 3 * F * D) + V * D  # LM head, tied or not
    attn = 6.0 * 2.0 * (T / 2.0) * hd * m["n_heads"] * L
    return 6.0 * matmul + attn


def gemm_flops(torch, n=1024, reps=10, device="cpu"):
    """Best of `reps` n^3 sgemms: shardlm's measure_gemm_flops takes best of three; more tries
    here make the reference rate less sensitive to other work on the machine."""
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    a @ b
    sync()
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        sync()
        best = max(best, 2.0 * n**3 / (time.perf_counter() - t0))
    return best


def import_torch(prog="torch_peer"):
    """(torch, transformers), or a clear failure: the peers never fall back to another model."""
    try:
        import torch
    except ImportError as e:
        die(f"PyTorch is not importable ({e}); run bench/run.sh, which installs it in a venv", prog)
    try:
        import transformers
        from transformers import LlamaForCausalLM  # noqa: F401  (the model every peer trains)
    except ImportError as e:
        die(f"transformers is not importable ({e}); the peer needs its LlamaForCausalLM "
            "(pip install transformers); it does not fall back to another model", prog)
    return torch, transformers


def build_model(c, prog="torch_peer", device="cpu", dtype=None):
    """transformers' LlamaForCausalLM with the config's shapes: fp32 (or `dtype`), SDPA
    attention, train mode, its parameters made on `device` (a GPU peer builds an 8B model there
    directly). Call torch.manual_seed first for a reproducible (and, across ranks, identical)
    init."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    m, T = c["model"], c["seq_len"]
    if m["vocab_size"] < 256:
        die(f"model.vocab_size {m['vocab_size']} cannot hold byte tokens (needs >= 256)", prog)
    hf_cfg = LlamaConfig(
        vocab_size=m["vocab_size"], hidden_size=m["dim"], intermediate_size=m["ffn_dim"],
        num_hidden_layers=m["n_layers"], num_attention_heads=m["n_heads"],
        num_key_value_heads=m["n_kv_heads"], max_position_embeddings=T,
        rms_norm_eps=m["norm_eps"], rope_theta=m["rope_theta"],
        tie_word_embeddings=m["tie_embeddings"], attention_bias=m["attn_bias"], mlp_bias=False,
        hidden_act="silu", use_cache=False, attn_implementation="sdpa")
    # Made in its final dtype (an 8B model built in fp32 first would hold 32 GB more).
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.float32)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(hf_cfg)
    finally:
        torch.set_default_dtype(default)
    model.train()
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "sdpa":
        die(f"transformers chose attention '{impl}', not 'sdpa'", prog)
    return model


def decays(name, shape):
    """shardlm decays matrices only: not the embedding, not the norms. Decided on the unwrapped
    model's names and shapes (a sharded wrapper may flatten or rename parameters)."""
    return len(shape) == 2 and "embed_tokens" not in name


def param_groups(named_params, c, decay_names=None):
    """AdamW's two groups. named_params: (name, parameter) pairs; decay_names: the names that
    decay (default: decided from these parameters' own shapes)."""
    decay, no_decay = [], []
    for name, p in named_params:
        d = name in decay_names if decay_names is not None else decays(name, p.shape)
        (decay if d else no_decay).append(p)
    return [{"params": decay, "weight_decay": c["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0}]


def load_corpus(c, prog="torch_peer"):
    """The corpus as a tensor of byte tokens, and how many whole (T + 1)-token windows it holds."""
    import torch
    T = c["seq_len"]
    with open(c["data"], "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    windows = (len(data) - 1) // T
    if windows < 1:
        die(f"{c['data']}: {len(data)} bytes, fewer than one window of {T + 1}", prog)
    return data, windows


def batch_at(data, windows, T, first_row, B):
    """Rows first_row .. first_row + B - 1 of the contiguous windows (wrapping): inputs and
    targets, each [B, T]."""
    import torch
    starts = [((first_row + i) % windows) * T for i in range(B)]
    batch = torch.stack([data[s:s + T + 1] for s in starts])  # [B, T+1]
    return batch[:, :-1], batch[:, 1:]


def peak_rss_bytes():
    """This process's peak resident set size (getrusage ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes():
    """This process's resident set size now (/proc/self/statm; 0 where it is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="shardlm JSON config (model, data, train)")
    ap.add_argument("--steps", type=int, default=0, help="optimizer steps (default: max_steps)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where to train (cuda: fp32 weights, fused AdamW)")
    ap.add_argument("--bf16-autocast", action="store_true",
                    help="run forward and backward under torch.autocast(bfloat16)")
    args = ap.parse_args()

    c = load_config(args.config)
    steps = args.steps or c["max_steps"]
    if steps <= WARMUP_STEPS:
        die(f"--steps/train.max_steps must exceed the {WARMUP_STEPS} warm-up steps, got {steps}")
    m, T, B, accum = c["model"], c["seq_len"], c["micro_batch"], c["grad_accum"]
    torch, transformers = import_torch()
    import torch.nn.functional as F

    torch.set_num_threads(args.threads)
    torch.manual_seed(c["seed"])
    dev = args.device
    torch_gemm = gemm_flops(torch, device=dev)  # before training, as shardlm measures at start-up

    data, windows = load_corpus(c)
    rows = steps * accum * B
    model = build_model(c).to(dev)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(param_groups(model.named_parameters(), c), lr=c["lr"],
                            betas=c["betas"], eps=c["eps"], **({"fused": True} if dev == "cuda" else {}))
    autocast = torch.autocast(dev, dtype=torch.bfloat16, enabled=args.bf16_autocast)

    print(f"torch_peer: torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.threads} threads, {params / 1e6:.2f}M parameters, {steps} steps of "
          f"{accum} x {B} x {T} tokens", file=sys.stderr)

    step_s, losses, row = [], [], 0
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for _ in range(accum):
            x, y = batch_at(data, windows, T, row, B)  # [B, T] each
            x, y = x.to(dev), y.to(dev)
            row += B
            with autocast:
                logits = model(input_ids=x).logits  # [B, T, V]
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
            (loss / accum).backward()
            loss_sum += loss.item()
        if c["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c["grad_clip"])
        for g in opt.param_groups:
            g["lr"] = lr_at(c, step, steps)
        opt.step()
        if dev == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        step_s.append(dt)
        losses.append(loss_sum / accum)
        print(f"torch_peer: step {step}/{steps} | loss {losses[-1]:.4f} | {dt * 1e3:.0f} ms | "
              f"{accum * B * T / dt:.0f} tok/s", file=sys.stderr)

    timed = step_s[WARMUP_STEPS:]
    tokens_per_step = accum * B * T
    med = statistics.median(timed)
    print(json.dumps({
        "engine": "pytorch",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": args.threads,
        "params": params,
        "steps": steps,
        "timed_steps": len(timed),
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": tokens_per_step / med,
        "tokens_per_s_mean": tokens_per_step * len(timed) / sum(timed),
        "tokens_per_s_best": tokens_per_step / min(timed),
        "step_ms": med * 1e3,
        "flops_per_token": train_flops_per_token(m, T),
        "step_ms_best": min(timed) * 1e3,
        "torch_gemm_flops": torch_gemm,
        "final_loss": losses[-1],
        "peak_rss_bytes": peak_rss_bytes(),
        "device": dev,
        "bf16_autocast": args.bf16_autocast,
        "cuda_peak_bytes": torch.cuda.max_memory_allocated() if dev == "cuda" else 0,
        "rows_seen": rows,
    }))


if __name__ == "__main__":
    main()
