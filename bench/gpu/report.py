"""The tables and verdict of one scripts/gpu-check.sh phase, from the raw files it left.

    report.py speed-train|speed-attention|memory|context DIR

Writes DIR/section.md (markdown tables) and DIR/verdict.txt (one line). Exit 1 when a shardlm
run of the phase failed (a crash, a non-zero exit, no timed step), 0 otherwise: PyTorch
running out of memory, or a configuration that does not fit, is a result, not a failure.
Only the standard library: it runs on whatever Python the node has."""

import json
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from torch_peer import train_flops_per_token  # noqa: E402  (the FLOP count of every MFU here)

WARMUP_STEPS = 2  # shardlm's untimed steps, as torch_gpu_peer.py's eager default


def load(path, default=None):
    """One JSON document, or the last JSON line of a .jsonl-like log; default when absent."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return default
    if not text:
        return default
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(text.splitlines()[-1]) if text.splitlines() else default


def load_lines(path):
    """Every JSON object line of a file (other lines skipped); [] when absent."""
    rows = []
    try:
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line.startswith("{"):
                    rows.append(json.loads(line))
    except OSError:
        pass
    return rows


def gib(n):
    return f"{n / 2**30:.2f} GiB" if n else "-"


def num(x, fmt="{:.0f}"):
    return fmt.format(x) if isinstance(x, (int, float)) else "-"


def sig(x):
    """Three significant digits: step and kernel times span 0.1 ms to minutes."""
    return f"{x:.3g}" if isinstance(x, (int, float)) else "-"


def length(T):
    """A sequence length as the report writes it: 8K for 8192, 100 for 100."""
    return f"{T // 1024}K" if T % 1024 == 0 else str(T)


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def config_summary(c):
    """The knobs `plan --fit` turns, in one cell."""
    if not c:
        return "-"
    t, z, m, lora = c.get("train", {}), c.get("zero", {}), c.get("memory", {}), c.get("lora", {})
    parts = [f"mb {t.get('micro_batch')} x ga {t.get('grad_accum')}", f"ZeRO {z.get('stage')}"]
    if z.get("offload_optimizer") == "cpu":
        parts.append("optimizer offload")
    if z.get("offload_params") == "cpu":
        parts.append("param offload")
    parts.append(f"checkpointing {m.get('checkpointing')}")
    if m.get("offload_checkpoints"):
        parts.append("checkpoints offloaded")
    if lora.get("rank"):
        parts.append(f"LoRA r{lora['rank']}")
    return ", ".join(parts)


def shardlm_steps(run_dir):
    """Timed step lines of a shardlm run's metrics (warm-up steps dropped)."""
    steps = [r for r in load_lines(os.path.join(run_dir, "metrics.jsonl")) if "step_ms" in r]
    return [r for r in steps if r["step"] > WARMUP_STEPS]


def write(dir_, section, verdict):
    with open(os.path.join(dir_, "section.md"), "w") as f:
        f.write(section.rstrip() + "\n")
    with open(os.path.join(dir_, "verdict.txt"), "w") as f:
        f.write(verdict + "\n")


