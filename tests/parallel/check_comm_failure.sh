#!/usr/bin/env bash
# Runs comm_failure MODE on 3 ranks and checks that the job ends non-zero within 60 s and that
# its output matches PATTERN (e.g. names rank 1). Usage: MPIEXEC EXE MODE PATTERN [TIMEOUT_S]
set -uo pipefail
mpiexec=$1 exe=$2 mode=$3 pattern=$4
export SHARDLM_COMM_TIMEOUT_S=${5:-120}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$(date +%s%N)
timeout -s KILL 90 "$mpiexec" -n 3 --oversubscribe --mca mpi_yield_when_idle 1 --bind-to none \
  -x SHARDLM_COMM_TIMEOUT_S "$exe" "$mode" >"$log" 2>&1
rc=$?
elapsed_ms=$((($(date +%s%N) - start) / 1000000))
cat "$log"
echo "--- comm_failure $mode: exit $rc after ${elapsed_ms} ms"
fail() { echo "FAIL: $*" >&2; exit 1; }
[[ $rc -ne 0 ]] || fail "the job exited 0"
[[ $elapsed_ms -lt 60000 ]] || fail "the job took ${elapsed_ms} ms (limit 60 s)"
grep -Eq -- "$pattern" "$log" || fail "the output does not match: $pattern"
echo "ok"
