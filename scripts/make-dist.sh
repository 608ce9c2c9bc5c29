#!/usr/bin/env bash
# make dist / make dist-cuda: a self-contained, relocatable shardlm for another machine (a bare
# GPU node with the driver, CUDA and PyTorch, no Debian packages, no network).
#
# Usage: scripts/make-dist.sh cpu|cuda [OUT_DIR]      (OUT_DIR default: dist)
# Writes OUT_DIR/shardlm-VERSION-FLAVOR/ and OUT_DIR/shardlm-VERSION-FLAVOR.tar.xz:
#   bin/      shardlm, shardlm-bench-attention and shardlm-bench-gemm
#   tests/    the CPU kernel tests and, for cuda, the gpu-labelled tests (scripts/gpu-check.sh
#             runs them with SHARDLM_SOURCE_DIR pointing at the dist)
#   lib/      every shared library those need beyond glibc, the NVIDIA driver and the CUDA
#             libraries (cuBLASLt, NCCL, cuDNN, cudart: taken from the node), found through an
#             $ORIGIN-relative RPATH
#   configs/, data/kjv.txt, tests/data/, the Backend header (the op table checks its coverage
#   against it), bench/ (the GPU peers), scripts/gpu-check.sh
# The build: -march=$DIST_MARCH (default x86-64-v3), no MPI (several GPUs start through the
# torchrun-style TCP rendezvous), CUDA for $CUDA_ARCHS (default 90a), stripped.
set -euo pipefail

flavor=${1:?usage: make-dist.sh cpu|cuda [OUT_DIR]}
[[ $flavor == cpu || $flavor == cuda ]] || { echo "make-dist: flavor must be cpu or cuda" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
out=$(mkdir -p "${2:-dist}" && cd "${2:-dist}" && pwd)
build=${DIST_BUILD_DIR:-build-dist-$flavor}
march=${DIST_MARCH:-x86-64-v3}
cuda_archs=${CUDA_ARCHS:-90a}
jobs=${JOBS:-$(nproc)}

die() { echo "make-dist: $*" >&2; exit 1; }
for tool in cmake patchelf strip ldd readelf tar xz; do
  command -v $tool >/dev/null || die "$tool is missing (Debian: scripts/install-deps.sh installs it)"
done

version=$(sed -n 's/^project(shardlm VERSION \([0-9.]*\).*/\1/p' CMakeLists.txt)
name=shardlm-$version-$flavor
kernel_tests=$(cd tests/kernels && ls test_*.cpp | sed 's/\.cpp$//')
targets=(shardlm shardlm-bench-attention shardlm-bench-gemm $kernel_tests)
flags=(-DCMAKE_BUILD_TYPE=Release -DSHARDLM_MARCH="$march" -DSHARDLM_MPI=OFF)
if [[ $flavor == cuda ]]; then
  nvcc=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null || true)
  [[ -n $nvcc ]] || die "nvcc not found (PATH, /usr/local/cuda/bin): the CUDA dist needs the toolkit"
  export PATH="$(dirname "$nvcc"):$PATH"
  flags+=(-DSHARDLM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$cuda_archs")
  targets+=($(cd tests/gpu && ls test_*.cpp | sed 's/\.cpp$//'))
fi
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)

echo "make-dist: building $name in $build (-march=$march$([[ $flavor == cuda ]] && echo ", sm_$cuda_archs"))"
cmake "${generator[@]}" -S . -B "$build" "${flags[@]}" >/dev/null
cmake --build "$build" -j "$jobs" --target "${targets[@]}"

dest=$out/$name
rm -rf "$dest" "$dest.tar.xz"
mkdir -p "$dest"/{bin,tests,lib}
cp "$build/shardlm" "$build/bench/shardlm-bench-attention" "$build/bench/shardlm-bench-gemm" "$dest/bin/"
for t in "${targets[@]:3}"; do cp "$build/tests/$t" "$dest/tests/"; done
# test_nvml_processes's stand-in for the driver's NVML, which it opens beside itself.
cp "$build/tests/libfake_nvml.so" "$dest/tests/"
# Host code only: strip keeps the CUDA fatbin sections (they are data, not debug info).
strip --strip-unneeded "$dest"/bin/* "$dest"/tests/*

# The libraries a node is expected to have: glibc, the driver, and CUDA's own (their versions
# must match the driver, so they come from the node's CUDA or PyTorch's NVIDIA wheels).
node_provided='^(linux-vdso|ld-linux|libc|libm|libpthread|libdl|librt|libresolv|libutil|libanl)\.so|^lib(cuda|nvidia-|cudart|cublas|cublasLt|nccl|cudnn|nvrtc|nvJitLink)'
bundle() {  # copies the non-provided libraries an ELF file needs (ldd: the whole closure)
  ldd "$1" | while read -r soname arrow path _; do
    [[ $arrow == "=>" ]] || continue
    [[ $soname =~ $node_provided ]] && continue
    [[ $path == "not" ]] && die "$1 needs $soname, which this machine does not have"
    [[ -e $dest/lib/$soname ]] && continue
    cp -L "$path" "$dest/lib/$soname"
    chmod u+w "$dest/lib/$soname"
    patchelf --set-rpath '$ORIGIN' "$dest/lib/$soname"
  done
}
for f in "$dest"/bin/* "$dest"/tests/*; do
  bundle "$f"
  patchelf --set-rpath '$ORIGIN/../lib' "$f"
done

# What the tests and gpu-check.sh read, in the repository's layout (SHARDLM_SOURCE_DIR=$dest).
[[ -f data/kjv.txt ]] || bash scripts/prepare-demo-data.sh data/kjv.txt
mkdir -p "$dest"/{data,tests/data,tests/integration,scripts,bench}
cp -r configs "$dest/"
cp data/kjv.txt "$dest/data/"
cp tests/data/genesis_1_12.txt "$dest/tests/data/"
cp tests/integration/baseline_tiny_loss.json "$dest/tests/integration/"
# The op table's coverage test reads the Backend interface it must cover.
mkdir -p "$dest/include/shardlm/backend"
cp include/shardlm/backend/backend.h "$dest/include/shardlm/backend/"
cp scripts/gpu-check.sh scripts/gpu-check-phases.sh "$dest/scripts/"
cp -r bench/gpu bench/torch_peer.py "$dest/bench/"
find "$dest/bench" -name __pycache__ -prune -exec rm -rf {} +
sed -e "s/@VERSION@/$version/g" -e "s/@FLAVOR@/$flavor/g" -e "s/@MARCH@/$march/g" \
  -e "s/@CUDA_ARCHS@/$([[ $flavor == cuda ]] && echo "sm_$cuda_archs" || echo none)/g" \
  docs/dist-README.md >"$dest/README.md"
cat >"$dest/BUILD.json" <<EOF
{"name": "$name", "version": "$version", "flavor": "$flavor", "march": "$march",
 "cuda_archs": "$([[ $flavor == cuda ]] && echo "$cuda_archs")", "mpi": false,
 "commit": "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)",
 "built": "$(date -u +%Y-%m-%dT%H:%M:%SZ)", "compiler": "$(c++ --version | head -1)"}
EOF

tar -C "$out" -cf - "$name" | xz -T"$jobs" -6 >"$dest.tar.xz"
echo "make-dist: $dest ($(du -sm "$dest" | cut -f1) MiB unpacked)"
echo "make-dist: $dest.tar.xz ($(( $(stat -c %s "$dest.tar.xz") / 1048576 )) MiB)"