# ---- speed-train ---------------------------------------------------------------------------------
def speed_case(case_dir, bf16_rate):
    """(rows, shardlm tokens/s or None, failure or None) for one model-T case directory."""
    plan = load(os.path.join(case_dir, "plan.json"), {})
    config = load(os.path.join(case_dir, "config.json"))
    rc = load(os.path.join(case_dir, "shardlm.rc"))
    name = os.path.basename(case_dir)
    rows, failure, tok_s = [], None, None
    eager = load(os.path.join(case_dir, "torch_eager.json"), {})
    compiled = load(os.path.join(case_dir, "torch_compile.json"), {})

    def mfu(tokens_per_s, model, T):
        if not bf16_rate or not tokens_per_s:
            return "-"
        return f"{100 * tokens_per_s * train_flops_per_token(model, T) / bf16_rate:.1f}%"

    if not plan.get("fits"):
        why = plan.get("reason") or "no configuration fits the device and host budgets"
        rows.append([name, "shardlm", f"does not fit: {why}", "-", "-", "-", "-", "-", "-"])
    else:
        run = os.path.join(case_dir, "run")
        steps = shardlm_steps(run)
        mem = load(os.path.join(run, "memory_rank0.json"), {})
        if rc != 0 or not steps:
            failure = f"{name}: shardlm exit {rc}, {len(steps)} timed steps (see shardlm.log)"
        if steps:
            step_ms = statistics.median(r["step_ms"] for r in steps)
            tok_s = statistics.median(r["tokens_per_s"] for r in steps)
            model, T = config["model"], config["data"]["seq_len"]
            ratio = lambda p: f"{tok_s / p['tokens_per_s']:.2f}x" if p.get("tokens_per_s") else "-"
            peak = mem.get("peak_bytes", {}).get("device") or max(r["mem_peak_bytes"] for r in steps)
            rows.append([name, "shardlm", config_summary(config), sig(step_ms), num(tok_s),
                         mfu(tok_s, model, T),
                         f"{gib(peak)} (driver {gib(mem.get('driver_device_bytes'))})",
                         ratio(eager), ratio(compiled)])
        else:
            rows.append([name, "shardlm", f"failed: exit {rc}", "-", "-", "-", "-", "-", "-"])
    for mode, peer in (("eager", eager), ("compile", compiled)):
        label = f"PyTorch {mode}"
        if not peer:
            rows.append([name, label, f"no result (see torch_{mode}.log)"] + ["-"] * 6)
        elif "tokens_per_s" in peer:
            rows.append([name, label, f"mb {peer['micro_batch']} x ga {peer['grad_accum']}, "
                         "bf16 autocast, SDPA, fused AdamW", sig(peer["step_ms"]),
                         num(peer["tokens_per_s"]),
                         mfu(peer["tokens_per_s"], config["model"], peer["seq_len"])
                         if config else "-",
                         f"{gib(peer['peak_device_bytes'])} (max allocated)", "", ""])
        else:
            why = peer.get("skipped") or f"out of memory: {peer.get('oom', '?')}"
            rows.append([name, label, why, "-", "-", "-", "-", "", ""])
    return rows, tok_s, failure, eager.get("tokens_per_s"), compiled.get("tokens_per_s")


def profile_table(dir_, cases):
    """Seconds and shares by op family of each case's profiled run, or "" when none ran."""
    profiles = {c: load(os.path.join(dir_, c, "profile", "summary.json"), {}).get("profile")
                for c in cases}
    profiles = {c: p for c, p in profiles.items() if p}
    if not profiles:
        return ""
    families = list(next(iter(profiles.values())))
    rows = []
    for f in families:
        row = [f]
        for c in profiles:
            total = sum(profiles[c].values()) or 1
            row.append(f"{profiles[c][f]:.3f} s ({100 * profiles[c][f] / total:.1f}%)")
        rows.append(row)
    return table(["op family"] + list(profiles), rows)


def speed_train(dir_):
    gemm = load(os.path.join(dir_, "gemm.json"), {})  # shardlm-bench-gemm
    torch_gemm = load(os.path.join(dir_, "gemm_torch.json"), {})  # gemm_rate.py, for reference
    rate = gemm.get("bf16_tflops", 0) * 1e12
    cases = sorted(d for d in os.listdir(dir_) if os.path.isdir(os.path.join(dir_, d)))
    rows, failures, ratios = [], [], []
    for c in cases:
        r, tok_s, failure, eager, compiled = speed_case(os.path.join(dir_, c), rate)
        rows += r
        if failure:
            failures.append(failure)
        if tok_s and eager:
            ratios.append(f"{c} {tok_s / eager:.2f}x eager"
                          + (f", {tok_s / compiled:.2f}x compile" if compiled else ""))
    section = ["## Speed: training steps",
               f"Medians of timed steps (after {WARMUP_STEPS} warm-up steps; compile after 3). "
               f"MFU: tokens/s x model FLOPs per token over this GPU's bf16 GEMM rate as "
               f"shardlm's cuBLASLt measures it (shardlm-bench-gemm, "
               f"{num(gemm.get('n'), '{}')}^3: "
               f"{num(gemm.get('bf16_tflops'), '{:.0f}')} TFLOP/s; f32 "
               f"{num(gemm.get('f32_tflops'), '{:.0f}')}; PyTorch's matmul "
               f"{num(torch_gemm.get('bf16_tflops'), '{:.0f}')}). shardlm runs the configuration "
               "`plan --fit` chose for this GPU; PyTorch the same rows per step.", "",
               table(["case", "engine", "configuration", "step ms", "tokens/s", "MFU",
                      "device peak", "vs eager", "vs compile"], rows)]
    profiles = profile_table(dir_, cases)
    if profiles:
        section += ["", "Where shardlm's step goes (`log.profile`, steps 2-4; each op waited for, "
                    "so the sum exceeds the timed step):", "", profiles]
    ok = not failures and any(r[1] == "shardlm" and r[4] != "-" for r in rows)
    verdict = (f"speed-train: {'; '.join(ratios) or 'no case with both engines timed'}" if ok
               else f"speed-train: FAIL ({'; '.join(failures) or 'no shardlm case ran'})")
    write(dir_, "\n".join(section), verdict)
    return 0 if ok else 1


