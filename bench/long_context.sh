#!/usr/bin/env bash
# Max context vs ranks: the longest sequence that one training step fits in a fixed per-rank
# memory budget, for 1, 2 and 4 CPU ranks: shardlm with context parallelism (parallel.cp = ranks;
# ulysses, ring, hybrid; and ring with full checkpointing offloaded to the host), shardlm with
# ZeRO-3 alone (cp = 1, one sequence per rank, with and without memory.checkpointing=full), and
# PyTorch FSDP (one sequence per rank). Binary-searches
# T on each side, prints a markdown table and the analytic context-parallel communication.
# Measures, never asserts: nothing here is a test. See bench/README.md.
# shardlm's cells come from `train --dry-run` under memory.budget_gib (the ledger's device pool);
# FSDP's from one real step, its per-rank peak RSS less its RSS after the model build. A shardlm
# configuration this build rejects as not implemented yet is an "n/a (not built)" cell.
# Usage: bench/long_context.sh BUILD_DIR
#   (env: SHARDLM_VENV, BENCH_CONFIG, BENCH_RANKS, BENCH_SYSTEMS, BENCH_CTX_BUDGET_GIB,
#    BENCH_CTX_START, BENCH_CTX_MAX, BENCH_CTX_COMM_T, MPIEXEC)
set -uo pipefail

die() {
  echo "bench/long_context.sh: $*" >&2
  exit 1
}

