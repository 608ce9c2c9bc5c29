#!/usr/bin/env bash
# Creates (or completes) the Python venv that tests and benchmarks use as references and peers:
# PyTorch (CPU build), transformers, DeepSpeed, the tokenizer/checkpoint libraries, gguf
# (llama.cpp's reader) and llama-cpp-python (llama.cpp itself), the last two for test_gguf, and
# TRL with datasets (test_formats: SFTTrainer's prompt/completion tokenization).
# Python is never part of the product. The venv lives outside the repository (default
# ~/.cache/shardlm/venv, or $SHARDLM_VENV) so that it is downloaded once per machine.
# Idempotent: a venv whose packages all import is left as it is.
# GPT-2's real BPE ranks (test_bpe's parity with tiktoken) come from the openai-whisper sdist,
# which ships them as whisper/assets/gpt2.tiktoken: only that file is unpacked, into
# $venv/assets/ (tiktoken itself would download them at run time).
# Exit 1 when something cannot be installed (no network, say); tests that need a missing package
# then skip and say which.
set -uo pipefail

venv=${SHARDLM_VENV:-$HOME/.cache/shardlm/venv}

# module to import = pip requirement
PACKAGES=(
  "transformers=transformers"
  "deepspeed=deepspeed"
  "safetensors=safetensors"
  "tokenizers=tokenizers"
  "tiktoken=tiktoken"
  "sentencepiece=sentencepiece"
  "peft=peft"
  "google.protobuf=protobuf"
  "bitsandbytes=bitsandbytes"
  "tensorboard=tensorboard"
  "gguf=gguf"
  "llama_cpp=llama-cpp-python==0.3.36"
  "trl=trl"
  "datasets=datasets"
)

die() {
  echo "setup-venv: $*" >&2
  exit 1
}

command -v python3 >/dev/null || die "python3 is missing (Debian: apt-get install python3 python3-venv)"
if [[ ! -x $venv/bin/python ]]; then
  echo "setup-venv: creating $venv"
  python3 -m venv "$venv" || die "python3 -m venv $venv failed; install the venv module" \
    "(Debian: apt-get install python3-venv)"
fi
py=$venv/bin/python

missing=()
"$py" -c 'import torch' 2>/dev/null || missing+=(torch)
for entry in "${PACKAGES[@]}"; do
  "$py" -c "import ${entry%%=*}" 2>/dev/null || missing+=("${entry#*=}")
done
gpt2_ranks() {
  local asset=$venv/assets/gpt2.tiktoken tmp
  [[ -s $asset ]] && return 0
  tmp=$(mktemp -d) || return 1
  "$py" -m pip download --quiet --no-deps --no-binary :all: --timeout 30 --retries 2 \
    openai-whisper==20250625 -d "$tmp" &&
    tar -xzf "$tmp"/openai_whisper-*.tar.gz -C "$tmp" --wildcards '*/whisper/assets/gpt2.tiktoken' &&
    mkdir -p "$venv/assets" && mv "$tmp"/openai_whisper-*/whisper/assets/gpt2.tiktoken "$asset"
  local rc=$?
  rm -rf "$tmp"
  [[ $rc -eq 0 ]] || echo "setup-venv: could not fetch GPT-2's ranks (openai-whisper)" >&2
  return $rc
}

if [[ ${#missing[@]} -eq 0 ]]; then
  gpt2_ranks || exit 1
  echo "setup-venv: $venv has every package"
  exit 0
fi

echo "setup-venv: installing into $venv: ${missing[*]} (large downloads, once per machine)"
"$py" -m pip install --quiet --upgrade pip || true
if [[ " ${missing[*]} " == *" torch "* ]]; then
  # The CPU-only wheel is a fraction of the size; plain PyPI is the fallback.
  "$py" -m pip install --quiet --timeout 30 --retries 2 torch \
    --index-url https://download.pytorch.org/whl/cpu ||
    "$py" -m pip install --quiet torch || die "could not install torch into $venv"
fi
rest=()
for m in "${missing[@]}"; do [[ $m == torch ]] || rest+=("$m"); done
if [[ ${#rest[@]} -gt 0 ]]; then
  # DeepSpeed builds no ops at install time: the tests only call its estimators.
  # llama-cpp-python compiles llama.cpp (about 8 minutes on 2 cores, once per machine): its
  # CPU library only, portable, without its common library, tools, tests or multimodal part.
  DS_BUILD_OPS=0 CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_NATIVE=OFF -DGGML_OPENMP=OFF -DLLAMA_BUILD_TESTS=OFF \
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF \
-DLLAMA_BUILD_COMMON=OFF -DLLAMA_HTTPLIB=OFF -DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF"} \
    "$py" -m pip install --quiet --timeout 30 --retries 2 "${rest[@]}" ||
    die "could not install ${rest[*]} into $venv"
fi

for entry in torch=torch "${PACKAGES[@]}"; do
  "$py" -c "import ${entry%%=*}" 2>/dev/null || die "${entry#*=} still does not import in $venv"
done
gpt2_ranks || exit 1
echo "setup-venv: $venv ready"
