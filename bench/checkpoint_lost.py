#!/usr/bin/env python3
"""The training time a run's checkpoints cost, from its own log and metrics.jsonl (one run, so
that the machine's load drifting between runs does not enter): per save, the time training was
blocked (a synchronous save's whole time; an asynchronous one's snapshot, commit and waits for
the background write) plus the slowdown of the steps after the first save (their time over the
median step before it, step 1 left out). Prints one line. Usage: checkpoint_lost.py RUN_DIR LOG"""
import json
import re
import statistics
import sys


def main():
    run, log = sys.argv[1], sys.argv[2]
    steps = [json.loads(l)["step_ms"] / 1e3 for l in open(f"{run}/metrics.jsonl") if '"step_ms"' in l]
    text = open(log).read()
    saves = sorted({int(s) for s in re.findall(r"^checkpoint: step (\d+):", text, re.M)})
    blocked = sum(float(s) for s in re.findall(r"state by \d+ ranks? in ([0-9.]+) s", text))
    blocked += sum(float(s) for s in re.findall(r"snapshot of [0-9.]+ MiB of state in ([0-9.]+) s", text))
    blocked += sum(float(s) for s in re.findall(r"; commit ([0-9.]+) s\)", text))
    blocked += sum(float(s) for s in re.findall(r"waited ([0-9.]+) s for the background", text))
    base = statistics.median(steps[1:saves[0]])
    slowdown = sum(t - base for t in steps[saves[0]:])
    n = len(saves)
    print(f"{n} saves; step {base:.3f} s; per save: blocked {blocked / n:.3f} s + slower steps "
          f"{slowdown / n:.3f} s = lost {(blocked + slowdown) / n:.3f} s")


if __name__ == "__main__":
    main()
