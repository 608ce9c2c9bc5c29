# The phases of scripts/gpu-check.sh, sourced by it (it sets $dist, $bin, $py and $out and has
# checked the GPU and the libraries). phase_NAME writes $out/NAME/: the raw outputs, section.md
# (its tables) and verdict.txt (one line); write_report assembles $out/report.md from whatever
# phases have run, so phases run in separate windows add up to one report.

gpu_check_report() { "$py" "$dist/bench/gpu/report.py" "$@"; }

# ---- the node ---------------------------------------------------------------------------------
node_info() {
  local versions libs
  versions=$("$py" - 2>/dev/null <<'PY' || echo "PyTorch: not importable by $py"
import torch, transformers
nccl = ".".join(map(str, torch.cuda.nccl.version())) if hasattr(torch.cuda, "nccl") else "?"
print(f"PyTorch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN "
      f"{torch.backends.cudnn.version()}, NCCL {nccl}), transformers {transformers.__version__}")
PY
)
  libs=$(ldd "$bin" | awk '/cublasLt|nccl|cudnn/ {printf "%s%s", sep, $3; sep = ", "}')
  cat <<EOF
# GPU node check

| | |
| --- | --- |
| date | $(date -u '+%Y-%m-%d %H:%M UTC') |
| GPU | $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader -i 0) ($(nvidia-smi -L | wc -l) on this node) |
| driver | $(nvidia-smi --query-gpu=driver_version --format=csv,noheader -i 0) (CUDA $(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -1)) |
| host | $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1), $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2 / 1048576}' /proc/meminfo) |
| Python side | $versions |
| shardlm | $(sed -n 's/.*"name": "\([^"]*\)".*/\1/p' "$dist/BUILD.json") ($(sed -n 's/.*"commit": "\([^"]*\)".*/\1/p' "$dist/BUILD.json")), libraries from the node: $libs |
EOF
}

write_report() {
  local f
  {
    cat "$out/node.md"
    printf '\n## Verdicts\n\n'
    for f in tests speed-train speed-attention memory context; do
      [[ -f $out/$f/verdict.txt ]] && echo "- $(cat "$out/$f/verdict.txt")"
    done
    for f in tests speed-train speed-attention memory context; do
      [[ -f $out/$f/section.md ]] && { echo; cat "$out/$f/section.md"; }
    done
  } >"$out/report.md"
}

# ---- tests: the gpu-labelled binaries, then the CPU kernel tests they compare against ---------
# One row per test of a gtest log: PASS|FAIL|SKIP|CRASH <tab> binary <tab> test <tab> ms.
gtest_rows() {
  awk -v bin="$1" '
    /^\[ RUN      \] / { running = substr($0, 14); next }
    /^\[ +(OK|FAILED|SKIPPED) +\] .*\([0-9]+ ms\)$/ {
      tag = $2; rest = $0; sub(/^\[[^]]*\] /, "", rest)
      ms = rest; sub(/.*\(/, "", ms); sub(/ ms\)$/, "", ms)
      name = rest; sub(/ \([0-9]+ ms\)$/, "", name); sub(/, where .*/, "", name)
      print (tag == "OK" ? "PASS" : tag == "FAILED" ? "FAIL" : "SKIP") "\t" bin "\t" name "\t" ms
      running = ""
    }
    END { if (running != "") print "CRASH\t" bin "\t" running "\t" }' "$2"
}

# The tests phase's list: every binary (GPU_CHECK_TESTS=all, the default), the gpu-labelled
# ones (gpu), or the given `binary[:gtest_filter]` entries, space-separated, in that order (a
# short window runs what never ran first), one per line.
test_specs() {
  local t
  case ${GPU_CHECK_TESTS:-all} in
    all | gpu)
      for t in "$dist"/tests/test_cuda_*; do basename "$t"; done
      [[ ${GPU_CHECK_TESTS:-all} == gpu ]] && return
      for t in "$dist"/tests/test_*; do basename "$t"; done
      ;;
    *) tr ' ' '\n' <<<"$GPU_CHECK_TESTS" | awk 'NF' ;;
  esac
}

