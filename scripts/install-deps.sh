#!/usr/bin/env bash
# Installs the Debian packages shardlm needs to build, test and run its demo.
# Idempotent: packages already present are skipped; uses sudo when not root.
# Where the CUDA toolkit is installed, also fetches the cuDNN frontend headers (the CUDA
# backend's fused attention; scripts/fetch-cudnn-frontend.sh) into a cache outside the
# repository; without them the CUDA build keeps its own attention kernel.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libopenblas-dev libopenblas-openmp-dev libomp-dev
  openmpi-bin libopenmpi-dev
  nlohmann-json3-dev libcli11-dev libfmt-dev zlib1g-dev libpcre2-dev libicu-dev libsentencepiece-dev
  libprotobuf-dev protobuf-compiler libboost-dev
  libgtest-dev googletest
  clang-format tmux
  patchelf xz-utils
  bible-kjv bible-kjv-text
  python3 python3-venv
)

if [[ ! -r /etc/debian_version ]] || ! command -v apt-get >/dev/null 2>&1; then
  echo "install-deps: this script supports Debian (12+) and derivatives with apt-get." >&2
  echo "install-deps: on other systems install the equivalents of: ${PACKAGES[*]}" >&2
  exit 1
fi

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

cudnn_frontend() {
  command -v nvcc >/dev/null 2>&1 || [[ -x /usr/local/cuda/bin/nvcc ]] || return 0
  bash "$(dirname "$0")/fetch-cudnn-frontend.sh" ||
    echo "install-deps: no cuDNN frontend: the CUDA build will use its own attention kernel" >&2
}

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all packages present"
  cudnn_frontend
  exit 0
fi

SUDO=()
if [[ $(id -u) -ne 0 ]]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "install-deps: need root or sudo to install: ${missing[*]}" >&2
    exit 1
  fi
  SUDO=(sudo)
fi

echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
"${SUDO[@]}" apt-get update -qq
"${SUDO[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
cudnn_frontend
