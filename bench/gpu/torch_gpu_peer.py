#!/usr/bin/env python3
"""PyTorch peer of a shardlm GPU run (gpu-check.sh's speed phase): transformers'
LlamaForCausalLM with the shardlm config's shapes (SDPA attention), fp32 parameters, forward and
backward under bf16 autocast, fused AdamW, eager or under torch.compile; the same byte-token rows
as shardlm. Step times from CUDA events (no host synchronisation inside a step but the loss
read-back of its last micro-batch), the median over the steps after the warm-up; peak device
memory from max_memory_allocated. One JSON line; a model whose fp32 parameters, gradients and
AdamW moments (16 bytes per parameter) exceed the device is reported as not fitting, not run.

Usage: torch_gpu_peer.py --config CFG --seq-len T --micro-batch B --grad-accum A --steps N
                         [--compile] [--device cuda|cpu]"""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gpu_common import Timer, emit, import_torch, is_oom, median  # noqa: E402
from torch_peer import (batch_at, build_model, load_config, load_corpus, lr_at,  # noqa: E402
                        param_groups, train_flops_per_token)

PROG = "torch_gpu_peer"


def param_count(m):
    D, F, V, L = m["dim"], m["ffn_dim"], m["vocab_size"], m["n_layers"]
    hd = D // m["n_heads"]
    attn = D * m["n_heads"] * hd * 2 + 2 * D * m["n_kv_heads"] * hd
    head = 0 if m["tie_embeddings"] else V * D
    return L * (attn + 3 * D * F + 2 * D) + V * D + head + D


def train(torch, c, args, result):
    import torch.nn.functional as F
    dev, T, B, accum = args.device, c["seq_len"], c["micro_batch"], c["grad_accum"]
    torch.manual_seed(c["seed"])
    data, windows = load_corpus(c, PROG)
    model = build_model(c, PROG, device=dev)
    opt = torch.optim.AdamW(param_groups(model.named_parameters(), c), lr=c["lr"],
                            betas=c["betas"], eps=c["eps"], **({"fused": True} if dev == "cuda" else {}))
    forward = torch.compile(model) if args.compile else model
    if dev == "cuda":
        torch.cuda.reset_peak_memory_stats()
    timer, step_s, losses, row = Timer(torch, dev), [], [], 0
    for step in range(1, args.steps + 1):
        t0 = timer.mark()
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=dev)
        for _ in range(accum):
            x, y = batch_at(data, windows, T, row, B)  # [B, T] each
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            row += B
            with torch.autocast(dev, dtype=torch.bfloat16):
                logits = forward(input_ids=x).logits  # [B, T, V]
                loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
            (loss / accum).backward()
            loss_sum += loss.detach()
        if c["grad_clip"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c["grad_clip"])
        for g in opt.param_groups:
            g["lr"] = lr_at(c, step, args.steps)
        opt.step()
        step_s.append(timer.seconds(t0, timer.mark()))
        losses.append(float(loss_sum) / accum)
        print(f"{PROG}: step {step}/{args.steps} | loss {losses[-1]:.4f} | "
              f"{step_s[-1] * 1e3:.0f} ms", file=sys.stderr)
    timed = step_s[args.warmup:]
    tokens = accum * B * T
    result.update({
        "step_ms": median(timed) * 1e3,
        "tokens_per_s": tokens / median(timed),
        "timed_steps": len(timed),
        "losses": losses,
        "peak_device_bytes": torch.cuda.max_memory_allocated() if dev == "cuda" else 0,
    })


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="shardlm JSON config (model, data, train)")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--micro-batch", type=int, required=True)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=0, help="untimed steps (default: 2, compile 3)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()
    args.warmup = args.warmup or (3 if args.compile else 2)
    if args.steps <= args.warmup:
        ap.error(f"--steps must exceed the {args.warmup} warm-up steps")
    torch = import_torch(PROG, args.device)
    import transformers

    c = load_config(args.config)
    c.update(seq_len=args.seq_len, micro_batch=args.micro_batch, grad_accum=args.grad_accum)
    m = c["model"]
    params = param_count(m)
    result = {"engine": "pytorch", "mode": "compile" if args.compile else "eager",
              "torch": torch.__version__, "transformers": transformers.__version__,
              "params": params, "seq_len": args.seq_len, "micro_batch": args.micro_batch,
              "grad_accum": args.grad_accum, "steps": args.steps,
              "tokens_per_step": args.grad_accum * args.micro_batch * args.seq_len,
              "flops_per_token": train_flops_per_token(m, args.seq_len)}
    if args.device == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        if 16 * params > total:
            result["skipped"] = (f"does not fit: {params / 1e9:.2f}B parameters x 16 bytes (fp32 "
                                 f"weights, gradients, AdamW m and v) = {16 * params / 2**30:.0f} "
                                 f"GiB > {total / 2**30:.0f} GiB")
            emit(result)
            return
    try:
        train(torch, c, args, result)
    except Exception as e:  # noqa: BLE001  (an OOM is a result; anything else is re-raised)
        if not is_oom(torch, e):
            raise
        result["oom"] = str(e).splitlines()[0]
    emit(result)


if __name__ == "__main__":
    main()
