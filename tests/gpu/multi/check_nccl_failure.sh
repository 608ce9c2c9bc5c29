#!/usr/bin/env bash
# Runs nccl_failure on 2 ranks (one GPU each) and checks that the job ends with rank 0's exit 1
# within 60 s, its output naming the op that timed out. Exit 77 (ctest's skip) when the program
# finds fewer GPUs than ranks. Usage: MPIEXEC EXE
set -uo pipefail
mpiexec=$1 exe=$2
log=$(mktemp)
trap 'rm -f "$log"' EXIT
start=$(date +%s%N)
timeout -s KILL 90 "$mpiexec" -n 2 --oversubscribe --bind-to none "$exe" >"$log" 2>&1
rc=$?
elapsed_ms=$((($(date +%s%N) - start) / 1000000))
cat "$log"
echo "--- nccl_failure: exit $rc after ${elapsed_ms} ms"
grep -q "^skipped: needs one GPU per rank" "$log" && exit 77
fail() { echo "FAIL: $*" >&2; exit 1; }
[[ $rc -ne 0 ]] || fail "the job exited 0"
[[ $elapsed_ms -lt 60000 ]] || fail "the job took ${elapsed_ms} ms (limit 60 s)"
grep -q "passed a collective nobody joined" "$log" && fail "the compute stream did not wait"
pattern="rank 0 of 2: all_reduce of 8 elements on NCCL communicator 'world' .* did not complete within 2 s .*ending rank 0 of 2 now"
grep -Eq -- "$pattern" "$log" || fail "the output does not match: $pattern"
echo "ok"
