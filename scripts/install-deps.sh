#!/usr/bin/env bash
# Installs the Debian packages shardlm needs to build, test and run its demo.
# Idempotent: packages already present are skipped; uses sudo when not root.
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config
  libopenblas-dev libopenblas-openmp-dev libomp-dev
  openmpi-bin libopenmpi-dev
  nlohmann-json3-dev libcli11-dev libfmt-dev zlib1g-dev libpcre2-dev libicu-dev libsentencepiece-dev
  libgtest-dev googletest
  clang-format
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

if [[ ${#missing[@]} -eq 0 ]]; then
  echo "install-deps: all packages present"
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