[[ $# -eq 1 ]] || die "usage: bench/long_context.sh BUILD_DIR (the CMake build directory)"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$(cd "$1" 2>/dev/null && pwd) || die "build directory '$1' does not exist; run 'make build'"
shardlm=$build/shardlm
cd "$repo" || die "cannot enter $repo"

config=${BENCH_CONFIG:-bench/configs/long_context.json}
[[ -f $config ]] || die "config $config not found"
venv=${SHARDLM_VENV:-$HOME/.cache/shardlm/venv}
ranks=${BENCH_RANKS:-1 2 4}
systems=${BENCH_SYSTEMS:-shardlm fsdp}
budget_gib=${BENCH_CTX_BUDGET_GIB:-1}
start=${BENCH_CTX_START:-4096}  # the first T tried
max_t=${BENCH_CTX_MAX:-1048576} # the search stops there ("≥" in the table)
comm_t=${BENCH_CTX_COMM_T:-16384}
mpiexec=${MPIEXEC:-mpiexec}
out=bench/results/long_context
per_run_timeout=1800

budget_bytes=$(awk -v g="$budget_gib" \
  'BEGIN { if (g + 0 <= 0) exit 1; printf "%d", g * 1073741824 }') ||
  die "BENCH_CTX_BUDGET_GIB must be a positive number of GiB, got '$budget_gib'"
if [[ " $systems " == *" shardlm "* ]]; then
  [[ -x $shardlm ]] || die "$shardlm is missing; build it first ('make build')"
  command -v "$mpiexec" >/dev/null ||
    die "$mpiexec is missing (Open MPI: apt-get install openmpi-bin)"
fi
python=$venv/bin/python
if [[ " $systems " == *" fsdp "* ]] && ! "$python" -c 'import torch, transformers' 2>/dev/null; then
  die "no venv with torch and transformers at $venv; 'make bench' (bench/run.sh) creates it"
fi
bash scripts/prepare-demo-data.sh data/kjv.txt || die "could not write the demo corpus"

rm -rf "$out"
mkdir -p "$out"
# One thread per rank (ranks share the cores); Open MPI refuses root unless told (containers).
export OMP_NUM_THREADS=1
if [[ $(id -u) -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

# A probe runs one configuration at sequence length $T (its last argument) and sets `verdict`
# (fits, over, or the cell's text when it neither fits nor runs out of memory) and `measured`
# (the bytes counted against the budget, 0 when unknown).
verdict=""
measured=0

# shardlm: $1 cell directory, $2 ranks, then --set arguments, then T.
probe_shardlm() {
  local dir=$1 n=$2 rc=0
  shift 2
  local t=${*: -1}
  local args=("${@:1:$#-1}")
  local log=$dir/T$t.log
  timeout "$per_run_timeout" "$mpiexec" -n "$n" --oversubscribe --mca mpi_yield_when_idle 1 \
    --bind-to none "$shardlm" train --dry-run --config "$config" --set "log.dir=$dir/run_T$t" \
    --set train.resume=none --set "data.seq_len=$t" --set "memory.budget_gib=$budget_gib" \
    "${args[@]}" >"$log" 2>&1 || rc=$?
  measured=0
  if [[ $rc -eq 0 ]]; then
    verdict=fits
    measured=$("$python_any" -c '
import glob, json, sys
print(max(json.load(open(p))["peak_bytes"]["device"]
          for p in glob.glob(sys.argv[1] + "/memory_rank*.json")))' \
      "$dir/run_T$t") || measured=0
  elif grep -q "out of memory" "$log"; then
    verdict=over
  elif grep -q "not implemented in this version\|not available in this version" "$log"; then
    verdict="n/a (not built)"
  elif [[ $rc -eq 2 ]]; then
    verdict="config error (exit 2)"
  else
    verdict="failed (exit $rc)"
  fi
  rm -rf "$dir/run_T$t/checkpoints"
  if [[ $measured -gt 0 ]]; then
    echo "bench:   T=$t: $verdict ($((measured >> 20)) MiB device pool)"
  else
    echo "bench:   T=$t: $verdict"
  fi
}

# PyTorch FSDP: $1 cell directory, $2 ranks, then T.
probe_fsdp() {
  local dir=$1 n=$2 t=$3 rc=0
  timeout "$per_run_timeout" "$python" -m torch.distributed.run --standalone \
    --nproc_per_node "$n" bench/long_context_fsdp.py --config "$config" --seq-len "$t" \
    >"$dir/T$t.json" 2>"$dir/T$t.log" || rc=$?
  measured=0
  if [[ $rc -ne 0 ]]; then
    verdict="failed (exit $rc)"
  else
    measured=$("$python" -c '
import json, sys
print(json.load(open(sys.argv[1]))["max_step_delta_bytes"])' \
      "$dir/T$t.json") || measured=0
    if [[ $measured -le 0 ]]; then
      verdict="failed (no result)"
    elif [[ $measured -le $budget_bytes ]]; then
      verdict=fits
    else
      verdict=over
    fi
  fi
  echo "bench:   T=$t: $verdict ($((measured >> 20)) MiB over the baseline)"
}

# Sets `found` to the largest multiple of $1 (up to max_t) at which the probe "$@" T fits:
# "< g" when even $1 does not, "≥ max_t" at the ceiling, or the text of a probe that failed.
# Each guess scales the last T by budget / measured where a probe measured (memory grows about
# linearly in T), else doubles or halves; once bracketed, it bisects.
found=""
search() {
  local g=$1 lo=0 hi=0 t next
  shift
  t=$((start / g * g))
  ((t < g)) && t=$g
  while :; do
    "$@" "$t"
    case $verdict in
      fits) ((t > lo)) && lo=$t ;;
      over) ((hi == 0 || t < hi)) && hi=$t ;;
      *)
        found=$verdict
        return
        ;;
    esac
    if ((hi > 0 && hi - lo <= g)); then break; fi
    if ((hi == 0 && lo >= max_t)); then break; fi
    if [[ $measured -gt 0 ]]; then
      next=$((t * budget_bytes / measured / g * g))
      [[ $verdict == fits ]] && next=$((next + g)) # fixed costs make the scaled guess short
    elif [[ $verdict == fits ]]; then
      next=$((2 * t))
    else
      next=$((t / 2 / g * g))
    fi
    if ((hi > 0 && (next <= lo || next >= hi))); then
      next=$((lo + (hi - lo) / g / 2 * g))
    fi
    ((next <= lo)) && next=$((lo + g))
    ((hi == 0 && next > max_t)) && next=$max_t
    ((next < g)) && next=$g
    t=$next
  done
  if ((lo == 0)); then
    found="< $g"
  elif ((hi == 0)); then
    found="≥ $lo"
  else
    found=$lo
  fi
}

python_any=$python
[[ -x $python_any ]] || python_any=python3
declare -A cell
printf 'cell\tranks\tresult\tdir\n' >"$out/manifest.tsv"
record() { # $1 cell name, $2 ranks, $3 dir
  cell[$1,$2]=$found
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$found" "$3" >>"$out/manifest.tsv"
  echo "bench: $1, $2 rank(s): max T = $found"
}

load_before=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)
echo "bench: budget $budget_gib GiB per rank; load average before the runs: $load_before"
for n in $ranks; do
  if [[ " $systems " == *" shardlm "* ]]; then
    # cp = 1: ZeRO-3 over n ranks, one sequence each (no kind: the sequence is not split).
    d=$out/shardlm_cp1_n$n && mkdir -p "$d"
    echo "bench: shardlm cp=1 (ZeRO-3 alone), $n rank(s)"
    search 256 probe_shardlm "$d" "$n" --set parallel.cp=1
    record shardlm_cp1 "$n" "$d"
    d=$out/shardlm_cp1_ckpt_n$n && mkdir -p "$d"
    echo "bench: shardlm cp=1, memory.checkpointing=full, $n rank(s)"
    search 256 probe_shardlm "$d" "$n" --set parallel.cp=1 --set memory.checkpointing=full
    record shardlm_cp1_ckpt "$n" "$d"
    if ((n > 1)); then
      g=$((2 * n * 64 > 256 ? 2 * n * 64 : 256)) # ring's load balance: 2 x cp chunks of 64
      for kind in ulysses ring hybrid; do
        extra=()
        if [[ $kind == hybrid ]]; then
          ((n == 4)) || continue
          extra=(--set parallel.cp_ulysses=2)
        fi
        d=$out/shardlm_${kind}_n$n && mkdir -p "$d"
        echo "bench: shardlm cp=$n $kind, $n ranks"
        search "$g" probe_shardlm "$d" "$n" --set "parallel.cp=$n" --set "parallel.cp_kind=$kind" \
          "${extra[@]}"
        record "shardlm_$kind" "$n" "$d"
      done
    fi
    # Everything at once: the sequence split over the ranks (ring: no head limit), each layer
    # keeping only its input, on the host.
    d=$out/shardlm_all_n$n && mkdir -p "$d"
    echo "bench: shardlm cp=$n ring, memory.checkpointing=full, offloaded, $n rank(s)"
    g=$((2 * n * 64 > 256 ? 2 * n * 64 : 256))
    search "$g" probe_shardlm "$d" "$n" --set "parallel.cp=$n" --set parallel.cp_kind=ring \
      --set memory.checkpointing=full --set memory.offload_checkpoints=true
    record shardlm_all "$n" "$d"
  fi
  if [[ " $systems " == *" fsdp "* ]]; then
    d=$out/fsdp_n$n && mkdir -p "$d"
    echo "bench: PyTorch FSDP (full_shard), $n rank(s)"
    search 256 probe_fsdp "$d" "$n"
    record fsdp "$n" "$d"
  fi
done

get() { echo "${cell[$1,$2]:-—}"; }
{
  echo "Max sequence length (tokens) for one training step within $budget_gib GiB per rank;"
  "$python_any" -c '
import json, sys
m = json.load(open(sys.argv[1]))["model"]
print("{0}: {n_layers} layers, dim {dim}, {n_heads} heads, {n_kv_heads} kv heads, FFN {ffn_dim}, "
      "vocabulary {vocab_size};".format(sys.argv[1], **m), end=" ")' \
    "$config"
  echo "load average before: $load_before; $(date -u +%Y-%m-%d)."
  echo
  echo "| ranks | shardlm cp=ranks, ulysses | shardlm cp=ranks, ring | shardlm cp=ranks, hybrid" \
    "(cp_ulysses=2) | shardlm cp=ranks, ring, full checkpointing offloaded |" \
    "shardlm cp=1 (ZeRO-3) | shardlm cp=1, checkpointing=full | PyTorch FSDP |"
  echo "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
  for n in $ranks; do
    if ((n == 1)); then # cp = 1 has no kind: the same run
      u=$(get shardlm_cp1 1) r=$u h=—
    else
      u=$(get shardlm_ulysses "$n") r=$(get shardlm_ring "$n") h=$(get shardlm_hybrid "$n")
    fi
    echo "| $n | $u | $r | $h | $(get shardlm_all "$n") | $(get shardlm_cp1 "$n") |" \
      "$(get shardlm_cp1_ckpt "$n") | $(get fsdp "$n") |"
  done
  echo
  echo "shardlm: \`train --dry-run\` under memory.budget_gib (the ledger's device pool: weights,"
  echo "gradients, Adam state, activations, workspace), one sequence in all (cp > 1) or per rank"
  echo "(cp = 1). FSDP: FULL_SHARD, one sequence per rank, SDPA attention, no activation"
  echo "checkpointing; per-rank peak RSS less the RSS after the model build. T is a multiple of"
  echo "256 (of 2 x cp x 64 for context parallelism)."
  for n in $ranks; do
    ((n > 1)) || continue
    echo
    "$python_any" bench/comm_volume.py --config "$config" --seq-len "$comm_t" --cp "$n" \
      --cp-ulysses 2
  done
} >"$out/long_context_latest.md"
echo
cat "$out/long_context_latest.md"
echo
echo "bench: table written to $out/long_context_latest.md (raw logs beside it; not committed)"
