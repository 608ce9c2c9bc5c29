#!/usr/bin/env bash
# CPU benchmark: shardlm and a PyTorch peer train the same 6-layer dim-512 Llama at T=1024,
# one after the other on all cores, and a markdown table compares tokens/s, MFU and max RSS.
# Measures, never asserts: nothing here is a test. See bench/README.md.
# Usage: bench/run.sh BUILD_DIR   (env: SHARDLM_VENV, BENCH_CONFIG, BENCH_STEPS)
set -euo pipefail

die() {
  echo "bench/run.sh: $*" >&2
  exit 1
}

[[ $# -eq 1 ]] || die "usage: bench/run.sh BUILD_DIR (the CMake build directory holding shardlm)"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$(cd "$1" 2>/dev/null && pwd) || die "build directory '$1' does not exist; run 'make build'"
shardlm=$build/shardlm
[[ -x $shardlm ]] || die "$shardlm is missing; build it first ('make build' or 'make bench')"
cd "$repo"

config=${BENCH_CONFIG:-bench/configs/cpu_6l_512.json}
[[ -f $config ]] || die "config $config not found"
venv=${SHARDLM_VENV:-$HOME/.cache/shardlm/venv}
results=bench/results
threads=$(nproc)

[[ -x /usr/bin/time ]] ||
  die "/usr/bin/time is missing; install GNU time (Debian: apt-get install time)"
/usr/bin/time -v true >/dev/null 2>&1 ||
  die "/usr/bin/time does not take -v (not GNU time?); install GNU time (Debian: apt-get install time)"
command -v python3 >/dev/null || die "python3 is missing; it creates the PyTorch venv"

# --- (a) PyTorch and transformers, in a venv outside the repository --------------------------
SHARDLM_VENV=$venv bash scripts/setup-venv.sh || die "could not set up the venv at $venv"
python=$venv/bin/python

# --- (b) the demo corpus -----------------------------------------------------------------------
bash scripts/prepare-demo-data.sh data/kjv.txt

# --- (c) the two runs, each under /usr/bin/time -v on all cores ---------------------------------
mkdir -p "$results"
run_dir=$("$python" -c '
import json, os, sys
p = sys.argv[1]
print(os.path.normpath(os.path.join(os.path.dirname(p), json.load(open(p))["log"]["dir"])))' \
  "$config")
rm -rf "$run_dir"
steps_args=()
peer_steps_args=()
if [[ -n ${BENCH_STEPS:-} ]]; then
  steps_args=(--set "train.max_steps=$BENCH_STEPS")
  peer_steps_args=(--steps "$BENCH_STEPS")
fi

run_shardlm() {
  OMP_NUM_THREADS=$threads /usr/bin/time -v -o "$results/shardlm.time" \
    "$shardlm" train --config "$config" "${steps_args[@]}" "$@" 2>"$results/shardlm.err" |
    tee "$results/shardlm.log"
}
# Both engines want every core; other work on the machine shows up as a lower rate for whichever
# run it overlaps, so the load is printed with the table.
load_before=$(cut -d' ' -f1-3 /proc/loadavg 2>/dev/null || echo unknown)
echo "bench: load average before the runs: $load_before"
echo "bench: shardlm on $threads threads ($config)"
rc=0
run_shardlm --set log.profile=true || rc=$?
if [[ $rc -eq 2 ]] && grep -q "log.profile" "$results/shardlm.err"; then
  echo "bench: this shardlm has no log.profile; rerunning without the op-family profile"
  rc=0
  run_shardlm || rc=$?
fi
cat "$results/shardlm.err" >&2
[[ $rc -eq 0 ]] || die "shardlm exited $rc; see $results/shardlm.log and $results/shardlm.err"
[[ -s $run_dir/summary.json ]] || die "shardlm wrote no $run_dir/summary.json"

echo "bench: PyTorch peer on $threads threads"
rc=0
OMP_NUM_THREADS=$threads /usr/bin/time -v -o "$results/torch.time" \
  "$python" bench/torch_peer.py --config "$config" --threads "$threads" "${peer_steps_args[@]}" \
  2>&1 >"$results/torch.json" | tee "$results/torch.log" >&2 || rc=$?
[[ $rc -eq 0 ]] || die "the PyTorch peer exited $rc; see $results/torch.log"

# --- (d) the table -----------------------------------------------------------------------------
"$python" bench/cpu_report.py --run-dir "$run_dir" --peer-json "$results/torch.json" \
  --shardlm-time "$results/shardlm.time" --peer-time "$results/torch.time" \
  --load-before "$load_before" > "$results/cpu_latest.md"
echo
cat "$results/cpu_latest.md"
echo
echo "bench: table written to $results/cpu_latest.md (raw logs beside it; not committed)"
