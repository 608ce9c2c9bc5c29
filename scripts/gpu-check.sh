#!/usr/bin/env bash
# gpu-check.sh: does this GPU node train correctly, and how fast, and how long a sequence fits?
# Run from an unpacked CUDA dist (make dist-cuda) on a node with an NVIDIA GPU:
#
#   scripts/gpu-check.sh OUT_DIR [--phase tests|speed|memory|context|all] [--python PY]
#
# Phases (each under 8 minutes on one H100; run them one at a time in short windows):
#   tests            every gpu-labelled test (CUDA kernels against the CPU backend, end-to-end
#                    runs against the stored CPU loss curve, planner == ledger == driver bytes)
#                    and the CPU kernel tests behind them; pass/fail per test
#   speed            speed-train then speed-attention:
#   speed-train      Llama-3.2-1B shape at T = 2048 and 8192, Llama-3.1-8B shape at T = 8192:
#                    shardlm (the configuration `plan --fit` picks for this GPU) against PyTorch
#                    + transformers eager bf16 autocast and torch.compile, same tokens
#   speed-attention  causal attention forward + backward, T = 8K..128K: shardlm's kernel
#                    against PyTorch SDPA's flash and cuDNN backends
#   memory           Llama-3.1-8B: the longest sequence `plan --fit` finds for LoRA and for full
#                    fine-tuning with offload on this GPU and host, run for real, against what
#                    transformers reaches with gradient checkpointing
#   context          context parallelism with cp = 1, 2, 4 ranks sharing this GPU (device
#                    tensors staged through the host): the longest sequence each plans and
#                    allocates for real, and the step time at one common length
# OUT_DIR/report.md: the node, one verdict line per phase run so far, then each phase's tables;
# raw JSON and logs beside it. For a short window, the environment narrows a phase:
# GPU_CHECK_TESTS=gpu (only the gpu-labelled binaries) or a space-separated list of
# binary[:gtest_filter] run in that order (e.g. "test_cuda_kernels:*Marks*
# test_cuda_shared_gpu:*ContextParallel*"), GPU_CHECK_TEST_TIMEOUT (seconds per test binary,
# 420), GPU_CHECK_SPEED_CASES ("MODEL T SEQUENCES STEPS" cases separated by ';'),
# GPU_CHECK_ATTENTION_SEQ (comma-separated T), GPU_CHECK_ATTENTION_BUDGET_S (150),
# GPU_CHECK_CONTEXT_CP ("1 2 4"), GPU_CHECK_CONTEXT_T (the common length, 16384). speed and
# memory need a Python with torch and transformers (and peft for memory): $PYTHON or --python,
# else python3. Exit 0 when every phase ran and the tests passed, 1 when a test failed or a
# phase could not finish, 3 when the node lacks what a phase needs (a GPU, a library, PyTorch),
# 2 on bad usage.
set -uo pipefail

dist=$(cd "$(dirname "$0")/.." && pwd)
bin=$dist/bin/shardlm
py=${PYTHON:-python3}
phase=all
out=

usage() { sed -n '2,/^set -uo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2; exit 2; }
say() { echo "gpu-check: $*" >&2; }
need() { say "$1"; exit 3; }  # the node lacks something: a plain message, exit 3

while [[ $# -gt 0 ]]; do
  case $1 in
    --phase) phase=${2:-}; shift 2 ;;
    --python) py=${2:-}; shift 2 ;;
    -h | --help) usage ;;
    -*) say "unknown option $1"; usage ;;
    *) [[ -z $out ]] || usage; out=$1; shift ;;
  esac
done
[[ -n $out ]] || usage
case $phase in tests | speed | speed-train | speed-attention | memory | context | all) ;;
  *) usage ;;
esac

# ---- what the node must have ---------------------------------------------------------------
[[ -x $bin && -f $dist/BUILD.json ]] ||
  need "no shardlm dist around this script ($dist): unpack shardlm-*-cuda.tar.xz (make dist-cuda) and run its scripts/gpu-check.sh"
grep -q '"flavor": "cuda"' "$dist/BUILD.json" ||
  need "$dist is a CPU dist; a GPU check needs the CUDA one (make dist-cuda)"
