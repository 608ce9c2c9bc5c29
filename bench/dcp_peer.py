#!/usr/bin/env python3
"""PyTorch Distributed Checkpoint (torch.distributed.checkpoint) on the same state as
bench/checkpoint.sh: the 6-layer bench model's f32 parameters, Adam m and v, every rank holding
1/N of each flat vector (as ZeRO does), saved into one directory by N CPU processes (gloo) with
dcp.save and dcp.async_save, then loaded back with dcp.load. Prints one line per N: seconds and
MiB/s of the save, of the async save's blocking part (what training loses) and of its whole,
and of the load; then the training time a save costs: 24 stand-in training steps (matrix
products of the model's per-rank arithmetic at 128 tokens, one all-reduce each) with dcp.save or
dcp.async_save after steps 8 and 16, measured as bench/checkpoint_lost.py does for shardlm.
Usage: dcp_peer.py OUT_DIR [N ...]"""
import os
import shutil
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

# bench/configs/cpu_6l_512.json: dim 512, 6 layers, ffn 1536, vocab 320, untied.
DIM, LAYERS, FFN, VOCAB = 512, 6, 1536, 320
PARAMS = 2 * VOCAB * DIM + DIM + LAYERS * (2 * DIM + 4 * DIM * DIM + 3 * DIM * FFN)


def state_of(rank, world):
    n = (PARAMS + world - 1) // world
    n = min(n, PARAMS - rank * n)
    g = torch.Generator().manual_seed(rank)
    # Distinct keys per rank: every rank writes its own shard, as shardlm's ranks do.
    return {f"{name}.rank{rank}": torch.randn(n, generator=g) for name in ("params", "m", "v")}


# One stand-in training step on a rank: 6 x parameters x 128 tokens of matrix products (forward
# and backward of the bench model at micro_batch 1, seq_len 128), then an all-reduce.
WEIGHT = torch.randn(DIM, FFN)
ACTS = torch.randn(128, DIM)
PRODUCTS = round(6 * PARAMS * 128 / (2 * 128 * DIM * FFN))


def train_step(state):
    for _ in range(PRODUCTS):
        torch.mm(ACTS, WEIGHT)
    for t in state.values():  # the optimizer's update: the state changes every step
        t.add_(1e-3)
    dist.all_reduce(torch.zeros(1))


# 24 steps; kind "save" / "async": dcp.save / dcp.async_save after steps 8 and 16 (a save waits
# for the one before it, the last is waited for at the end, as shardlm's). Returns the seconds
# training was blocked (the save calls, the waits on the futures) and each step's seconds.
def train_with_saves(kind, state, out):
    if dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)
    # The saves' collectives on a group of their own: async_save's thread would otherwise
    # interleave them with the steps' all-reduces (a deadlock on gloo), as DCP's docs advise.
    group = dist.new_group(backend="gloo")
    dist.barrier()
    fut, blocked, steps = None, 0.0, []
    for step in range(1, 25):
        t0 = time.perf_counter()
        train_step(state)
        steps.append(time.perf_counter() - t0)
        if step not in (8, 16):
            continue
        t0 = time.perf_counter()
        if fut is not None:
            fut.result()
        path = os.path.join(out, f"{kind}_step{step}")
        if kind == "save":
            dcp.save(state, checkpoint_id=path, process_group=group)
        else:
            fut = dcp.async_save(state, checkpoint_id=path, process_group=group)
        blocked += time.perf_counter() - t0
    t0 = time.perf_counter()
    if fut is not None:
        fut.result()
    blocked += time.perf_counter() - t0
    dist.barrier()
    return blocked, steps


# As bench/checkpoint_lost.py: per save, blocked + the steps after the first save over the
# median step before it (step 1 left out).
def lost_line(blocked, steps):
    base = statistics.median(steps[1:8])
    slowdown = sum(t - base for t in steps[8:])
    return (f"step {base:.3f} s; per save: blocked {blocked / 2:.3f} s + slower steps "
            f"{slowdown / 2:.3f} s = lost {(blocked + slowdown) / 2:.3f} s")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(rank, world, out, results, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = state_of(rank, world)
    times = {}
    for kind in ("save", "async"):
        path = os.path.join(out, f"{kind}_n{world}")
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        t0 = time.perf_counter()
        if kind == "save":
            dcp.save(state, checkpoint_id=path)
        else:
            fut = dcp.async_save(state, checkpoint_id=path)
            times["async_blocking"] = time.perf_counter() - t0
            fut.result()
        dist.barrier()
        times[kind] = time.perf_counter() - t0
    work = {k: v.clone() for k, v in state.items()}  # trained on; `state` is what was saved
    for kind in ("save", "async"):
        times[f"train_{kind}"] = train_with_saves(kind, work, os.path.join(out, f"lost_n{world}"))
    loaded = {k: torch.empty_like(v) for k, v in state.items()}
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(loaded, checkpoint_id=os.path.join(out, f"save_n{world}"))
    dist.barrier()
    times["load"] = time.perf_counter() - t0
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    if rank == 0:
        results.put(times)
    dist.destroy_process_group()


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    mib = PARAMS * 4 * 3 / (1 << 20)
    print(f"state: {PARAMS} parameters, f32 params + m + v = {mib:.1f} MiB")
    for world in [int(a) for a in sys.argv[2:]] or [1, 2, 4]:
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        mp.spawn(worker, args=(world, out, results, free_port()), nprocs=world, join=True)
        t = results.get()
        print(
            f"dcp N={world}: save {t['save']:.3f} s ({mib / t['save']:.0f} MiB/s); async_save "
            f"blocks {t['async_blocking']:.3f} s, done in {t['async']:.3f} s; load {t['load']:.3f} s "
            f"({mib / t['load']:.0f} MiB/s)")
        for kind, name in (("save", "save"), ("async", "async_save")):
            print(f"dcp N={world} {name}: " + lost_line(*t[f"train_{kind}"]))


if __name__ == "__main__":
    main()