# ---- speed-attention -----------------------------------------------------------------------------
def speed_attention(dir_):
    engines = {"shardlm": load_lines(os.path.join(dir_, "shardlm.jsonl")),
               "flash": load_lines(os.path.join(dir_, "flash.jsonl")),
               "cudnn": load_lines(os.path.join(dir_, "cudnn.jsonl"))}
    by_T = {}
    for engine, lines in engines.items():
        for r in lines:
            by_T.setdefault(r["T"], {})[engine] = r

    def cell(r):
        if r is None:
            return "-"
        if "fwd_bwd_tflops" in r:
            return (f"{sig(r['fwd_bwd_tflops'])} ({sig(r['forward_ms'])} + "
                    f"{sig(r['backward_ms'])} ms)")
        return r.get("skipped") and f"skipped: {r['skipped']}" or f"OOM: {r.get('oom', '?')}"

    rows, ratios = [], []
    for T in sorted(by_T):
        e = by_T[T]
        best = max((e[k].get("fwd_bwd_tflops", 0) for k in ("flash", "cudnn") if k in e), default=0)
        mine = e.get("shardlm", {}).get("fwd_bwd_tflops")
        ratio = f"{mine / best:.2f}x" if mine is not None and best else "-"
        if mine is not None and best:
            ratios.append(f"T={length(T)} {ratio}")
        rows.append([T, cell(e.get("shardlm")), cell(e.get("flash")), cell(e.get("cudnn")), ratio])
    timed = [r for r in engines["shardlm"] if "fwd_bwd_tflops" in r]
    shape = timed[0] if timed else {}
    section = ["## Speed: causal attention forward + backward",
               f"{shape.get('dtype', '?')}, {shape.get('heads', '?')} query heads, "
               f"{shape.get('kv_heads', '?')} key/value heads, head dim "
               f"{shape.get('head_dim', '?')}, one sequence. TFLOP/s of forward + backward "
               "(3.5 x the causal forward's 2 T^2 Dh H), medians of the repetitions after a "
               "warm-up; in brackets forward + backward ms.", "",
               table(["T", "shardlm", "PyTorch SDPA flash", "PyTorch SDPA cuDNN",
                      "shardlm / best peer"], rows)]
    verdict = (f"speed-attention: shardlm vs the faster SDPA backend: {', '.join(ratios) or '-'}"
               if timed else "speed-attention: FAIL (shardlm-bench-attention timed no length; "
               "see shardlm.log)")
    write(dir_, "\n".join(section), verdict)
    return 0 if timed else 1


