#!/usr/bin/env bash
# Fetches the cuDNN C++ frontend (header-only; the CUDA backend's fused attention is written
# against it) into a cache outside the repository: ${SHARDLM_CUDNN_FRONTEND:-~/.cache/shardlm/
# cudnn-frontend}/include, where CMake looks for it. The headers come from NVIDIA's PyPI wheel
# nvidia-cudnn-frontend (its include/ directory; the wheel's Python module is not used), pinned
# below so that every machine compiles the same frontend. Debian packages no cuDNN frontend.
# Idempotent: a cache holding this version is left as it is.
# Exit 1 when it cannot be fetched (no network, no pip): the CUDA build then uses its own
# attention kernel and says so at configure time.
set -uo pipefail

version=1.32.0
dest=${SHARDLM_CUDNN_FRONTEND:-$HOME/.cache/shardlm/cudnn-frontend}

die() {
  echo "fetch-cudnn-frontend: $*" >&2
  exit 1
}

if [[ -s $dest/include/cudnn_frontend.h && $(cat "$dest/VERSION" 2>/dev/null) == "$version" ]]; then
  echo "fetch-cudnn-frontend: $dest has cuDNN frontend $version"
  exit 0
fi
command -v python3 >/dev/null || die "python3 is missing (Debian: apt-get install python3 python3-venv)"
tmp=$(mktemp -d) || die "mktemp failed"
trap 'rm -rf "$tmp"' EXIT

# pip from the system Python, else from a throwaway venv (Debian's python3 has no pip module).
py=python3
if ! python3 -m pip --version >/dev/null 2>&1; then
  python3 -m venv "$tmp/venv" >/dev/null 2>&1 ||
    die "python3 has no pip and cannot make a venv (Debian: apt-get install python3-venv)"
  py=$tmp/venv/bin/python
fi
"$py" -m pip download --quiet --no-deps --only-binary :all: --timeout 30 --retries 2 \
  "nvidia-cudnn-frontend==$version" -d "$tmp/wheel" ||
  die "could not download nvidia-cudnn-frontend $version from PyPI"

# Only the headers: a wheel is a zip archive, read with Python (unzip may be absent).
"$py" - "$tmp/wheel" "$tmp/out" <<'PY' || die "the wheel has no include/cudnn_frontend.h"
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    names = [n for n in z.namelist() if n.startswith("include/") and not n.endswith("/")]
    if "include/cudnn_frontend.h" not in names:
        sys.exit(1)
    z.extractall(sys.argv[2], names)
PY
mkdir -p "$(dirname "$dest")" || die "cannot create $(dirname "$dest")"
rm -rf "$dest"
mv "$tmp/out" "$dest" || die "cannot move the headers to $dest"
echo "$version" >"$dest/VERSION"
echo "fetch-cudnn-frontend: cuDNN frontend $version headers in $dest/include"
