#!/usr/bin/env python3
"""PyTorch FSDP peer of the "max context vs ranks" benchmark: one training step (forward,
backward, clipping, AdamW) of the shardlm config's Llama shapes at sequence length T, one
sequence per rank, FSDP FULL_SHARD over gloo on CPU ranks of one thread each; rank 0 prints one
JSON line with every rank's peak resident set and its baseline. Not a test.

Activations are not sharded by FSDP (each rank holds its whole sequence's), and nothing is
recomputed: no activation checkpointing. Attention is transformers' SDPA path, held to torch's
flash kernel (memory-linear in T on CPU) when it can run, else torch's default choice (the JSON
line says which).

  python -m torch.distributed.run --standalone --nproc_per_node N bench/long_context_fsdp.py \\
      --config bench/configs/long_context.json --seq-len 4096

Memory: peak_rss_bytes is getrusage(RUSAGE_SELF).ru_maxrss at the end of the step;
base_rss_bytes is the resident set right after the imports, the gloo group, the model build,
the FSDP wrap and the optimizer's construction (before any step), so that peak - base is what
the step's tensors (activations, gradients, Adam state, gathered parameters) and the work of
running it added. pre_model_rss_bytes (before the model exists) is recorded too.
"""

import argparse
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_peer as tp  # noqa: E402  (the shared config reader, model and data)
import fsdp_peer  # noqa: E402  (the FSDP wrapping and optimizer groups of the ZeRO benchmark)

PROG = "long_context_fsdp"


def flash_attention(torch):
    """A context holding SDPA to torch's flash kernel and the name "flash", when that kernel runs
    a small causal attention here (forward and backward); else a null context and "default"."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        q = torch.randn(1, 2, 8, 4, requires_grad=True)  # [B, H, T, Dh]
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
            out.sum().backward()
    except (ImportError, RuntimeError) as e:
        print(f"{PROG}: the flash SDPA kernel is unavailable ({str(e).splitlines()[0]}); using "
              "torch's default choice", file=sys.stderr)
        return contextlib.nullcontext(), "default"
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION]), "flash"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="shardlm JSON config (model, data, train)")
    ap.add_argument("--seq-len", type=int, required=True, help="tokens per rank's sequence")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    args = ap.parse_args()
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            tp.die(f"${var} is not set: launch through torchrun (python -m "
                   "torch.distributed.run --standalone --nproc_per_node N "
                   f"{sys.argv[0]} ...)", PROG)
    if args.seq_len < 1:
        tp.die(f"--seq-len must be >= 1, got {args.seq_len}", PROG)

    c = tp.load_config(args.config)
    c["seq_len"] = T = args.seq_len  # also the model's max_position_embeddings
    torch, transformers = tp.import_torch(PROG)
    import torch.distributed as dist
    import torch.nn.functional as F
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data, windows = tp.load_corpus(c, PROG)
    pre_model_rss = tp.current_rss_bytes()

    torch.manual_seed(c["seed"])
    model = tp.build_model(c, PROG)
    params = sum(p.numel() for p in model.parameters())
    all_names = {n for n, _ in model.named_parameters()}
    decay_names = {n for n, p in model.named_parameters() if tp.decays(n, p.shape)}
    model = fsdp_peer.wrap_fsdp(torch, model, "full_shard")
    die = lambda msg: tp.die(msg, PROG)  # noqa: E731
    opt = torch.optim.AdamW(fsdp_peer.fsdp_param_groups(model, c, all_names, decay_names, die),
                            lr=c["lr"], betas=c["betas"], eps=c["eps"])
    x, y = tp.batch_at(data, windows, T, rank, 1)  # [1, T] each: rank r takes row r
    del data
    attention, kernel = flash_attention(torch)
    base_rss = tp.current_rss_bytes()

    t0 = time.perf_counter()
    with attention:
        logits = model(input_ids=x).logits  # [1, T, V]
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        del logits
        loss.backward()
    if c["grad_clip"] > 0:
        model.clip_grad_norm_(c["grad_clip"])
    for g in opt.param_groups:
        g["lr"] = tp.lr_at(c, 1, max(c["max_steps"], 1))
    opt.step()
    step_s = time.perf_counter() - t0

    mine = {"peak_rss_bytes": tp.peak_rss_bytes(), "base_rss_bytes": base_rss,
            "pre_model_rss_bytes": pre_model_rss, "step_s": step_s, "loss": loss.item()}
    every = [None] * world
    dist.all_gather_object(every, mine)
    if rank == 0:
        deltas = [r["peak_rss_bytes"] - r["base_rss_bytes"] for r in every]
        print(json.dumps({
            "engine": "pytorch-fsdp",
            "strategy": "full_shard",
            "activation_checkpointing": False,
            "attention": f"sdpa/{kernel}",
            "world_size": world,
            "threads_per_rank": args.threads,
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "params": params,
            "seq_len": T,
            "sequences_per_rank": 1,
            "peak_rss_bytes_per_rank": [r["peak_rss_bytes"] for r in every],
            "base_rss_bytes_per_rank": [r["base_rss_bytes"] for r in every],
            "pre_model_rss_bytes_per_rank": [r["pre_model_rss_bytes"] for r in every],
            "step_delta_bytes_per_rank": deltas,
            "max_step_delta_bytes": max(deltas),
            "step_s_per_rank": [r["step_s"] for r in every],
            "loss_per_rank": [r["loss"] for r in every],
        }), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
