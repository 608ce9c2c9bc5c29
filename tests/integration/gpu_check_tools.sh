#!/usr/bin/env bash
# The tools of scripts/gpu-check.sh, run on the CPU so that a GPU window never meets their
# first bug: the PyTorch peers (--device cpu, tiny shapes), shardlm-bench-attention and
# shardlm-bench-gemm, the gtest log parser of the tests phase, the context phase whole (its
# ranks on the CPU), and bench/gpu/report.py over each phase's directory built from those real
# outputs. What only a GPU node gives (nvidia-smi's samples of the memory phase) is written by
# hand and says so.
#
#   gpu_check_tools.sh BUILD_DIR [PYTHON]    (default: the venv of scripts/setup-venv.sh)
# Exit 77 (CTest: skipped, with the reason) when that Python lacks torch, transformers or peft;
# 1 under SHARDLM_REQUIRE_REFERENCES=1.
set -euo pipefail

build=$(cd "${1:?usage: gpu_check_tools.sh BUILD_DIR PYTHON}" && pwd)
py=${2:-${SHARDLM_VENV:-$HOME/.cache/shardlm/venv}/bin/python}
root=$(cd "$(dirname "$0")/../.." && pwd)
# Found, not imported (importing peft takes seconds; the peers import what they use).
for module in torch transformers peft; do
  [[ -x $py ]] &&
    "$py" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)" \
      2>/dev/null || {
    echo "$py does not have $module (scripts/setup-venv.sh installs it)"
    # CI (SHARDLM_REQUIRE_REFERENCES=1): a missing reference fails; elsewhere it skips.
    [[ ${SHARDLM_REQUIRE_REFERENCES:-} == 1 ]] && exit 1
    exit 77
  }
done
tmp=$(mktemp -d)
trap '[[ -n ${KEEP_TMP:-} ]] && echo "kept $tmp" || rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; exit 1; }
expect() {  # file pattern what
  grep -q -- "$2" "$1" || { cat "$1" >&2; fail "$3: '$2' not in $(basename "$1")"; }
}
export OMP_NUM_THREADS=2

cat >"$tmp/tiny.json" <<EOF
{"model": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128,
           "vocab_size": 288, "rope_theta": 10000.0, "norm_eps": 1e-5,
           "tie_embeddings": true, "attn_bias": false},
 "data": {"train": "$root/tests/data/genesis_1_12.txt", "seq_len": 64, "valid_fraction": 0},
 "train": {"micro_batch": 2, "max_steps": 5, "warmup_steps": 1, "eval_every": 0, "eval_batches": 0},
 "checkpoint": {"at_end": false}, "sample": {"count": 0}}
EOF

# ---- speed-train: plan --fit, shardlm's run, the eager peer, the GEMM rates ---------------------
speed=$tmp/speed-train
case_dir=$speed/tiny-T64
mkdir -p "$case_dir"
"$build/bench/shardlm-bench-gemm" --device cpu --n 256 --reps 2 >"$speed/gemm.json"
expect "$speed/gemm.json" '"n": 256, "reps": 2, "bf16_tflops": [0-9.e-]*, "f32_tflops": [0-9.e-]*}' \
  "shardlm-bench-gemm"
"$py" "$root/bench/gpu/gemm_rate.py" --device cpu --n 256 --reps 2 >"$speed/gemm_torch.json"
"$build/shardlm" plan --fit --json --gpu-mem 1 --config "$tmp/tiny.json" \
  --set "log.dir=\"$case_dir/run\"" --fit-output "$case_dir/config.json" >"$case_dir/plan.json"
rc=0
"$build/shardlm" train --config "$case_dir/config.json" >"$case_dir/shardlm.log" 2>&1 || rc=$?
echo $rc >"$case_dir/shardlm.rc"
"$build/shardlm" train --config "$case_dir/config.json" --set log.profile=true \
  --set train.max_steps=4 --set "log.dir=\"$case_dir/profile\"" >"$case_dir/profile.log" 2>&1
