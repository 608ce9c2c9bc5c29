#!/usr/bin/env python3
"""Reads one bench/zero.sh run (its manifest.tsv and each run's files) and prints the markdown
table: one row per system x ZeRO stage (x variant) x ranks. Computes nothing it could measure.

shardlm rows: step ms = median of metrics.jsonl's step_ms over steps 3.. (rank 0's step, which
waits for every rank's collectives); peak RSS = each rank's `/usr/bin/time -v` maximum resident
set size; device / host pool = each rank's memory_rank{R}.json peak_bytes. Any other *_ms field
of the step records (communication waits, when shardlm writes them) gets a column of medians.
Peer rows: the peer's JSON line (rank 0's median step over steps 3.., every rank's ru_maxrss).

Usage: zero_report.py --manifest bench/results/zero/manifest.tsv --config CONFIG
                      [--load-before LOADAVG]
"""

import argparse
import csv
import json
import os
import re
import statistics
import subprocess

SKIP_STEPS = 2  # steps 1-2 warm up allocators, caches and connections (the peers skip 2 too)
MIB = 1 << 20
LABELS = {
    ("shardlm", ""): "shardlm",
    ("pytorch", "ddp"): "PyTorch DDP",
    ("pytorch", "no_shard"): "PyTorch FSDP NO_SHARD",
    ("pytorch", "zero1"): "PyTorch DDP + ZeroRedundancyOptimizer",
    ("pytorch", "shard_grad_op"): "PyTorch FSDP SHARD_GRAD_OP",
    ("pytorch", "full_shard"): "PyTorch FSDP FULL_SHARD",
}
SYSTEM_ORDER = {"shardlm": 0, "pytorch": 1, "deepspeed": 2}


def per_rank(values, scale=MIB):
    return " / ".join(f"{v / scale:.0f}" for v in values) if values else "—"


def max_rss_bytes(path):
    try:
        with open(path) as f:
            m = re.search(r"Maximum resident set size \(kbytes\):\s*(\d+)", f.read())
    except OSError:
        return None
    return int(m.group(1)) * 1024 if m else None


def shardlm_row(run_dir, n):
    steps = []
    with open(os.path.join(run_dir, "run", "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            if "step_ms" in rec and rec["step"] > SKIP_STEPS:
                steps.append(rec)
    if not steps:
        raise ValueError(f"{run_dir}/run/metrics.jsonl has no step after step {SKIP_STEPS}")
    extra = sorted({k for r in steps for k in r if k.endswith("_ms") and k != "step_ms"})
    rss, dev, host = [], [], []
    for r in range(n):
        rss.append(max_rss_bytes(os.path.join(run_dir, f"time.rank.{r}")))
        with open(os.path.join(run_dir, "run", f"memory_rank{r}.json")) as f:
            peak = json.load(f)["peak_bytes"]
        dev.append(peak["device"])
        host.append(peak["host"])
    return {
        "step_ms": statistics.median(r["step_ms"] for r in steps),
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
        "rss": None if None in rss else rss,
        "device": dev,
        "host": host,
        "extra": {k: statistics.median(r[k] for r in steps if k in r) for k in extra},
    }


def peer_row(run_dir):
    with open(os.path.join(run_dir, "peer.json")) as f:
        lines = [ln for ln in f.read().splitlines() if ln.startswith("{")]
    if not lines:
        raise ValueError(f"{run_dir}/peer.json holds no JSON line")
    p = json.loads(lines[-1])
    return {
        "step_ms": p["step_ms"],
        "tokens_per_s": p["tokens_per_s"],
        "rss": p["peak_rss_bytes_per_rank"],
        "base": p["base_rss_bytes_per_rank"],
        "peer": p,
    }


def machine():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = re.search(r"^Model name:\s*(.+)$", out, re.M)
        model = model.group(1).strip() if model else "unknown CPU"
    except (OSError, subprocess.CalledProcessError):
        model = "unknown CPU"
    return model, os.cpu_count()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--manifest", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--load-before", default="unknown")
    args = ap.parse_args()

    with open(args.manifest) as f:
        runs = list(csv.DictReader(f, delimiter="\t"))
    with open(args.config) as f:
        cfg = json.load(f)
    rows, extra_keys, versions = [], [], {}
    for run in runs:
        n, stage = int(run["ranks"]), int(run["stage"])
        system, variant = run["system"], run["variant"]
        label = LABELS.get((system, variant if system != "shardlm" else ""))
        if label is None:
            label = "DeepSpeed ZeRO" if system == "deepspeed" else system
        if system == "shardlm" and variant:
            label += f" ({variant.replace('-', ' ')})"
        if system == "deepspeed" and variant.endswith("+offload"):
            label += " (offload, DeepSpeedCPUAdam)"
        row = {"label": label, "stage": stage, "n": n, "system": system, "variant": variant,
               "status": run["status"], "data": None}
        if run["status"] == "ok":
            try:
                row["data"] = (shardlm_row(run["dir"], n) if system == "shardlm"
                               else peer_row(run["dir"]))
            except (OSError, ValueError, KeyError, json.JSONDecodeError) as e:
                row["status"] = f"no report ({e.__class__.__name__})"
        if row["data"] is not None:
            for k in row["data"].get("extra", {}):
                if k not in extra_keys:
                    extra_keys.append(k)
            if "peer" in row["data"]:
                p = row["data"]["peer"]
                versions["torch"] = p.get("torch")
                versions["transformers"] = p.get("transformers")
                if "deepspeed" in p:
                    versions["deepspeed"] = p["deepspeed"]
        rows.append(row)
    rows.sort(key=lambda r: (r["n"], r["stage"], SYSTEM_ORDER.get(r["system"], 9)))

    m, tr, data = cfg["model"], cfg["train"], cfg["data"]
    cpu, cores = machine()
    head = ["system", "ZeRO stage", "ranks", "step ms", "tokens/s",
            "peak RSS MiB per rank", "peer RSS before model MiB", "shardlm device pool MiB",
            "shardlm host pool MiB"] + [f"shardlm {k} (median)" for k in extra_keys]
    lines = [
        f"machine: {cpu}, {cores} cores; one thread per rank; load average before: "
        f"{args.load_before}",
        f"model: {m['n_layers']} layers, dim {m['dim']}, {m['n_heads']} heads, FFN "
        f"{m['ffn_dim']}, vocabulary {m['vocab_size']}, fp32; {tr['micro_batch']} x "
        f"{tr.get('grad_accum', 1)} x {data['seq_len']} tokens per rank per step (global batch "
        f"= that x ranks); medians over steps {SKIP_STEPS + 1}..; per-rank values rank 0 / 1 / ...",
        "peers: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v) if versions else
        "peers: none ran",
        "",
        "| " + " | ".join(head) + " |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" +
        " ---: |" * len(extra_keys),
    ]
    for r in rows:
        d = r["data"]
        if d is None:
            cells = [r["status"]] + ["—"] * (len(head) - 4)
        else:
            is_s = r["system"] == "shardlm"
            cells = [f"{d['step_ms']:.0f}", f"{d['tokens_per_s']:.0f}",
                     per_rank(d["rss"]) if d["rss"] else "—",
                     "—" if is_s else per_rank(d["base"]),
                     per_rank(d["device"]) if is_s else "—",
                     per_rank(d["host"]) if is_s else "—"]
            cells += [f"{d['extra'][k]:.1f}" if is_s and k in d["extra"] else "—"
                      for k in extra_keys]
        lines.append(f"| {r['label']} | {r['stage']} | {r['n']} | " + " | ".join(cells) + " |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
