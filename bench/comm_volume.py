#!/usr/bin/env python3
"""Context parallelism's communication, analytically: the bytes one rank sends per decoder layer
in one training step (forward and backward) for ulysses, ring and hybrid at sequence length T
over cp ranks, for a shardlm config's shapes. Prints a markdown table with an empty "measured"
column for the engine's own count. Needs no torch. Not a test.

Usage: comm_volume.py --config bench/configs/long_context.json --seq-len 16384 --cp 4
           [--cp-ulysses 2] [--measured KIND=RUN_DIR ...]

--measured fills the last column from a run's metrics.jsonl: `cp_bytes_sent` of its first step
(rank 0's bytes; one micro-batch per step) divided by the layers. shardlm's Ulysses backward
gathers q, k, v, out and dout again instead of keeping the forward's gathered copies (it holds
no per-layer state: memory for communication), so its backward sends 8 tensors' worth, not 4.

With B sequences per rank group (train.micro_batch), H query heads, K kv heads of Dh, s bytes an
element (precision.param), every rank holds its T/cp positions: q and the attention output are
[B, T/cp, H, Dh], k and v [B, T/cp, K, Dh].

- ulysses (all-to-all over all cp ranks): forward 4 all-to-alls (q, k, v in: positions ->
  heads; the output back: heads -> positions), each sending (cp-1)/cp of the local tensor;
  backward their adjoints (dout in, dq, dk, dv back), the same sizes. With K < cp the kv heads
  are repeated to cp first (each rank needs one), so k and v count max(K, cp) heads.
- ring (k, v blocks passed around cp ranks): forward cp-1 sends of the local k and v block;
  backward k and v go around again (cp-1 sends) and dk, dv travel the whole ring back to their
  owner (cp sends), counted at s bytes (an engine accumulating them in f32 with bf16 parameters
  sends twice that).
- hybrid (ulysses inside groups of u = cp_ulysses ranks, ring across r = cp/u groups): the
  ulysses all-to-alls within a group ((u-1)/u of the local tensors, kv heads repeated to u), then
  a ring of r steps on blocks of [B, T/r, max(K, u)/u, Dh]: the same bytes as the local block.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_peer as tp  # noqa: E402  (the shared config reader; imports no torch itself)

PROG = "comm_volume"


def ulysses_bytes(q, kv, u):
    """(forward, backward) bytes per rank of the four all-to-alls over u ranks; q and kv are
    the local tensors' bytes (kv with its heads already repeated to u where needed)."""
    fwd = (u - 1) / u * (2 * q + 2 * kv)  # q, k, v in; the output back
    return fwd, fwd  # the adjoint all-to-alls move the same bytes


def ring_bytes(kv, r):
    """(forward, backward) bytes per rank of a ring of r ranks passing k and v blocks of kv
    bytes each."""
    return (r - 1) * 2 * kv, (r - 1) * 2 * kv + r * 2 * kv  # backward: k, v; then dk, dv home


def volumes(m, T, cp, u, B, s):
    """{kind: (forward, backward)} bytes per rank per layer; kinds that cannot run are absent."""
    H, K = m["n_heads"], m["n_kv_heads"]
    Dh = m["dim"] // H
    local = B * (T // cp) * Dh * s  # bytes of one head's local slice
    out = {}
    if H % cp == 0:
        out["ulysses"] = ulysses_bytes(H * local, max(K, cp) * local, cp)
    out["ring"] = ring_bytes(K * local, cp)
    if 1 < u < cp and cp % u == 0 and H % u == 0:
        uf, ub = ulysses_bytes(H * local, max(K, u) * local, u)
        rf, rb = ring_bytes(max(K, u) * local, cp // u)
        out[f"hybrid (cp_ulysses={u})"] = (uf + rf, ub + rb)
    return out


def mib(b):
    return f"{b / 2**20:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True, help="shardlm JSON config (model, data, train)")
    ap.add_argument("--seq-len", type=int, required=True, help="T: the whole sequence's tokens")
    ap.add_argument("--cp", type=int, required=True, help="context-parallel ranks")
    ap.add_argument("--cp-ulysses", type=int, default=2, help="hybrid's all-to-all group size")
    ap.add_argument("--measured", action="append", default=[],
                    help="KIND=RUN_DIR: a shardlm run of that kind at this T and cp")
    args = ap.parse_args()
    measured = {}
    for item in args.measured:
        kind, _, run = item.partition("=")
        with open(os.path.join(run, "metrics.jsonl")) as f:
            first = json.loads(f.readline())
        if "cp_bytes_sent" not in first:
            tp.die(f"{run}/metrics.jsonl has no cp_bytes_sent (not a cp run?)", PROG)
        measured[kind] = first["cp_bytes_sent"]
    c = tp.load_config(args.config)
    m, T, cp, u = c["model"], args.seq_len, args.cp, args.cp_ulysses
    if cp < 2 or T % cp != 0:
        tp.die(f"--cp must be >= 2 and divide --seq-len (got cp {cp}, T {T})", PROG)
    with open(args.config) as f:
        s = 2 if json.load(f).get("precision", {}).get("param", "fp32") == "bf16" else 4
    B, L = c["micro_batch"], m["n_layers"]
    print(f"Context-parallel communication per rank, analytic: T = {T}, cp = {cp}, "
          f"{B} sequence(s), H = {m['n_heads']}, kv heads = {m['n_kv_heads']}, "
          f"Dh = {m['dim'] // m['n_heads']}, {s} bytes an element, {L} layers\n")
    print("| kind | forward MiB/layer | backward MiB/layer | step MiB/layer | step MiB "
          "(all layers) | measured MiB/layer (engine) |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for kind, (fwd, bwd) in volumes(m, T, cp, u, B, s).items():
        got = measured.get(kind.split(" ")[0])
        print(f"| {kind} | {mib(fwd)} | {mib(bwd)} | {mib(fwd + bwd)} | {mib(L * (fwd + bwd))} "
              f"| {mib(got / L) if got is not None else '—'} |")
    if m["n_heads"] % cp != 0:
        print(f"\nulysses needs n_heads ({m['n_heads']}) divisible by cp ({cp}): no row.")


if __name__ == "__main__":
    main()