# ---- memory --------------------------------------------------------------------------------------
def memory_mode(dir_, mode):
    """(row, failure or None, note) for the lora or full directory."""
    c = os.path.join(dir_, mode)
    T = int(load(os.path.join(c, "longest_seq.txt"), 0) or 0)
    plan = load(os.path.join(c, "plan.json"), {})
    config = load(os.path.join(c, "config.json"))
    run = load(os.path.join(c, "run.json"), {})
    torch = load(os.path.join(c, "torch.json"), {})
    planned = plan.get("chosen", {}).get("planned", {}).get("peak_bytes", {})
    steps = [r for r in load_lines(os.path.join(c, "run", "metrics.jsonl")) if "step_ms" in r]
    failure = None
    if T == 0:
        ran = "nothing fits at T = 4096 (plan.json says why)"
    elif run.get("ended") == "killed":
        ran = (f"{len(steps)} step(s) in the {run.get('seconds')} s budget, then stopped; "
               f"driver peak {gib(run.get('driver_peak_bytes'))}")
    elif run.get("rc") == 0 and steps:
        ran = (f"step 1 in {sig(steps[0]['step_ms'] / 1e3)} s; driver peak "
               f"{gib(run.get('driver_peak_bytes'))}, host RSS {gib(run.get('rss_peak_bytes'))}")
    else:
        ran = f"FAILED: exit {run.get('rc')} (see {mode}/run.log)"
        failure = f"{mode}: the real run at T = {T} failed"
    # The driver's count beyond the plan is memory the plan did not predict.
    over = (run.get("driver_peak_bytes", 0) or 0) - (planned.get("device", 0) or 0)
    note = None
    if T and steps and over > 2**30:
        note = f"{mode}: driver peak {gib(run['driver_peak_bytes'])} > planned {gib(planned['device'])}"
    theirs = torch.get("longest_seq")
    versus = f"{T / theirs:.1f}x" if T and theirs else "-"
    peer = (f"{theirs} ({torch.get('search', '')})" if theirs is not None
            else f"no result: {torch.get('skipped', 'see torch.log')}")
    row = [mode, T or "-", config_summary(config),
           f"{gib(planned.get('device'))} device, {gib(planned.get('host'))} host", ran, peer,
           versus]
    return row, failure, note


def memory(dir_):
    rows, failures, notes = [], [], []
    for mode in ("lora", "full"):
        if not os.path.isdir(os.path.join(dir_, mode)):
            continue
        row, failure, note = memory_mode(dir_, mode)
        rows.append(row)
        failures += [failure] if failure else []
        notes += [note] if note else []
    section = ["## Memory: the longest sequence that trains, Llama-3.1-8B",
               "shardlm: the longest T (a multiple of 4096) for which `plan --fit` finds a "
               "configuration within this GPU's free memory less 1 GiB and 90% of the host's "
               "available memory, then trained for real (driver and resident memory sampled each "
               "second). PyTorch: transformers with gradient checkpointing (LoRA: PEFT r16 on "
               "every projection; full: fused AdamW, bf16 autocast), bisected by real steps.", "",
               table(["mode", "shardlm T", "configuration", "planned peak", "real run",
                      "PyTorch + transformers T", "shardlm / PyTorch"], rows)]
    if notes:
        section += ["", "Above the plan: " + "; ".join(notes)]
    summary = ", ".join(f"{r[0]} {r[1]} vs {r[5].split(' ')[0]}" for r in rows)
    verdict = (f"memory: FAIL ({'; '.join(failures)})" if failures or not rows
               else f"memory: longest T, shardlm vs PyTorch: {summary}")
    write(dir_, "\n".join(section), verdict)
    return 1 if failures or not rows else 0


# ---- context -------------------------------------------------------------------------------------
def rank_reports(run_dir):
    """Every rank's memory_rank{R}.json of a run, in rank order."""
    reports, r = [], 0
    while os.path.exists(os.path.join(run_dir, f"memory_rank{r}.json")):
        reports.append(load(os.path.join(run_dir, f"memory_rank{r}.json"), {}))
        r += 1
    return reports


def driver_cell(reports):
    """Each rank's driver count of its own device memory against its ledger, or why none."""
    cells = []
    for m in reports:
        if "driver_device_bytes" in m:
            cells.append(f"{gib(m['driver_device_bytes'])} vs {gib(m.get('ledger_device_bytes_now'))}"
                         f" ({m.get('driver_device_source', '?')})")
        elif "driver_device_bytes_unavailable" in m:
            cells.append("none: " + m["driver_device_bytes_unavailable"])
        else:
            cells.append("-")
    return "; ".join(cells) or "-"