phase_tests() {
  local dir=$out/tests t name spec filter log rc rows=() failed passed skipped
  rm -rf "$dir" && mkdir -p "$dir"
  : >"$dir/results.tsv"
  while read -r spec; do
    [[ " ${rows[*]} " == *" $spec "* ]] && continue
    rows+=("$spec")
    name=${spec%%:*}
    filter=
    [[ $spec == *:* ]] && filter=${spec#*:}
    t=$dist/tests/$name
    log=$dir/$(tr -c 'A-Za-z0-9_.\n-' '_' <<<"$spec").log
    if [[ ! -x $t ]]; then
      printf 'CRASH\t%s\t(no such test binary in the dist)\t\n' "$name" >>"$dir/results.tsv"
      continue
    fi
    SHARDLM_SOURCE_DIR=$dist SHARDLM_BINARY=$bin timeout "${GPU_CHECK_TEST_TIMEOUT:-420}" "$t" --gtest_color=no \
      ${filter:+"--gtest_filter=$filter"} >"$log" 2>&1
    rc=$?
    gtest_rows "$name" "$log" >>"$dir/results.tsv"
    # A binary that died without a failing test (a crash at start, a timeout) is a failure too.
    if [[ $rc -ne 0 ]] && ! grep -q "^FAIL.$name\|^CRASH.$name" "$dir/results.tsv"; then
      printf 'CRASH\t%s\t(exit %s%s)\t\n' "$name" "$rc" "$([[ $rc == 124 ]] && echo ': timed out')" \
        >>"$dir/results.tsv"
    fi
  done < <(test_specs)
  passed=$(grep -c '^PASS' "$dir/results.tsv")
  skipped=$(grep -c '^SKIP' "$dir/results.tsv")
  failed=$(grep -c '^FAIL\|^CRASH' "$dir/results.tsv")
  {
    printf '## Tests\n\nEvery test of the gpu-labelled binaries; the CPU kernel tests (the reference the GPU kernels are compared with) one row per binary, with any failure named.\n\n'
    printf '| binary | test | result | ms |\n| --- | --- | --- | --- |\n'
    awk -F'\t' '$2 ~ /^test_cuda_/ || $1 != "PASS" { printf "| %s | %s | %s | %s |\n", $2, $3, $1, $4 }' \
      "$dir/results.tsv"
    awk -F'\t' '$2 !~ /^test_cuda_/ && $1 == "PASS" { n[$2]++ }
      END { for (b in n) printf "| %s | (every test) | %d PASS |  |\n", b, n[b] }' "$dir/results.tsv" | sort
  } >"$dir/section.md"
  if [[ $failed -eq 0 && $passed -gt 0 ]]; then
    echo "tests: PASS ($passed passed, $skipped skipped)" >"$dir/verdict.txt"
  else
    echo "tests: FAIL ($failed failed: $(awk -F'\t' '$1 == "FAIL" || $1 == "CRASH" {
        if (++n <= 5) { printf "%s%s %s", sep, $2, $3; sep = "; " } }
        END { if (n > 5) printf "; and %d more", n - 5 }' "$dir/results.tsv"))" >"$dir/verdict.txt"
    return 1
  fi
}

# ---- budgets and the planner -------------------------------------------------------------------
# The device budget given to `plan --fit`: the GPU's free memory less 1 GiB for the CUDA context
# and the libraries' own allocations, which are outside shardlm's ledger; the host's: 90% of
# what the kernel reports available.
device_budget_gib() {
  nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits -i 0 | awk '{printf "%.2f", $1 / 1024 - 1}'
}
host_budget_gib() { awk '/MemAvailable/ {printf "%.2f", 0.9 * $2 / 1048576}' /proc/meminfo; }

# plan --fit for CONFIG with the rest as --set arguments: $dir/plan.json and, when something
# fits, $dir/config.json (the chosen configuration, whole). Returns 0 when it fits.
shardlm_fit() {
  local config=$1 dir=$2
  shift 2
  "$bin" plan --fit --json --gpu-mem "$(device_budget_gib)" --host-mem "$(host_budget_gib)" \
    --config "$config" "$@" --fit-output "$dir/config.json" >"$dir/plan.json" 2>"$dir/plan.log"
  grep -q '"fits": true' "$dir/plan.json"
}

