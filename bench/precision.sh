#!/usr/bin/env bash
# CPU: the same training run in fp32, with bf16 parameters (fp32 activations) and with bf16
# parameters and activations: tokens/s (median of steps 3..N), the ledger's device peak and its
# activation and checkpoint bytes, and the process's peak resident memory. Measures, never
# asserts. Markdown table on stdout.
#
#   bench/precision.sh [BUILD_DIR] [CONFIG]   (default: build, bench/configs/cpu_6l_512.json)
set -euo pipefail
build=${1:-build}
config=${2:-bench/configs/cpu_6l_512.json}
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
bin="$build/shardlm"
[[ -x $bin ]] || { echo "precision.sh: no $bin; build first" >&2; exit 2; }
bash scripts/prepare-demo-data.sh data/kjv.txt >/dev/null
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

run() {  # NAME PARAM ACTIVATIONS
  local dir="$out/$1"
  /usr/bin/time -v "$bin" train --config "$config" --set train.resume=none --set log.dir="$dir" \
    --set precision.param="$2" --set precision.activations="$3" >"$out/$1.log" 2>"$out/$1.time"
  python3 - "$1" "$dir" "$out/$1.time" <<'EOF'
import json, statistics, sys
name, run, timefile = sys.argv[1:]
steps = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if '"step_ms"' in l]
tps = statistics.median(s["tokens_per_s"] for s in steps[2:])
mem = json.load(open(f"{run}/memory_rank0.json"))
cat = mem["peak_by_category"]
rss = next(int(l.split(":")[1]) for l in open(timefile) if "Maximum resident" in l)
mib = lambda b: f"{b / 2**20:.1f}"
print(f"| {name} | {tps:.0f} | {mib(mem['peak_bytes']['device'])} | {mib(cat['activations'])} "
      f"| {mib(cat['checkpoints'])} | {rss / 1024:.0f} | {steps[-1]['loss']:.4f} |")
EOF
}

echo "| precision | tokens/s | device peak MiB | activations MiB | checkpoints MiB | max RSS MiB | last loss |"
echo "|---|---:|---:|---:|---:|---:|---:|"
run "fp32" fp32 fp32
run "bf16 parameters, fp32 activations" bf16 fp32
run "bf16 parameters and activations" bf16 bf16
