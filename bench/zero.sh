#!/usr/bin/env bash
# ZeRO data parallelism on CPU ranks: shardlm's zero stages against PyTorch (DDP, FSDP) and,
# where it is installed, DeepSpeed ZeRO, on the same small Llama and the same global batch, for
# N = 2 and 4 ranks of one thread each, one run after the other. Prints one markdown table:
# step time, per-rank peak RSS, shardlm's per-rank device/host pool peaks.
# Measures, never asserts: nothing here is a test. See bench/README.md.
# A shardlm configuration this build rejects (a ZeRO stage not implemented yet) or that fails
# becomes an "unsupported"/"failed" row, so the script can be rerun unchanged as stages land.
# Usage: bench/zero.sh BUILD_DIR
#   (env: SHARDLM_VENV, BENCH_CONFIG, BENCH_STEPS, BENCH_RANKS, BENCH_SYSTEMS, MPIEXEC)
set -uo pipefail

die() {
  echo "bench/zero.sh: $*" >&2
  exit 1
}

[[ $# -eq 1 ]] || die "usage: bench/zero.sh BUILD_DIR (the CMake build directory holding shardlm)"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$(cd "$1" 2>/dev/null && pwd) || die "build directory '$1' does not exist; run 'make build'"
shardlm=$build/shardlm
[[ -x $shardlm ]] || die "$shardlm is missing; build it first ('make build')"
cd "$repo" || die "cannot enter $repo"

config=${BENCH_CONFIG:-bench/configs/zero_small.json}
[[ -f $config ]] || die "config $config not found"
venv=${SHARDLM_VENV:-$HOME/.cache/shardlm/venv}
ranks=${BENCH_RANKS:-2 4}
systems=${BENCH_SYSTEMS:-shardlm fsdp deepspeed}
mpiexec=${MPIEXEC:-mpiexec}
out=bench/results/zero
per_run_timeout=600

if ! /usr/bin/time -v true >/dev/null 2>&1; then
  die "/usr/bin/time -v does not work; install GNU time (Debian: apt-get install time)"
fi
command -v "$mpiexec" >/dev/null ||
  die "$mpiexec is missing (Open MPI: apt-get install openmpi-bin)"
if ! "$venv/bin/python" -c 'import torch, transformers' 2>/dev/null; then
  die "no venv with torch and transformers at $venv; 'make bench' (bench/run.sh) creates it"
fi
python=$venv/bin/python
have_deepspeed=0
if [[ " $systems " == *" deepspeed "* ]]; then
  if DS_ACCELERATOR=cpu "$python" -c 'import deepspeed' >/dev/null 2>&1; then
    have_deepspeed=1
  else
    echo "bench: DeepSpeed is not importable in $venv ('$venv/bin/pip install deepspeed');" \
      "its rows are skipped"
  fi
fi

bash scripts/prepare-demo-data.sh data/kjv.txt || die "could not write the demo corpus"

rm -rf "$out"
mkdir -p "$out"
manifest=$out/manifest.tsv
printf 'system\tstage\tvariant\tranks\tstatus\tdir\n' >"$manifest"
steps_args=()
peer_steps_args=()
if [[ -n ${BENCH_STEPS:-} ]]; then
  steps_args=(--set "train.max_steps=$BENCH_STEPS")
  peer_steps_args=(--steps "$BENCH_STEPS")
fi
# One thread per rank (ranks share the cores); Open MPI refuses root unless told (containers).
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# shardlm: N ranks under mpiexec, each rank under its own /usr/bin/time -v (per-rank max RSS).
# $1 stage, $2 variant label, $3 N, then --set arguments.
run_shardlm() {
  local stage=$1 variant=$2 n=$3
  shift 3
  local dir=$out/shardlm_s${stage}${variant:+_$variant}_n$n status=ok rc=0
  mkdir -p "$dir"
  echo "bench: shardlm zero.stage=$stage${variant:+ ($variant)}, $n ranks"
  # shellcheck disable=SC2016  # $0 and $OMPI_COMM_WORLD_RANK expand in each rank's shell
  timeout "$per_run_timeout" "$mpiexec" -n "$n" --oversubscribe --mca mpi_yield_when_idle 1 \
    --bind-to none bash -c 'exec /usr/bin/time -v -o "$0.$OMPI_COMM_WORLD_RANK" "$@"' \
    "$dir/time.rank" "$shardlm" train --config "$config" --set "log.dir=$dir/run" \
    --set train.resume=none --set "zero.stage=$stage" "${steps_args[@]}" "$@" \
    >"$dir/log.txt" 2>&1 || rc=$?
  if [[ $rc -ne 0 ]]; then
    if grep -q "not available in this version" "$dir/log.txt"; then
      status=unsupported
    else
      status="failed (exit $rc)"
    fi
    echo "bench:   $status: $(grep -m1 '^shardlm: ' "$dir/log.txt" || tail -n1 "$dir/log.txt")"
  fi
  printf 'shardlm\t%s\t%s\t%s\t%s\t%s\n' "$stage" "$variant" "$n" "$status" "$dir" >>"$manifest"
}

# A PyTorch or DeepSpeed peer under torchrun; rank 0's JSON line lands in peer.json.
# $1 system, $2 stage, $3 variant label, $4 N, $5 script, then the script's arguments.
run_peer() {
  local system=$1 stage=$2 variant=$3 n=$4 script=$5
  shift 5
  local dir=$out/${system}_${variant}_n$n status=ok rc=0
  mkdir -p "$dir"
  echo "bench: $system $variant (~stage $stage), $n ranks"
  DS_ACCELERATOR=cpu timeout "$per_run_timeout" "$python" -m torch.distributed.run --standalone \
    --nproc_per_node "$n" "$script" --config "$config" "${peer_steps_args[@]}" "$@" \
    >"$dir/peer.json" 2>"$dir/log.txt" || rc=$?
  if [[ $rc -ne 0 ]]; then
    status="failed (exit $rc)"
    echo "bench:   $status; see $dir/log.txt"
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$system" "$stage" "$variant" "$n" "$status" "$dir" \
    >>"$manifest"
}

load_before=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)
echo "bench: load average before the runs: $load_before"
for n in $ranks; do
  if [[ " $systems " == *" shardlm "* ]]; then
    for stage in 0 1 2 3; do run_shardlm "$stage" "" "$n"; done
    run_shardlm 3 offload "$n" --set zero.offload_optimizer=cpu --set zero.offload_params=cpu
    run_shardlm 2 no-overlap "$n" --set zero.overlap_comm=false
  fi
  if [[ " $systems " == *" fsdp "* ]]; then
    run_peer pytorch 0 ddp "$n" bench/fsdp_peer.py --strategy ddp
    run_peer pytorch 0 no_shard "$n" bench/fsdp_peer.py --strategy no_shard
    run_peer pytorch 1 zero1 "$n" bench/fsdp_peer.py --strategy zero1
    run_peer pytorch 2 shard_grad_op "$n" bench/fsdp_peer.py --strategy shard_grad_op
    run_peer pytorch 3 full_shard "$n" bench/fsdp_peer.py --strategy full_shard
  fi
  if [[ $have_deepspeed -eq 1 ]]; then
    for stage in 0 1 2 3; do
      run_peer deepspeed "$stage" "stage$stage" "$n" bench/deepspeed_peer.py --stage "$stage"
    done
    run_peer deepspeed 3 stage3+offload "$n" bench/deepspeed_peer.py --stage 3 --offload
  fi
done

"$python" bench/zero_report.py --manifest "$manifest" --config "$config" \
  --load-before "$load_before" >"$out/zero_latest.md" || die "zero_report.py failed"
echo
cat "$out/zero_latest.md"
echo
echo "bench: table written to $out/zero_latest.md (raw logs beside it; not committed)"
