#!/usr/bin/env bash
# Sharded checkpoint throughput: trains bench/configs/cpu_6l_512.json (6 layers, dim 512; f32
# parameters, Adam m and v: 238 MiB of state) for 4 steps at N = 1, 2 and 4 ranks with a
# checkpoint every 2 steps, then resumes each run from its step-2 checkpoint on the same ranks,
# and prints the trainer's own lines: each save's seconds and MiB/s (all ranks writing their
# shares, the commit included: what a synchronous save costs training) and the resume's
# verify-and-read time. Then the same state through torch.distributed.checkpoint
# (bench/dcp_peer.py) when the reference venv is there; and the training time a save costs,
# synchronous and asynchronous, against DCP's save and async_save (below).
# Usage: bench/checkpoint.sh BUILD_DIR
set -euo pipefail
BUILD=${1:?usage: bench/checkpoint.sh BUILD_DIR}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${SHARDLM_BENCH_OUT:-$ROOT/bench/results/checkpoint}
mkdir -p "$OUT"
[[ -f "$ROOT/data/kjv.txt" ]] || "$ROOT/scripts/prepare-demo-data.sh"
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
run() {  # ranks max_steps log
  mpiexec -n "$1" --oversubscribe --mca mpi_yield_when_idle 1 --bind-to none \
    "$BUILD/shardlm" train --config "$ROOT/bench/configs/cpu_6l_512.json" \
    --set data.seq_len=128 --set train.micro_batch=1 --set train.max_steps="$2" \
    --set checkpoint.every_steps=2 --set sample.count=0 --set log.dir="$OUT/n$1" >"$3" 2>&1 ||
    { echo "n$1: failed, see $3" >&2; exit 1; }
}
for n in 1 2 4; do
  rm -rf "$OUT/n$n"
  run "$n" 4 "$OUT/n$n.log"
  printf 'shardlm N=%s: ' "$n"; grep '^checkpoint:' "$OUT/n$n.log" | tr '\n' ' '; echo
  # Rewound to step 2, resumed: the ranks verify the files together and read their ranges.
  rm -rf "$OUT/n$n/checkpoints/step_00000004"
  echo step_00000002 >"$OUT/n$n/checkpoints/latest"
  run "$n" 3 "$OUT/n$n.resume.log"
  printf 'shardlm N=%s: ' "$n"; grep '^resume: continuing' "$OUT/n$n.resume.log"
done
# Training time lost to a checkpoint: 24 steps with a save after steps 8 and 16 (none at the
# end, so that a background write has 8 steps to overlap), synchronous and asynchronous
# (checkpoint.async). Measured within each run (bench/checkpoint_lost.py), as the time training
# was blocked plus the slowdown of the steps after the first save against the steps before it:
# the machine's load drifts too much between runs to subtract one run from another.
lost() {  # ranks mode extra...
  local n=$1 mode=$2
  shift 2
  rm -rf "$OUT/lost_n${n}_$mode"
  mpiexec -n "$n" --oversubscribe --mca mpi_yield_when_idle 1 --bind-to none \
    "$BUILD/shardlm" train --config "$ROOT/bench/configs/cpu_6l_512.json" \
    --set data.seq_len=128 --set train.micro_batch=1 --set train.max_steps=24 \
    --set checkpoint.every_steps=8 --set checkpoint.at_end=false --set sample.count=0 \
    --set log.dir="$OUT/lost_n${n}_$mode" "$@" >"$OUT/lost_n${n}_$mode.log" 2>&1 ||
    { echo "lost n$n $mode: failed" >&2; exit 1; }
  printf 'shardlm N=%s %s: ' "$n" "$mode"
  python3 "$ROOT/bench/checkpoint_lost.py" "$OUT/lost_n${n}_$mode" "$OUT/lost_n${n}_$mode.log"
}
for n in 1 2 4; do
  lost "$n" sync
  lost "$n" async --set checkpoint.async=true
  grep '^checkpoint:' "$OUT/lost_n${n}_async.log" | sed "s/^/  async N=$n: /"
done
PY=${SHARDLM_VENV:-$HOME/.cache/shardlm/venv}/bin/python
if [[ -x "$PY" ]]; then "$PY" "$ROOT/bench/dcp_peer.py" "$OUT/dcp" 1 2 4; fi
