#!/usr/bin/env bash
# Sharded checkpoints under tensor parallelism: trains bench/configs/cpu_6l_512.json for 2 steps
# at tp = 2 and tp = 4 (one rank per tp shard) with a checkpoint at step 2, prints the manifest's
# size, then resumes from it for one step on the same grid and prints the trainer's resume line
# (choosing the checkpoint, verifying every CRC-32 and reading this rank's ranges). A tp rank's
# share of a column-split matrix is strided in the whole vector: that is what the manifest's
# ranges describe.
# Usage: bench/checkpoint_tp.sh BUILD_DIR_OR_BINARY
set -euo pipefail
BIN=${1:?usage: bench/checkpoint_tp.sh BUILD_DIR_OR_BINARY}
[[ -d "$BIN" ]] && BIN="$BIN/shardlm"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${SHARDLM_BENCH_OUT:-$ROOT/bench/results/checkpoint_tp}
mkdir -p "$OUT"
[[ -f "$ROOT/data/kjv.txt" ]] || "$ROOT/scripts/prepare-demo-data.sh"
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
run() {  # tp max_steps log
  mpiexec -n "$1" --oversubscribe --mca mpi_yield_when_idle 1 --bind-to none \
    "$BIN" train --config "$ROOT/bench/configs/cpu_6l_512.json" --set parallel.tp="$1" \
    --set data.seq_len=128 --set train.micro_batch=1 --set train.max_steps="$2" \
    --set checkpoint.every_steps=2 --set sample.count=0 --set log.dir="$OUT/tp$1" >"$3" 2>&1 ||
    { echo "tp$1: failed, see $3" >&2; exit 1; }
}
for tp in 2 4; do
  rm -rf "$OUT/tp$tp"
  run "$tp" 2 "$OUT/tp$tp.log"
  printf 'tp=%s: manifest.json %s bytes\n' "$tp" \
    "$(stat -c %s "$OUT/tp$tp/checkpoints/step_00000002/manifest.json")"
  run "$tp" 3 "$OUT/tp$tp.resume.log"
  printf 'tp=%s: ' "$tp"; grep '^resume: continuing' "$OUT/tp$tp.resume.log"
done