for mode in eager compile; do  # torch.compile on the CPU: its C++ backend, about 30 s
  "$py" "$root/bench/gpu/torch_gpu_peer.py" --device cpu --config "$tmp/tiny.json" --seq-len 64 \
    --micro-batch 2 --steps 5 $([[ $mode == compile ]] && echo --compile) \
    >"$case_dir/torch_$mode.json" 2>"$case_dir/torch_$mode.log"
  expect "$case_dir/torch_$mode.json" '"mode": "'$mode'", .*"tokens_per_s"' "torch_gpu_peer.py"
done
"$py" "$root/bench/gpu/report.py" speed-train "$speed" || fail "report.py speed-train exited $?"
expect "$speed/verdict.txt" "^speed-train: tiny-T64 [0-9.]*x eager, [0-9.]*x compile$" \
  "the speed-train verdict"
expect "$speed/section.md" "| tiny-T64 | shardlm | mb 2 x ga 1, ZeRO 0" "shardlm's row"
expect "$speed/section.md" "| tiny-T64 | PyTorch eager | mb 2 x ga 1" "the eager row"
expect "$speed/section.md" "| tiny-T64 | PyTorch compile | mb 2 x ga 1" "the compile row"
expect "$speed/section.md" "Where shardlm's step goes" "the profile table"
expect "$speed/section.md" "^| attention | [0-9.]* s ([0-9.]*%) |$" "the profile's attention row"

# A shardlm run that failed makes the phase fail and names the case.
echo 1 >"$case_dir/shardlm.rc"
rc=0
"$py" "$root/bench/gpu/report.py" speed-train "$speed" || rc=$?
[[ $rc -eq 1 ]] || fail "report.py speed-train with a failed shardlm run exited $rc, not 1"
expect "$speed/verdict.txt" "speed-train: FAIL (tiny-T64: shardlm exit 1" "the failing verdict"

# ---- speed-attention: shardlm's bench and SDPA (math: the backend a CPU has) ---------------------
attn=$tmp/speed-attention
mkdir -p "$attn"
shape=(--seq 128,256 --heads 4 --kv-heads 2 --head-dim 16)
"$build/bench/shardlm-bench-attention" --device cpu --dtype fp32 "${shape[@]}" >"$attn/shardlm.jsonl"
"$py" "$root/bench/gpu/attention_peer.py" --device cpu --backend math --reps 2 "${shape[@]}" \
  >"$attn/flash.jsonl"
expect "$attn/flash.jsonl" '"T": 256, .*"fwd_bwd_tflops"' "attention_peer.py"
"$py" "$root/bench/gpu/report.py" speed-attention "$attn" || fail "report.py speed-attention exited $?"
expect "$attn/verdict.txt" "T=128 [0-9.]*x, T=256 [0-9.]*x" "the speed-attention verdict"
expect "$attn/section.md" "^| 256 | [0-9.]* (" "the T = 256 row"

# ---- memory: plan --fit and a real LoRA run; the driver's samples are a GPU's, written here -----
memory=$tmp/memory
lora=$memory/lora
mkdir -p "$lora"
echo 64 >"$lora/longest_seq.txt"
"$build/shardlm" plan --fit --json --gpu-mem 1 --config "$tmp/tiny.json" --set train.max_steps=1 \
  --set lora.rank=4 --set lora.alpha=8 --set lora.targets=all --set "log.dir=\"$lora/run\"" \
  --fit-output "$lora/config.json" >"$lora/plan.json"
"$build/shardlm" train --config "$lora/config.json" >"$lora/run.log" 2>&1
echo '{"ended": "finished", "rc": 0, "seconds": 1, "driver_peak_bytes": 0, "rss_peak_bytes": 0}' \
  >"$lora/run.json"  # run_sampled's record, which needs nvidia-smi
"$py" "$root/bench/gpu/longest_seq_peer.py" --device cpu --config "$tmp/tiny.json" --mode lora \
  --lo 64 --hi 128 --granularity 64 --budget-s 120 >"$lora/torch.json"
expect "$lora/torch.json" '"longest_seq": 128' "longest_seq_peer.py"
"$py" "$root/bench/gpu/report.py" memory "$memory" || fail "report.py memory exited $?"
expect "$memory/verdict.txt" "^memory: longest T, shardlm vs PyTorch: lora 64 vs 128$" "the memory verdict"
expect "$memory/section.md" "| lora | 64 | mb 2 x ga 1, ZeRO 0.*LoRA r4 |" "the LoRA row"