def context_case(dir_, P):
    """(row, failures) for cp = P."""
    c = os.path.join(dir_, f"cp{P}")
    T = int(load(os.path.join(c, "longest_seq.txt"), 0) or 0)
    budget = load(os.path.join(c, "budget_gib.txt"), "-")
    failures = []
    longest = rank_reports(os.path.join(c, "longest"))
    longest_rc = load(os.path.join(c, "longest.rc"))
    if T == 0:
        allocated = "nothing fits at T = 4096"
    elif longest_rc == 0 and len(longest) == P:
        planned_eq = all(m.get("peak_by_category") == m.get("planned", {}).get("peak_by_category")
                         for m in longest)
        peak = max(m.get("peak_bytes", {}).get("device", 0) for m in longest)
        allocated = (f"every rank allocated it: device peak {gib(peak)} per rank, plan "
                     f"{'==' if planned_eq else '!='} ledger; driver: {driver_cell(longest)}")
        if not planned_eq:
            failures.append(f"cp {P}: the plan differs from the ledger at T = {T}")
    else:
        allocated = f"FAILED: exit {longest_rc} (see cp{P}/longest.log)"
        failures.append(f"cp {P}: the dry run at T = {T} failed")
    steps = shardlm_steps(os.path.join(c, "timed"))
    timed_rc = load(os.path.join(c, "timed.rc"))
    step_ms = statistics.median(r["step_ms"] for r in steps) if steps else None
    if timed_rc != 0 or not steps:
        failures.append(f"cp {P}: the timed run failed (exit {timed_rc}, {len(steps)} timed steps)")
    row = [P, f"{budget} GiB", length(T) if T else "-", allocated, sig(step_ms and step_ms / 1e3)]
    return row, failures, T, step_ms


def context(dir_):
    common = int(load(os.path.join(dir_, "common_seq.txt"), 0) or 0)
    try:
        with open(os.path.join(dir_, "model.txt")) as f:
            model = f.read().strip()
    except OSError:
        model = "-"
    rows, failures, base = [], [], None
    degrees = sorted(int(d[2:]) for d in os.listdir(dir_) if d.startswith("cp") and d[2:].isdigit())
    for P in degrees:
        row, fails, T, step_ms = context_case(dir_, P)
        if P == 1:
            base = (T, step_ms)
        longer = f"{T / base[0]:.2f}x" if base and base[0] and T else "-"
        slower = f"{step_ms / base[1]:.2f}x" if base and base[1] and step_ms else "-"
        rows.append(row + [longer, slower])
        failures += fails
    section = ["## Context parallelism: cp ranks sharing this GPU",
               "P ranks on GPU 0 (`shardlm launch`, parallel.device_comm = \"host\": device "
               f"tensors staged through host memory), the {model} shape, Ulysses over P, ZeRO-3, "
               "full checkpointing, bf16, one sequence per step. Longest T: the plan's, within "
               "the GPU's free memory less 1 GiB per rank beyond the first, split P ways; then "
               "allocated for real by a dry run on every rank (each rank's driver count of its "
               "own memory against its ledger). Step time at T = "
               f"{length(common) if common else '-'} (median of the steps after two).", "",
               table(["cp", "budget per rank", "longest T", "allocated", "step s",
                      "T vs cp 1", "step vs cp 1"], rows)]
    summary = ", ".join(f"cp {r[0]} {r[2]}" for r in rows)
    verdict = (f"context: FAIL ({'; '.join(failures)})" if failures or not rows
               else f"context: longest T {summary}")
    write(dir_, "\n".join(section), verdict)
    return 1 if failures or not rows else 0


PHASES = {"speed-train": speed_train, "speed-attention": speed_attention, "memory": memory,
          "context": context}

if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in PHASES:
        sys.exit(f"usage: {sys.argv[0]} {'|'.join(PHASES)} DIR")
    sys.exit(PHASES[sys.argv[1]](sys.argv[2]))
