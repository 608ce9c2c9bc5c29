#!/usr/bin/env bash
# CPU: what a preference step costs against SFT on the same tokens. Preference pairs cut from the
# demo corpus (a prompt of verses, two continuations) train the bench model with LoRA by SFT
# (each pair as two prompt/completion records: the same tokens and completion masks, placed
# whole by samples packing), by DPO (one more forward, the reference with the adapters off, and
# one more head GEMM) and by SimPO (the extra head GEMM only). Per row: tokens/s and step ms
# (medians of steps 3..8; targets: the completion tokens), targets a step, the last loss; two
# interleaved rounds, so that the machine's drift shows. 2 x 1024 tokens a step. Measures,
# never asserts. Markdown table on stdout.
#
#   bench/preference.sh [BUILD_DIR] [CONFIG]   (default: build, bench/configs/cpu_6l_512.json)
set -euo pipefail
build=${1:-build}
config=${2:-bench/configs/cpu_6l_512.json}
repo=$(cd "$(dirname "$0")/.." && pwd)
cd "$repo"
bin="$build/shardlm"
[[ -x $bin ]] || { echo "preference.sh: no $bin; build first" >&2; exit 2; }
bash scripts/prepare-demo-data.sh data/kjv.txt >/dev/null
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# 200 pairs of exactly 150 + 100 + 100 bytes (the model's tokens are bytes): two pairs, or their
# four prompt/completion records, fill a 1024-token row alike, so both runs train the same rows.
python3 - data/kjv.txt "$out" <<'PY'
import json, sys
text = " ".join(l.strip() for l in open(sys.argv[1]) if l.strip())
with open(f"{sys.argv[2]}/pairs.jsonl", "w") as pairs, open(f"{sys.argv[2]}/sft.jsonl", "w") as sft:
    for i in range(200):
        at = 400 * i
        prompt = text[at:at + 150]
        chosen, rejected = " " + text[at + 150:at + 249], " " + text[at + 300:at + 399]
        pairs.write(json.dumps({"prompt": prompt, "chosen": chosen, "rejected": rejected}) + "\n")
        for completion in (chosen, rejected):
            sft.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
PY

run() {  # NAME DATA --set ... (after the common ones)
  local name=$1 data=$2 dir="$out/run$RANDOM"
  shift 2
  "$bin" train --config "$config" --set train.resume=none --set log.dir="$dir" \
    --set data.train="$data" --set data.packing=samples --set lora.rank=16 --set lora.alpha=32 \
    --set lora.targets=all --set train.micro_batch=2 --set train.max_steps=8 "$@" >"$dir.log" 2>&1
  python3 - "$name" "$dir" <<'PY'
import json, statistics, sys
name, run = sys.argv[1:]
steps = [json.loads(l) for l in open(f"{run}/metrics.jsonl") if '"step_ms"' in l]
tps = statistics.median(s["tokens_per_s"] for s in steps[2:])
ms = statistics.median(s["step_ms"] for s in steps[2:])
tokens = statistics.median(s["tokens_per_s"] * s["step_ms"] / 1000 for s in steps[2:])
print(f"| {name} | {tps:.0f} | {ms:.0f} | {tokens:.0f} | {steps[-1]['loss']:.4f} |")
PY
}

echo "| objective (LoRA r16, all projections) | targets/s | step ms | targets a step | last loss |"
echo "|---|---:|---:|---:|---:|"
for round in 1 2; do  # twice, interleaved: the spread within a row is the machine's noise
  run "SFT (each pair as two prompt/completion records), round $round" "$out/sft.jsonl"
  run "DPO sigmoid, beta 0.1, round $round" "$out/pairs.jsonl" --set train.objective=dpo
  run "SimPO, beta 2, gamma 1, round $round" "$out/pairs.jsonl" --set train.objective=simpo \
    --set train.simpo.beta=2 --set train.simpo.gamma=1
done
