#!/usr/bin/env bash
# Llama-3.2-1B shape, T = 2048, 2 sequences per step, on one GPU: shardlm (train.device = cuda,
# fp32 parameters and activations, op profile) against PyTorch + transformers on the same GPU,
# the same shapes and bytes: eager fp32 (the same arithmetic) and eager under bf16 autocast.
# Usage: bench/gpu/llama1b.sh SHARDLM_BINARY [OUT_DIR]   (needs python3 with torch, transformers)
set -euo pipefail
bin=${1:?usage: llama1b.sh SHARDLM_BINARY [OUT_DIR]}
out=${2:-bench/results/gpu}
cd "$(dirname "$0")/../.."
mkdir -p "$out"
cfg=bench/gpu/llama1b_t2048.json
[[ -f data/kjv.txt ]] || bash scripts/prepare-demo-data.sh data/kjv.txt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
"$bin" train --config "$cfg" --set train.resume=none --set log.profile=true \
  --set log.dir="\"$PWD/$out/shardlm_run\"" 2>&1 | tee "$out/shardlm.log" | tail -30
python3 bench/torch_peer.py --config "$cfg" --device cuda > "$out/torch_fp32.json" 2> "$out/torch_fp32.log"
python3 bench/torch_peer.py --config "$cfg" --device cuda --bf16-autocast \
  > "$out/torch_bf16.json" 2> "$out/torch_bf16.log"
python3 - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
steps = [json.loads(l) for l in open(f"{out}/shardlm_run/metrics.jsonl") if '"tokens_per_s"' in l]
s = statistics.median(m["tokens_per_s"] for m in steps[2:])
mem = json.load(open(f"{out}/shardlm_run/memory_rank0.json"))
print("| engine | tokens/s | step ms | device peak GiB |")
print("| --- | --- | --- | --- |")
print(f"| shardlm (fp32) | {s:,.0f} | {statistics.median(m['step_ms'] for m in steps[2:]):.0f} | "
      f"{mem['peak_bytes']['device'] / 2**30:.2f} (ledger) |")
for name in ("fp32", "bf16"):
    r = json.load(open(f"{out}/torch_{name}.json"))
    print(f"| PyTorch eager {name} | {r['tokens_per_s']:,.0f} | {r['step_ms']:.0f} | "
          f"{r['cuda_peak_bytes'] / 2**30:.2f} (max_memory_allocated) |")
PY
