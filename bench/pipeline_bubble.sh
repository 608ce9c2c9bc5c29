#!/usr/bin/env bash
# Pipeline bubble, measured against the textbook: parallel.pp = 2 and 4 stages, m = 1, 2, 4, 8
# micro-batches per step (train.grad_accum) on the tiny CPU model, one MPI rank per stage.
# Each run's metrics.jsonl lines carry the executor's per-stage compute time, time blocked in
# sends and receives, and measured bubble (idle / step); the table gives their means over the
# steps after the first, next to 1F1B's (pp-1)/(m+pp-1).
# Measures, never asserts: nothing here is a test. See bench/README.md.
# On fewer cores than ranks the stages share cores, so a stage's compute time includes
# waiting for a core, and the measured bubble is not the schedule's alone.
# Usage: bench/pipeline_bubble.sh BUILD_DIR   (env: BENCH_PP, BENCH_M, BENCH_STEPS, MPIEXEC)
set -euo pipefail

die() {
  echo "bench/pipeline_bubble.sh: $*" >&2
  exit 1
}

[[ $# -eq 1 ]] || die "usage: bench/pipeline_bubble.sh BUILD_DIR (the CMake build directory)"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$(cd "$1" 2>/dev/null && pwd) || die "build directory '$1' does not exist; run 'make build'"
shardlm=$build/shardlm
[[ -x $shardlm ]] || die "$shardlm is missing; build it first ('make build')"
cd "$repo" || die "cannot enter $repo"
pps=${BENCH_PP:-2 4}
ms=${BENCH_M:-1 2 4 8}
steps=${BENCH_STEPS:-6}
mpiexec=${MPIEXEC:-mpiexec}
out=bench/results/pipeline_bubble
mkdir -p "$out"

echo "| pp | m | textbook bubble | measured bubble (mean over stages) | per stage: compute ms / comm ms / idle |"
echo "|---:|---:|---:|---:|---|"
for pp in $pps; do
  for m in $ms; do
    run=$out/pp${pp}_m${m}
    rm -rf "$run"
    OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
      "$mpiexec" -n "$pp" --oversubscribe --bind-to none "$shardlm" train \
      --config configs/demo.json --set data.train=tests/data/genesis_1_12.txt \
      --set data.seq_len=64 --set model.n_layers=4 --set train.micro_batch=2 \
      --set train.grad_accum="$m" --set parallel.pp="$pp" --set train.max_steps="$steps" \
      --set train.eval_every=0 --set train.eval_batches=1 --set sample.count=0 \
      --set checkpoint.every_steps=0 --set log.dir="$run" >"$run.log" 2>&1 ||
      die "pp=$pp m=$m failed; see $run.log"
    python3 - "$run/metrics.jsonl" "$pp" "$m" <<'PY'
import json, sys
path, pp, m = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
lines = [json.loads(l) for l in open(path) if '"pp_bubble"' in l][1:]  # after the first step
n = len(lines)
mean = lambda key, s: sum(l[key][s] for l in lines) / n
stages = "; ".join(
    f"s{s}: {mean('pp_compute_ms', s):.1f} / {mean('pp_comm_ms', s):.1f} / "
    f"{100 * mean('pp_bubble_stages', s):.0f}%" for s in range(pp))
bubble = sum(l["pp_bubble"] for l in lines) / n
print(f"| {pp} | {m} | {100 * (pp - 1) / (m + pp - 1):.1f}% | {100 * bubble:.1f}% | {stages} |")
PY
  done
done