# Runs a command for at most BUDGET seconds (then SIGKILL: a node check must not write an 8B
# checkpoint), sampling the GPU's used memory and the process's resident memory every second
# into $dir/samples.tsv; $dir/run.json says how it ended.
run_sampled() {
  local dir=$1 budget=$2
  shift 2
  local base pid t0=$SECONDS rc=0 ended=finished
  base=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0)
  "$@" >"$dir/run.log" 2>&1 &
  pid=$!
  : >"$dir/samples.tsv"
  while kill -0 "$pid" 2>/dev/null; do
    if ((SECONDS - t0 >= budget)); then
      kill -9 "$pid" 2>/dev/null
      ended=killed
      break
    fi
    printf '%s\t%s\n' "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i 0)" \
      "$(awk '/VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null)" >>"$dir/samples.tsv"
    sleep 1
  done
  wait "$pid"
  rc=$?
  awk -F'\t' -v base="$base" -v rc="$rc" -v ended="$ended" -v s="$((SECONDS - t0))" \
    '{ if ($1 - base > d) d = $1 - base; if ($2 > h) h = $2 }
     END { printf "{\"ended\": \"%s\", \"rc\": %d, \"seconds\": %d, \"driver_peak_bytes\": %.0f, \"rss_peak_bytes\": %.0f}\n",
           ended, rc, s, d * 1048576, h * 1024 }' "$dir/samples.tsv" >"$dir/run.json"
}

# ---- speed ---------------------------------------------------------------------------------------
# model, T, sequences per step, steps (the first two are warm-up)
# (GPU_CHECK_SPEED_CASES replaces the list: cases separated by ';')
SPEED_CASES=("llama3.2-1b 2048 2 8" "llama3.2-1b 8192 1 8" "llama3.1-8b 8192 1 5")
[[ -n ${GPU_CHECK_SPEED_CASES:-} ]] && IFS=';' read -r -a SPEED_CASES <<<"$GPU_CHECK_SPEED_CASES"

phase_speed_train() {
  local dir=$out/speed-train spec model T B steps c mb ga peer=$dist/bench/gpu/torch_gpu_peer.py
  rm -rf "$dir" && mkdir -p "$dir"
  # The MFU denominator: shardlm's own cuBLASLt bf16 rate; PyTorch's beside it for reference.
  timeout 120 "$dist/bin/shardlm-bench-gemm" --device cuda >"$dir/gemm.json" 2>"$dir/gemm.log"
  timeout 120 "$py" "$dist/bench/gpu/gemm_rate.py" >"$dir/gemm_torch.json" 2>"$dir/gemm_torch.log"
  for spec in "${SPEED_CASES[@]}"; do
    read -r model T B steps <<<"$spec"
    c=$dir/$model-T$T
    mkdir -p "$c"
    if shardlm_fit "$dist/bench/gpu/$model.json" "$c" --set data.seq_len=$T \
      --set train.micro_batch=$B --set train.max_steps=$steps --set "log.dir=\"$c/run\""; then
      timeout 360 "$bin" train --config "$c/config.json" >"$c/shardlm.log" 2>&1
      echo $? >"$c/shardlm.rc"
      # Where the step goes: a short run with log.profile (it waits for every op, so it is
      # never the timed one).
      timeout 150 "$bin" train --config "$c/config.json" --set log.profile=true \
        --set train.max_steps=4 --set "log.dir=\"$c/profile\"" >"$c/profile.log" 2>&1
    fi
    # PyTorch trains the rows that shardlm's chosen micro-batch and accumulation give.
    mb=$(sed -n 's/.*"micro_batch": \([0-9]*\).*/\1/p' "$c/config.json" 2>/dev/null)
    ga=$(sed -n 's/.*"grad_accum": \([0-9]*\).*/\1/p' "$c/config.json" 2>/dev/null)
    for mode in eager compile; do
      timeout 300 "$py" "$peer" --config "$dist/bench/gpu/$model.json" --seq-len "$T" \
        --micro-batch "${mb:-$B}" --grad-accum "${ga:-1}" --steps "$steps" \
        $([[ $mode == compile ]] && echo --compile) >"$c/torch_$mode.json" 2>"$c/torch_$mode.log"
    done
  done
  gpu_check_report speed-train "$dir"
}

ATTENTION_SEQ=${GPU_CHECK_ATTENTION_SEQ:-8192,16384,32768,65536,131072}