command -v nvidia-smi >/dev/null ||
  need "no NVIDIA GPU: nvidia-smi is not on PATH ($PATH); this check needs a node with an NVIDIA GPU and its driver"
gpus=$(nvidia-smi -L 2>&1) && grep -q '^GPU ' <<<"$gpus" ||
  need "no NVIDIA GPU: nvidia-smi lists none (it said: ${gpus//$'\n'/ })"

# Why $py cannot serve the GPU peers, or nothing (it can).
python_problem() {
  command -v "$py" >/dev/null || { echo "not found"; return; }
  "$py" -c 'import torch, transformers
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device"' 2>&1 | tail -1
}

# Directories that may hold CUDA's libraries: LD_LIBRARY_PATH, the toolkit, and the NVIDIA
# wheels (nvidia-cublas, nvidia-nccl-cu13, ...) and torch/lib of the Python in use.
library_dirs() {
  tr ':' '\n' <<<"${LD_LIBRARY_PATH:-}"
  local home
  for home in "${CUDA_HOME:-}" "${CUDA_PATH:-}" /usr/local/cuda; do
    [[ -n $home ]] && printf '%s\n' "$home/lib64" "$home/lib" "$home/targets/x86_64-linux/lib"
  done
  "$py" - 2>/dev/null <<'PY'
import glob, os
roots = []
try:
    import nvidia
    roots += list(nvidia.__path__)
except ImportError:
    pass
try:
    import torch
    roots.append(os.path.dirname(torch.__file__))
except ImportError:
    pass
for r in roots:
    for d in sorted(set(os.path.dirname(p) for p in glob.glob(f"{r}/**/lib*.so*", recursive=True))):
        print(d)
PY
}

# Puts on LD_LIBRARY_PATH the directory of every library the binaries need and the loader does
# not find (cuBLASLt, NCCL, cuDNN, NVRTC: taken from the node, never shipped), or names what is
# missing.
find_libraries() {
  local missing so dir found searched
  missing=$(ldd "$bin" "$dist"/bin/* "$dist"/tests/* 2>/dev/null | awk '/=> not found/ {print $1}' | sort -u)
  [[ -z $missing ]] && return 0
  searched=$(library_dirs | awk 'NF && !seen[$0]++')
  for so in $missing; do
    found=
    while read -r dir; do
      [[ -n $dir && -e $dir/$so ]] && { found=$dir; break; }
    done <<<"$searched"
    [[ -n $found ]] ||
      need "bin/shardlm needs $so and it is not on this node: looked in the loader's cache, $(tr '\n' ' ' <<<"$searched")and the NVIDIA wheels of $py. Install CUDA 13's libraries, or pip install nvidia-cublas nvidia-nccl-cu13 nvidia-cudnn-cu13 nvidia-cuda-nvrtc into that Python, or put their directory on LD_LIBRARY_PATH"
    export LD_LIBRARY_PATH=$found${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  done
}
find_libraries

mkdir -p "$out" || { say "cannot create $out"; exit 2; }
out=$(cd "$out" && pwd)
source "$dist/scripts/gpu-check-phases.sh"

node_info >"$out/node.md"
status=0
run_phase() {  # name: runs it, its section and verdict land in $out/<name>/
  local name=$1 t0=$SECONDS
  say "phase $name ..."
  "phase_${name//-/_}" || status=1
  say "phase $name done in $((SECONDS - t0)) s: $(cat "$out/$name/verdict.txt" 2>/dev/null)"
}
needs_python() {  # the phase that needs it, for the message; the report so far is kept
  local problem
  problem=$(python_problem)
  [[ -z $problem ]] && return 0
  write_report
  need "the $1 phase needs a Python with torch (seeing the GPU) and transformers; $py: $problem; set PYTHON or --python"
}
case $phase in
  tests) run_phase tests ;;
  speed) needs_python speed && run_phase speed-train && run_phase speed-attention ;;
  speed-train | speed-attention) needs_python "$phase" && run_phase "$phase" ;;
  memory) needs_python memory && run_phase memory ;;
  context) run_phase context ;;  # its report needs no torch
  all)
    run_phase tests
    run_phase context
    needs_python speed && run_phase speed-train && run_phase speed-attention && run_phase memory
    ;;
esac
write_report
say "report: $out/report.md"
exit $status
