#!/usr/bin/env python3
"""PyTorch peer of a shardlm CPU run: the same Llama shapes, batch and tokens, trained eagerly in
fp32 with torch.optim.AdamW, timed per step. Reads the shardlm JSON config so that the shapes
cannot drift apart; prints one JSON line on stdout (progress goes to stderr). Not a test.

Usage: torch_peer.py --config bench/configs/cpu_6l_512.json [--steps N] [--threads N]
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


def die(msg):
    print(f"torch_peer: {msg}", file=sys.stderr)
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


def gemm_flops(torch, n=1024, reps=10):
    """Best of `reps` n^3 sgemms: shardlm's measure_gemm_flops takes best of three; more tries
    here make the reference rate less sensitive to other work on the machine."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = max(best, 2.0 * n**3 / (time.perf_counter() - t0))
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="shardlm JSON config (model, data, train)")
    ap.add_argument("--steps", type=int, default=0, help="optimizer steps (default: max_steps)")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
    args = ap.parse_args()

    c = load_config(args.config)
    steps = args.steps or c["max_steps"]
    if steps <= WARMUP_STEPS:
        die(f"--steps/train.max_steps must exceed the {WARMUP_STEPS} warm-up steps, got {steps}")
    m, T, B, accum = c["model"], c["seq_len"], c["micro_batch"], c["grad_accum"]
    if m["vocab_size"] < 256:
        die(f"model.vocab_size {m['vocab_size']} cannot hold byte tokens (needs >= 256)")

    try:
        import torch
        import torch.nn.functional as F
    except ImportError as e:
        die(f"PyTorch is not importable ({e}); run bench/run.sh, which installs it in a venv")
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        die(f"transformers is not importable ({e}); the peer needs its LlamaForCausalLM "
            "(pip install transformers); it does not fall back to another model")

    torch.set_num_threads(args.threads)
    torch.manual_seed(c["seed"])
    torch_gemm = gemm_flops(torch)  # before training, as shardlm measures at start-up

    with open(c["data"], "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    rows = steps * accum * B
    windows = (len(data) - 1) // T
    if windows < 1:
        die(f"{c['data']}: {len(data)} bytes, fewer than one window of {T + 1}")

    hf_cfg = LlamaConfig(
        vocab_size=m["vocab_size"], hidden_size=m["dim"], intermediate_size=m["ffn_dim"],
        num_hidden_layers=m["n_layers"], num_attention_heads=m["n_heads"],
        num_key_value_heads=m["n_kv_heads"], max_position_embeddings=T,
        rms_norm_eps=m["norm_eps"], rope_theta=m["rope_theta"],
        tie_word_embeddings=m["tie_embeddings"], attention_bias=m["attn_bias"], mlp_bias=False,
        hidden_act="silu", use_cache=False, attn_implementation="sdpa")
    model = LlamaForCausalLM(hf_cfg).to(torch.float32)
    model.train()
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != "sdpa":
        die(f"transformers chose attention '{impl}', not 'sdpa'")
    params = sum(p.numel() for p in model.parameters())

    # shardlm decays matrices only: not the embedding, not the norms.
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() == 2 and "embed_tokens" not in name else no_decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": c["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=c["lr"], betas=c["betas"], eps=c["eps"])

    print(f"torch_peer: torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{args.threads} threads, {params / 1e6:.2f}M parameters, {steps} steps of "
          f"{accum} x {B} x {T} tokens", file=sys.stderr)

    step_s, losses, row = [], [], 0
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_sum = 0.0
        for _ in range(accum):
            starts = [((row + i) % windows) * T for i in range(B)]
            row += B
            batch = torch.stack([data[s:s + T + 1] for s in starts])  # [B, T+1]
            x, y = batch[:, :-1], batch[:, 1:]  # [B, T]
            logits = model(input_ids=x).logits  # [B, T, V]
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
            (loss / accum).backward()
            loss_sum += loss.item()
        if c["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c["grad_clip"])
        for g in opt.param_groups:
            g["lr"] = lr_at(c, step, steps)
        opt.step()
        dt = time.perf_counter() - t0
        step_s.append(dt)
        losses.append(loss_sum / accum)
        print(f"torch_peer: step {step}/{steps} | loss {losses[-1]:.4f} | {dt * 1e3:.0f} ms | "
              f"{accum * B * T / dt:.0f} tok/s", file=sys.stderr)

    timed = step_s[WARMUP_STEPS:]
    tokens_per_step = accum * B * T
    med = statistics.median(timed)
    peak_rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
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
        "peak_rss_bytes": peak_rss_kib * 1024,
        "rows_seen": rows,
    }))


if __name__ == "__main__":
    main()