# ---- context: the phase itself, with the CPU as the device and a budget it fills -----------------
ctx=$tmp/context_phase
mkdir -p "$ctx"
GPU_CHECK_CONTEXT_DEVICE=cpu GPU_CHECK_CONTEXT_BUDGET_GIB=0.03 GPU_CHECK_CONTEXT_RANK_GIB=0 \
  GPU_CHECK_CONTEXT_CP="1 2" GPU_CHECK_CONTEXT_T=4096 GPU_CHECK_CONTEXT_MODEL="$tmp/tiny.json" \
  OMP_NUM_THREADS=1 bash -c "
  dist='$root' bin='$build/shardlm' out='$ctx' py='$py'
  source '$root/scripts/gpu-check-phases.sh'
  phase_context" || fail "phase_context exited $?"
for P in 1 2; do
  [[ -f $ctx/context/cp$P/longest/memory_rank$((P - 1)).json ]] ||
    fail "context: cp $P's dry run wrote no report for rank $((P - 1))"
done
expect "$ctx/context/verdict.txt" "^context: longest T cp 1 [0-9]*K, cp 2 [0-9]*K$" "the context verdict"
expect "$ctx/context/section.md" "^| 2 | 0.015 GiB | [0-9]*K | every rank allocated it: .*plan == ledger" \
  "the cp 2 row"
# A rank that did not allocate its plan fails the phase, naming the degree.
rm "$ctx/context/cp2/longest/memory_rank1.json"
rc=0
"$py" "$root/bench/gpu/report.py" context "$ctx/context" || rc=$?
[[ $rc -eq 1 ]] || fail "report.py context with a rank's report missing exited $rc, not 1"
expect "$ctx/context/verdict.txt" "context: FAIL (cp 2: the dry run" "the failing context verdict"

# ---- tests: the gtest log parser of gpu-check-phases.sh ------------------------------------------
log=$tmp/gtest.log
"$build/tests/test_rmsnorm" --gtest_color=no >"$log" 2>&1 || fail "test_rmsnorm failed"
printf '[ RUN      ] Crashing.Test\n' >>"$log"  # a binary that died inside a test
rows=$(bash -c "source '$root/scripts/gpu-check-phases.sh'; gtest_rows test_rmsnorm '$log'")
passed=$(grep -c '^\[       OK \]' "$log")
[[ $(grep -c '^PASS' <<<"$rows") -eq $passed ]] || fail "gtest_rows: not $passed PASS rows: $rows"
grep -q "^CRASH	test_rmsnorm	Crashing.Test	" <<<"$rows" || fail "gtest_rows missed the crash: $rows"
# ---- tests: the phase's list of binary[:filter] entries, in order, a missing binary a failure --
fake=$tmp/fake_dist
mkdir -p "$fake/tests" "$tmp/phases"
ln -s "$build/tests/test_rmsnorm" "$fake/tests/test_rmsnorm"
GPU_CHECK_TESTS="test_rmsnorm:*Backward* test_missing test_rmsnorm:*Backward*" bash -c "
  dist='$fake' bin=/bin/true out='$tmp/phases'
  source '$root/scripts/gpu-check-phases.sh'
  phase_tests" && fail "phase_tests passed with a missing binary"
results=$tmp/phases/tests/results.tsv
filtered=$("$build/tests/test_rmsnorm" --gtest_list_tests --gtest_filter='*Backward*' | grep -c '^  ')
[[ $filtered -gt 0 && $(grep -c '^PASS' "$results") -eq $filtered ]] ||
  fail "phase_tests: not the $filtered tests of the filter once: $(cat "$results")"
grep -q "^CRASH	test_missing	(no such test binary in the dist)" "$results" ||
  fail "phase_tests: the missing binary is not a failure: $(cat "$results")"
expect "$tmp/phases/tests/verdict.txt" "tests: FAIL (1 failed: test_missing" "the tests verdict"
echo "gpu-check tools: peers, bench, report.py, the log parser and the test list agree"
