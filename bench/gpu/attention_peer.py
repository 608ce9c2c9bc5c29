#!/usr/bin/env python3
"""PyTorch's side of gpu-check.sh's attention table: scaled_dot_product_attention forward and
backward, causal, bf16, grouped-query, with one SDPA backend forced (flash, cudnn; math on the
CPU for the smoke test), timed per sequence length with CUDA events, the same shapes and FLOP
count as shardlm-bench-attention. One JSON line per length; a backend that refuses a shape
reports why instead of falling back to another.

Usage: attention_peer.py --backend flash|cudnn|math [--seq 8192,16384] [--heads 32]
                         [--kv-heads 8] [--head-dim 128] [--reps 5] [--device cuda|cpu]"""

import argparse

from gpu_common import Timer, emit, import_torch, is_oom, median

PROG = "attention_peer"


def sdpa_call(F, backend, q, k, v, native_gqa):
    """out = SDPA(q, k, v) under the forced backend: GQA through enable_gqa, or with k and v
    repeated per query head where the backend does not take it (noted in the result)."""
    from torch.nn.attention import sdpa_kernel
    with sdpa_kernel([backend]):
        if native_gqa:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        rep = q.size(1) // k.size(1)
        k2, v2 = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, k2, v2, is_causal=True)


def time_length(torch, F, args, backend, T):
    dev, dt = args.device, torch.bfloat16 if args.device == "cuda" else torch.float32
    # SDPA's layout [B, H, T, Dh]; N(0, 1) data, never zeros.
    q = torch.randn(1, args.heads, T, args.head_dim, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, args.kv_heads, T, args.head_dim, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(1, args.kv_heads, T, args.head_dim, device=dev, dtype=dt, requires_grad=True)
    dout = torch.randn(1, args.heads, T, args.head_dim, device=dev, dtype=dt)
    native = True
    try:  # the warm-up pass decides how GQA is run
        sdpa_call(F, backend, q, k, v, True).backward(dout)
    except RuntimeError as e:
        if is_oom(torch, e):
            raise
        native = False
    timer, fwd, bwd = Timer(torch, dev), [], []
    for rep in range(args.reps + 1):  # rep 0 warms up
        q.grad = k.grad = v.grad = None
        t0 = timer.mark()
        out = sdpa_call(F, backend, q, k, v, native)
        t1 = timer.mark()
        out.backward(dout)
        t2 = timer.mark()
        if rep:
            fwd.append(timer.seconds(t0, t1))
            bwd.append(timer.seconds(t1, t2))
    return median(fwd), median(bwd), "native" if native else "repeated k, v"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("flash", "cudnn", "math"), required=True)
    ap.add_argument("--seq", default="8192,16384,32768,65536,131072")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()
    torch = import_torch(PROG, args.device)
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend
    backend = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
               "math": SDPBackend.MATH}[args.backend]
    for T in (int(s) for s in args.seq.split(",")):
        row = {"engine": f"pytorch sdpa {args.backend}", "T": T, "heads": args.heads,
               "kv_heads": args.kv_heads, "head_dim": args.head_dim}
        try:
            f, b, gqa = time_length(torch, F, args, backend, T)
        except RuntimeError as e:  # a backend that refuses the shape, or memory
            row["skipped" if not is_oom(torch, e) else "oom"] = str(e).splitlines()[0][:200]
            emit(row)
            continue
        flops = 4.0 * T * T * args.head_dim * args.heads / 2.0  # causal forward, FA's count
        row.update(gqa=gqa, forward_ms=f * 1e3, backward_ms=b * 1e3,
                   forward_tflops=flops / f / 1e12, fwd_bwd_tflops=3.5 * flops / (f + b) / 1e12)
        emit(row)
        if args.device == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
