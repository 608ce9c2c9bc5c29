#!/usr/bin/env python3
"""PyTorch Distributed Checkpoint (torch.distributed.checkpoint) on the same state as
bench/checkpoint.sh: the 6-layer bench model's f32 parameters, Adam m and v, every rank holding
1/N of each flat vector (as ZeRO does), saved into one directory by N CPU processes (gloo) with
dcp.save and dcp.async_save, then loaded back with dcp.load. Prints one line per N: seconds and
MiB/s of the save, of the async save's blocking part (what training loses) and of its whole,
and of the load. Usage: dcp_peer.py OUT_DIR [N ...]"""
import os
import shutil
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


def worker(rank, world, out, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
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
        mp.spawn(worker, args=(world, out, results), nprocs=world, join=True)
        t = results.get()
        print(
            f"dcp N={world}: save {t['save']:.3f} s ({mib / t['save']:.0f} MiB/s); async_save "
            f"blocks {t['async_blocking']:.3f} s, done in {t['async']:.3f} s; load {t['load']:.3f} s "
            f"({mib / t['load']:.0f} MiB/s)")


if __name__ == "__main__":
    main()
