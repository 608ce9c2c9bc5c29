#!/usr/bin/env bash
# The longest sequence each scenario trains within a per-rank memory budget, as the planner
# says (`shardlm plan --fit`, which searches ZeRO stage and offload, checkpointing and its
# offload, tp/pp/cp and the MLP chunk): a bisection on data.seq_len in steps of 1024 tokens, one
# row per scenario (markdown). The plan is the engine's own ledger arithmetic (plan == ledger is
# tested), so no GPU is needed to run this.
#
#   bench/plan_context.sh [BUILD_DIR] [--small-gpu | --dpo] [-- extra --set options for all]
#
# e.g. `bench/plan_context.sh build -- --set precision.activations=fp32` for the fp32 figures.
# --small-gpu: instead, the longest instruction LoRA and QLoRA fine-tune on 24 GiB cards with
# 64 GiB of host memory in the machine (shared by its ranks), on 1, 2 and 4 cards.
# --dpo: instead, the longest preference pair (chosen and rejected together: one row of
# data.seq_len) DPO trains with LoRA and with full fine-tuning on 1 and 8 cards of 78 GiB.
set -euo pipefail
build=${1:-build}
shift || true
small_gpu=0 dpo=0
[[ ${1:-} == "--small-gpu" ]] && { small_gpu=1; shift; }
[[ ${1:-} == "--dpo" ]] && { dpo=1; shift; }
[[ ${1:-} == "--" ]] && shift
extra=("$@")
bin="$build/shardlm"
[[ -x $bin ]] || { echo "plan_context.sh: no $bin; build first" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)

# fits WORLD DEV HOST SEQ ARGS...: exit 0 when some configuration fits.
fits() {
  local world=$1 dev=$2 host=$3 seq=$4
  shift 4
  "$bin" plan --config "$root/configs/demo.json" --world "$world" --set data.seq_len="$seq" \
    --set train.micro_batch=1 --set precision.param=bf16 --gpu-mem "$dev" --host-mem "$host" \
    --fit "$@" "${extra[@]}" >/dev/null 2>&1
}

# longest WORLD DEV HOST ARGS...: the largest multiple of 1024 (up to 64M) that fits, else 0.
longest() {
  local world=$1 dev=$2 host=$3
  shift 3
  local lo=0 hi=65536  # in units of 1024 tokens; lo fits (or is 0), hi does not
  fits "$world" "$dev" "$host" $((hi * 1024)) "$@" && { echo $((hi * 1024)); return; }
  while ((hi - lo > 1)); do
    local mid=$(((lo + hi) / 2))
    if fits "$world" "$dev" "$host" $((mid * 1024)) "$@"; then lo=$mid; else hi=$mid; fi
  done
  echo $((lo * 1024))
}

row() {
  local name=$1 world=$2 dev=$3 host=$4
  shift 4
  printf '| %s | %s | %s GiB | %s GiB | %s |\n' "$name" "$world" "$dev" "$host" \
    "$(longest "$world" "$dev" "$host" "$@")"
}

echo "| scenario | ranks | device/rank | host/rank | longest seq_len |"
echo "|---|---|---|---|---|"
lora=(--set lora.rank=16 --set lora.alpha=32)
qlora=("${lora[@]}" --set lora.base_dtype=nf4)
if ((small_gpu)); then
  for model in "Llama-3.1-8B llama3.1-8b" "Qwen3-8B qwen3-8b" "GLM-4-9B glm4-9b"; do
    name=${model% *} preset=${model#* }
    for ranks in 1 2 4; do
      row "$name LoRA r16" "$ranks" 24 $((64 / ranks)) --set model.preset="$preset" "${lora[@]}" \
        --set sample.count=0
      row "$name QLoRA r16 (NF4 base)" "$ranks" 24 $((64 / ranks)) --set model.preset="$preset" \
        --set sample.count=0 \
        "${qlora[@]}"
    done
  done
  exit 0
fi
if ((dpo)); then
  for ranks in 1 8; do
    row "Llama-3.1-8B DPO, LoRA r16" "$ranks" 78 240 --set model.preset=llama3.1-8b \
      --set train.objective=dpo --set sample.count=0 "${lora[@]}"
    row "Llama-3.1-8B DPO, full fine-tuning" "$ranks" 78 240 --set model.preset=llama3.1-8b \
      --set train.objective=dpo --set sample.count=0
  done
  exit 0
fi
row "Llama-3.1-8B full fine-tuning" 1 78 240 --set model.preset=llama3.1-8b
row "Llama-3.1-8B full fine-tuning" 8 78 240 --set model.preset=llama3.1-8b
row "Llama-3.1-70B full fine-tuning" 64 78 240 --set model.preset=llama3.1-70b
row "Llama-3.1-8B LoRA r16" 1 78 240 --set model.preset=llama3.1-8b "${lora[@]}"
row "Llama-3.1-8B LoRA r16" 1 78 120 --set model.preset=llama3.1-8b "${lora[@]}"
# 8 ranks: at ZeRO-3 the bf16 base's decoder layers are sharded over the ZeRO group.
row "Llama-3.1-8B LoRA r16" 8 78 240 --set model.preset=llama3.1-8b "${lora[@]}"
row "Llama-3.1-70B LoRA r16" 8 78 240 --set model.preset=llama3.1-70b "${lora[@]}"
row "Llama-3.1-8B full fine-tuning" 1 78 120 --set model.preset=llama3.1-8b
row "Llama-3.1-8B QLoRA r16 (NF4 base)" 1 78 240 --set model.preset=llama3.1-8b "${qlora[@]}"
row "Llama-3.1-8B QLoRA r16 (NF4 base)" 1 78 120 --set model.preset=llama3.1-8b "${qlora[@]}"
row "Llama-3.1-70B QLoRA r16 (NF4 base)" 1 78 240 --set model.preset=llama3.1-70b "${qlora[@]}"
row "Llama-3.1-70B QLoRA r16 (NF4 base)" 1 78 120 --set model.preset=llama3.1-70b "${qlora[@]}"
