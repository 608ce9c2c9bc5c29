#!/usr/bin/env bash
# CPU: what checkpoint placement and the offloaded LoRA base cost and save on one training run:
# full checkpointing with every layer's input on the device, all on the host, half on the host,
# every 2nd layer's input only (on the host), and LoRA with its base on the device or in host
# memory. Per row: tokens/s (median of steps 3..N), the ledger's device peak, its checkpoint
# bytes on the device and on the host, the process's peak resident memory and the last loss
# (equal within a column group: every placement gives the same gradients). Measures, never
# asserts. Markdown table on stdout.
#
#   bench/placement.sh [BUILD_DIR] [CONFIG]   (default: build, bench/configs/cpu_6l_512.json)
set -euo pipefail
build=${1:-build}
config=${2:-bench/configs/cpu_6l_512.json}
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
bin="$build/shardlm"
[[ -x $bin ]] || { echo "placement.sh: no $bin; build first" >&2; exit 2; }
bash scripts/prepare-demo-data.sh data/kjv.txt >/dev/null
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

run() {  # NAME --set ... (after the common ones)
  local name=$1 dir="$out/run$RANDOM"
  shift
  /usr/bin/time -v "$bin" train --config "$config" --set train.resume=none --set log.dir="$dir" \
    --set precision.param=bf16 "$@" >"$dir.log" 2>"$dir.time"
  python3 - "$name" "$dir" "$dir.time" <<'PY'
import json, statistics, sys
name, run, timefile = sys.argv[1:]
steps = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if '"step_ms"' in l]
tps = statistics.median(s["tokens_per_s"] for s in steps[2:])
mem = json.load(open(f"{run}/memory_rank0.json"))
dev, host = mem["peak_by_category"], mem["host_peak_by_category"]
rss = next(int(l.split(":")[1]) for l in open(timefile) if "Maximum resident" in l)
mib = lambda b: f"{b / 2**20:.1f}"
print(f"| {name} | {tps:.0f} | {mib(mem['peak_bytes']['device'])} | {mib(dev['checkpoints'])} "
      f"| {mib(host['checkpoints'])} | {mib(host['params'])} | {rss / 1024:.0f} "
      f"| {steps[-1]['loss']:.4f} |")
PY
}

full=(--set memory.checkpointing=full)
lora=(--set lora.rank=16 --set lora.alpha=32 --set lora.targets=all)
echo "| run | tokens/s | device peak MiB | checkpoints on the device MiB | checkpoints on the host MiB | parameters on the host MiB | max RSS MiB | last loss |"
echo "|---|---:|---:|---:|---:|---:|---:|---:|"
run "full, every layer on the device" "${full[@]}"
run "full, all on the host" "${full[@]}" --set memory.offload_checkpoints=true
run "full, half on the host" "${full[@]}" --set memory.offload_checkpoints=0.5
run "full, every 2nd layer's input, on the host" "${full[@]}" --set memory.checkpoint_every=2 \
  --set memory.offload_checkpoints=true
run "LoRA, full, base on the device" "${full[@]}" "${lora[@]}"
run "LoRA, full, base on the host" "${full[@]}" "${lora[@]}" --set lora.offload_base=true
