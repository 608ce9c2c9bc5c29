#!/usr/bin/env bash
# Per-rank memory of every ZeRO stage, measured: trains bench/configs/cpu_6l_512.json for one
# step at N = 1, 2 and 4 ranks, stages 0-3, with and without offload, in bf16 and fp32, and
# prints each rank-0 memory_rank0.json's device- and host-pool bytes by category next to the
# ZeRO paper's formula for the same P and N. Memory does not depend on speed: the runs use one
# thread per rank and a short sequence. Usage: bench/zero_memory.sh BUILD_DIR
set -euo pipefail
BUILD=${1:?usage: bench/zero_memory.sh BUILD_DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${SHARDLM_BENCH_OUT:-$ROOT/bench/results/zero_memory}
mkdir -p "$OUT"
[[ -f "$ROOT/data/kjv.txt" ]] || "$ROOT/scripts/prepare-demo-data.sh"
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
run() {  # name ranks precision stage extra...
  local name=$1 n=$2 prec=$3 stage=$4
  shift 4
  local dir="$OUT/$name"
  rm -rf "$dir"
  mpiexec -n "$n" --oversubscribe --mca mpi_yield_when_idle 1 --bind-to none \
    "$BUILD/shardlm" train --config "$ROOT/bench/configs/cpu_6l_512.json" \
    --set data.seq_len=128 --set train.micro_batch=1 --set train.max_steps=1 \
    --set sample.count=0 --set precision.param="$prec" --set zero.stage="$stage" \
    --set log.dir="$dir" "$@" >"$dir.log" 2>&1 || { echo "$name: failed, see $dir.log" >&2; exit 1; }
}
for prec in bf16 fp32; do
  for n in 1 2 4; do
    for stage in 0 1 2 3; do
      run "${prec}_n${n}_s${stage}" "$n" "$prec" "$stage"
    done
    run "${prec}_n${n}_s2_offload" "$n" "$prec" 2 --set zero.offload_optimizer=cpu
    run "${prec}_n${n}_s3_offload" "$n" "$prec" 3 --set zero.offload_optimizer=cpu \
      --set zero.offload_params=cpu
  done
done
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
MiB = 1 << 20
print("| precision | N | stage | device: params | grads | optimizer | comm | device total* | host: optimizer + offload staging + params | ZeRO paper (2P+2P+12P split) |")
print("|---|---|---|---|---|---|---|---|---|---|")
for name in sorted(os.listdir(out)):
    path = os.path.join(out, name, "memory_rank0.json")
    if not os.path.isfile(path):
        continue
    prec, n, stage = name.split("_")[0], int(name.split("_")[1][1:]), name.split("_")[2]
    offload = name.endswith("offload")
    s = int(stage[1:])
    m = json.load(open(path))
    d, h = m["peak_by_category"], m["host_peak_by_category"]
    summary = json.load(open(os.path.join(out, name, "summary.json")))
    P = summary["parameters"]
    paper = {0: 16 * P, 1: 4 * P + 12 * P / n, 2: 2 * P + 14 * P / n, 3: 16 * P / n}[s]
    dev = d["params"] + d["grads"] + d["optimizer"] + d["comm"]
    host = h["optimizer"] + h["host_offload"] + h["params"]
    print(f"| {prec} | {n} | {s}{' offload' if offload else ''} | {d['params']/MiB:.1f} | "
          f"{d['grads']/MiB:.1f} | {d['optimizer']/MiB:.1f} | {d['comm']/MiB:.1f} | "
          f"{dev/MiB:.1f} | {host/MiB:.1f} | {paper/MiB:.1f} |")
print(f"\n*params + grads + optimizer + comm (activations and workspace excluded); P = {P:,}")
PY