phase_speed_attention() {
  local dir=$out/speed-attention backend
  rm -rf "$dir" && mkdir -p "$dir"
  timeout 300 "$dist/bin/shardlm-bench-attention" --device cuda --dtype bf16 --seq "$ATTENTION_SEQ" \
    --heads 32 --kv-heads 8 --head-dim 128 --budget-s "${GPU_CHECK_ATTENTION_BUDGET_S:-150}" >"$dir/shardlm.jsonl" 2>"$dir/shardlm.log"
  for backend in flash cudnn; do
    timeout 120 "$py" "$dist/bench/gpu/attention_peer.py" --backend $backend --seq "$ATTENTION_SEQ" \
      --heads 32 --kv-heads 8 --head-dim 128 >"$dir/$backend.jsonl" 2>"$dir/$backend.log"
  done
  gpu_check_report speed-attention "$dir"
}

# ---- memory --------------------------------------------------------------------------------------
# Each real run's budget: long enough to allocate the plan and start the step (a step at the
# longest T may take longer: the report says how far it got); the peer's search budget. Two
# modes of (run + plan searches + peer) stay under the phase's 8 minutes.
MEMORY_RUN_S=75
PEER_SEARCH_S=90

# The longest T (a multiple of 4096) for which `FN T ARGS...` succeeds: doubling, then
# bisecting. Prints 0 when not even 4096 does.
longest_seq() {
  local fn=$1 lo=0 hi=4096 mid
  shift
  while "$fn" $hi "$@"; do
    lo=$hi
    hi=$((hi * 2))
    ((hi > 1 << 24)) && break
  done
  while ((hi - lo > 4096)); do
    mid=$(((lo + hi) / 2 / 4096 * 4096))
    if "$fn" $mid "$@"; then lo=$mid; else hi=$mid; fi
  done
  echo $lo
}

# plan --fit at T: fit_at T CONFIG DIR [--set ...].
fit_at() {
  local T=$1 config=$2 dir=$3
  shift 3
  shardlm_fit "$config" "$dir" --set data.seq_len=$T "$@"
}

phase_memory() {
  local dir=$out/memory mode c T model=$dist/bench/gpu/llama3.1-8b.json sets
  rm -rf "$dir" && mkdir -p "$dir"
  for mode in lora full; do
    c=$dir/$mode
    mkdir -p "$c/probe"
    sets=(--set data.valid_fraction=0 --set train.max_steps=1 --set train.warmup_steps=0
      --set "log.dir=\"$c/run\"")
    [[ $mode == lora ]] && sets+=(--set lora.rank=16 --set lora.alpha=32 --set lora.targets=all)
    T=$(longest_seq fit_at "$model" "$c/probe" "${sets[@]}")
    echo "$T" >"$c/longest_seq.txt"
    if ((T > 0)); then
      shardlm_fit "$model" "$c" --set data.seq_len=$T "${sets[@]}"
      run_sampled "$c" "$MEMORY_RUN_S" "$bin" train --config "$c/config.json"
    else
      shardlm_fit "$model" "$c" --set data.seq_len=4096 "${sets[@]}"  # the plan says why
    fi
    timeout $((PEER_SEARCH_S + 60)) "$py" "$dist/bench/gpu/longest_seq_peer.py" --config "$model" \
      --mode $mode --budget-s $PEER_SEARCH_S >"$c/torch.json" 2>"$c/torch.log"
  done
  gpu_check_report memory "$dir"
}

# ---- context -------------------------------------------------------------------------------------
# Context parallelism on this one GPU: cp = P ranks share it (parallel.device_comm = "host", every
# rank's device tensors staged through the host; `shardlm launch`, as the dist has no MPI), each
# holding 1/P of every sequence, ZeRO-3 over them. Per P: the longest T (a multiple of 4096) the
# plan fits in 1/P of the GPU's free memory (less 1 GiB per rank beyond the first: its CUDA
# context and libraries), a dry run that allocates it for real on every rank (each rank's
# memory_rank json: plan, ledger and the driver's count of its own memory), and a timed run at
# one common T for the step time against cp = 1. GPU_CHECK_CONTEXT_CP, GPU_CHECK_CONTEXT_T and
# GPU_CHECK_CONTEXT_MODEL narrow it; GPU_CHECK_CONTEXT_DEVICE=cpu, GPU_CHECK_CONTEXT_BUDGET_GIB
# and GPU_CHECK_CONTEXT_RANK_GIB (the 1 GiB) let the CPU test run the same script.
read -r -a CONTEXT_CP <<<"${GPU_CHECK_CONTEXT_CP:-1 2 4}"
CONTEXT_T=${GPU_CHECK_CONTEXT_T:-16384}
CONTEXT_STEPS=4  # the first two untimed
CONTEXT_RUN_S=120

