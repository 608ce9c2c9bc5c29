#!/usr/bin/env bash
# Runs tcp_failure MODE (3 ranks over TCP) and checks that the job ends non-zero within 25 s
# (before the launcher's SIGKILL) and that its output matches PATTERN (e.g. names rank 1).
# Usage: EXE MODE PATTERN [TIMEOUT_S]
set -uo pipefail
exe=$1 mode=$2 pattern=$3
export SHARDLM_COMM_TIMEOUT_S=${4:-120}
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$(date +%s%N)
timeout -s KILL 90 "$exe" "$mode" >"$log" 2>&1
rc=$?
elapsed_ms=$((($(date +%s%N) - start) / 1000000))
cat "$log"
echo "--- tcp_failure $mode: exit $rc after ${elapsed_ms} ms"
fail() { echo "FAIL: $*" >&2; exit 1; }
[[ $rc -ne 0 ]] || fail "the job exited 0"
[[ $elapsed_ms -lt 25000 ]] || fail "the job took ${elapsed_ms} ms (limit 25 s)"
grep -Eq -- "$pattern" "$log" || fail "the output does not match: $pattern"
echo "ok"
