#!/usr/bin/env python3
"""Reads one bench/run.sh run (shardlm's run directory, the PyTorch peer's JSON line and both
`/usr/bin/time -v` reports) and prints the markdown table. Computes nothing it could measure;
MFU uses one formula (the peer's copy of train_flops_per_token) for both engines.

Usage: cpu_report.py --run-dir DIR --peer-json FILE --shardlm-time FILE --peer-time FILE
                     [--load-before LOADAVG]
"""

import argparse
import json
import re
import statistics
import subprocess
import sys

SKIP_STEPS = 2  # steps 1-2 warm up allocators, threads and caches


def max_rss_bytes(time_report):
    with open(time_report) as f:
        m = re.search(r"Maximum resident set size \(kbytes\):\s*(\d+)", f.read())
    if not m:
        sys.exit(f"cpu_report: {time_report} has no 'Maximum resident set size' line "
                 "(was it written by /usr/bin/time -v?)")
    return int(m.group(1)) * 1024


def machine():
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = re.search(r"^Model name:\s*(.+)$", out, re.M)
        model = model.group(1).strip() if model else "unknown CPU"
    except (OSError, subprocess.CalledProcessError):
        model = "unknown CPU"
    cores = subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    return model, cores


def main():
    ap = argparse.ArgumentParser()
    for a in ("--run-dir", "--peer-json", "--shardlm-time", "--peer-time"):
        ap.add_argument(a, required=True)
    ap.add_argument("--load-before", default="unknown", help="/proc/loadavg before the runs")
    args = ap.parse_args()

    with open(f"{args.run_dir}/summary.json") as f:
        summary = json.load(f)
    steps = []
    with open(f"{args.run_dir}/metrics.jsonl") as f:
        for line in f:
            rec = json.loads(line)
            if "tokens_per_s" in rec and rec["step"] > SKIP_STEPS:
                steps.append(rec)
    if not steps:
        sys.exit(f"cpu_report: {args.run_dir}/metrics.jsonl has no step after step {SKIP_STEPS}; "
                 "raise train.max_steps")
    with open(args.peer_json) as f:
        peer = json.loads(f.read().strip().splitlines()[-1])

    gemm = summary["gemm_flops"]
    fpt = peer["flops_per_token"]  # same config file, same formula as layout.cpp
    s_tok = statistics.median(r["tokens_per_s"] for r in steps)
    s_ms = statistics.median(r["step_ms"] for r in steps)
    s_best = max(r["tokens_per_s"] for r in steps)
    s_rss = max_rss_bytes(args.shardlm_time)
    p_tok, p_ms, p_best = peer["tokens_per_s"], peer["step_ms"], peer["tokens_per_s_best"]
    p_rss = max_rss_bytes(args.peer_time)
    cpu, cores = machine()
    mib = 1 << 20

    lines = [
        f"machine: {cpu}, {cores} cores; sgemm (shardlm, 1024^3, best of 3): "
        f"{gemm / 1e9:.1f} GFLOP/s; torch sgemm (same shape, best of 10): "
        f"{peer['torch_gemm_flops'] / 1e9:.1f} GFLOP/s; load average before: {args.load_before}",
        f"model: {summary['parameters'] / 1e6:.2f}M parameters (torch: {peer['params'] / 1e6:.2f}M), "
        f"{fpt / 1e6:.1f} MFLOP per trained token; batch {peer['tokens_per_step']} tokens per "
        f"step; medians over steps {SKIP_STEPS + 1}..{summary['steps']}",
        "",
        "| engine | tokens/s | step ms | MFU (of sgemm) | best-step tokens/s | max RSS MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        f"| shardlm | {s_tok:.0f} | {s_ms:.0f} | {100 * fpt * s_tok / gemm:.1f}% | {s_best:.0f} | "
        f"{s_rss / mib:.0f} |",
        f"| PyTorch {peer['torch']} eager fp32 (transformers {peer['transformers']}, sdpa) | "
        f"{p_tok:.0f} | {p_ms:.0f} | {100 * fpt * p_tok / gemm:.1f}% | {p_best:.0f} | "
        f"{p_rss / mib:.0f} |",
        "",
        f"shardlm / PyTorch: {s_tok / p_tok:.2f}x tokens/s (median), {s_best / p_best:.2f}x "
        f"(best step), {s_rss / p_rss:.2f}x max RSS",
    ]
    if fpt * max(s_best, p_best) > gemm:
        lines.append("WARNING: a step ran faster than the sgemm rate allows (MFU > 100%); the "
                     "rate was measured while other work loaded the machine: rerun when idle")
    if summary["parameters"] != peer["params"]:
        lines.append(f"WARNING: parameter counts differ ({summary['parameters']} vs "
                     f"{peer['params']}); the models are not the same shape")
    profile = summary.get("profile")
    profile = {k: v for k, v in profile.items() if isinstance(v, (int, float))} if isinstance(
        profile, dict) else {}
    if profile and sum(profile.values()) > 0:
        total = sum(profile.values())
        lines += ["", "shardlm time by op family:", "", "| family | s | share |",
                  "| --- | ---: | ---: |"]
        for fam, sec in sorted(profile.items(), key=lambda kv: -kv[1]):
            lines.append(f"| {fam} | {sec:.2f} | {100 * sec / total:.1f}% |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