# The per-rank device budget (GiB) for P ranks on the GPU.
context_budget_gib() {
  local free=${GPU_CHECK_CONTEXT_BUDGET_GIB:-$(device_budget_gib)}
  awk -v f="$free" -v p="$1" -v r="${GPU_CHECK_CONTEXT_RANK_GIB:-1}" \
    'BEGIN { printf "%.3f", (f - (p - 1) * r) / p }'
}

# The fixed configuration of P ranks at T, as --set arguments (the model's config comes first).
context_sets() {
  local P=$1 T=$2
  printf '%s\n' --set "parallel.cp=$P" --set parallel.cp_kind=\"ulysses\" \
    --set parallel.device_comm=\"host\" --set zero.stage=3 --set memory.checkpointing=\"full\" \
    --set precision.param=\"bf16\" --set train.micro_batch=1 --set train.grad_accum=1 \
    --set "train.device=\"${GPU_CHECK_CONTEXT_DEVICE:-cuda}\"" --set "data.seq_len=$T" \
    --set data.valid_fraction=0 --set train.eval_every=0 --set train.eval_batches=0 \
    --set train.warmup_steps=0 --set sample.count=0 --set checkpoint.at_end=false \
    --set checkpoint.every_steps=0
}

# Whether the plan of P ranks at T fits `budget` GiB of device memory per rank:
# context_fits T CONFIG P BUDGET.
context_fits() {
  local T=$1 config=$2 P=$3 budget=$4
  local -a sets
  mapfile -t sets < <(context_sets "$P" "$T")
  "$bin" plan --config "$config" --world "$P" --gpu-mem "$budget" "${sets[@]}" >/dev/null 2>&1
}

# P ranks of `shardlm train` on GPU 0 for at most CONTEXT_RUN_S seconds, the rest of the
# arguments theirs (a log.dir among them). `shardlm launch` passes the timeout's SIGTERM to its
# ranks; any rank of this run still alive 20 s later is killed, so that none holds the GPU into
# the next run. Only this run's: a process whose command line holds its log.dir (the ranks lead
# process groups of their own), never another shardlm on the node.
context_run() {
  local P=$1
  shift
  local -a cmd=("$bin" train)
  ((P > 1)) && cmd=("$bin" launch --nproc "$P" -- train)
  CUDA_VISIBLE_DEVICES=0 timeout -k 20 "$CONTEXT_RUN_S" "${cmd[@]}" "$@"
  local rc=$? arg mine="" pid
  for arg in "$@"; do [[ $arg == log.dir=* ]] && mine=$arg; done
  if [[ -n $mine ]]; then
    for pid in $(pgrep -f "^$bin "); do
      tr '\0' '\n' <"/proc/$pid/cmdline" 2>/dev/null | grep -qxF -- "$mine" &&
        kill -9 "$pid" 2>/dev/null
    done
  fi
  return $rc
}

phase_context() {
  local dir=$out/context model=${GPU_CHECK_CONTEXT_MODEL:-$dist/bench/gpu/llama3.2-1b.json}
  local P c T budget
  local -a sets
  rm -rf "$dir" && mkdir -p "$dir"
  echo "$CONTEXT_T" >"$dir/common_seq.txt"
  basename "$model" .json >"$dir/model.txt"
  for P in "${CONTEXT_CP[@]}"; do
    c=$dir/cp$P
    mkdir -p "$c"
    budget=$(context_budget_gib "$P")
    echo "$budget" >"$c/budget_gib.txt"
    T=$(longest_seq context_fits "$model" "$P" "$budget")
    echo "$T" >"$c/longest_seq.txt"
    if ((T > 0)); then
      mapfile -t sets < <(context_sets "$P" "$T")
      context_run "$P" --config "$model" "${sets[@]}" --set train.max_steps=1 \
        --set "log.dir=\"$c/longest\"" --dry-run >"$c/longest.log" 2>&1
      echo $? >"$c/longest.rc"
    fi
    mapfile -t sets < <(context_sets "$P" "$CONTEXT_T")
    context_run "$P" --config "$model" "${sets[@]}" --set "train.max_steps=$CONTEXT_STEPS" \
      --set "log.dir=\"$c/timed\"" >"$c/timed.log" 2>&1
    echo $? >"$c/timed.rc"
  done
  gpu_check_report context "$dir"
}
