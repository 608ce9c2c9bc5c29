#!/usr/bin/env bash
# check-dist.sh: does a dist (scripts/make-dist.sh) run somewhere else, on its own?
#
#   scripts/check-dist.sh cpu|cuda [DIST_DIR]       (DIST_DIR default: dist)
#
# Unpacks DIST_DIR/shardlm-*-FLAVOR.tar.xz into a temporary directory, with the dist's build
# tree moved aside for the duration, then checks that
#   - every binary resolves every library, and each one either from the dist's lib/ or from
#     what a node provides (glibc, the NVIDIA driver, CUDA's libraries), never from this
#     machine's packages;
#   - the CPU kernel tests of tests/ pass from there;
#   - cpu: bin/shardlm trains the demo config for a few steps from there, and samples;
#   - cuda: the tarball is under 60 MiB, the binary plans on the CPU, and scripts/gpu-check.sh
#     --phase tests on a machine without a GPU exits 3 with the plain message.
set -euo pipefail

flavor=${1:?usage: check-dist.sh cpu|cuda [DIST_DIR]}
root=$(cd "$(dirname "$0")/.." && pwd)
dist_dir=$(cd "${2:-$root/dist}" && pwd)
max_cuda_mib=60

die() { echo "check-dist: FAIL: $*" >&2; exit 1; }
say() { echo "check-dist: $*"; }

tarball=$(ls "$dist_dir"/shardlm-*-"$flavor".tar.xz 2>/dev/null | head -1)
[[ -n $tarball ]] || die "no $dist_dir/shardlm-*-$flavor.tar.xz (make dist$([[ $flavor == cuda ]] && echo -cuda))"
tmp=$(mktemp -d)
build=$root/${DIST_BUILD_DIR:-build-dist-$flavor}
hidden=$build.hidden-by-check-dist
restore() {
  [[ -d $hidden ]] && mv "$hidden" "$build"
  rm -rf "$tmp"
}
trap restore EXIT
[[ -d $build ]] && mv "$build" "$hidden"

tar -C "$tmp" -xJf "$tarball"
home=$(ls -d "$tmp"/shardlm-*-"$flavor")
say "unpacked $(basename "$tarball") ($(($(stat -c %s "$tarball") / 1048576)) MiB) into a temporary directory"

# The same list as make-dist.sh's: what a node is expected to have.
node_provided='^(linux-vdso|ld-linux|libc|libm|libpthread|libdl|librt|libresolv|libutil|libanl)\.so|^lib(cuda|nvidia-|cudart|cublas|cublasLt|nccl|cudnn|nvrtc|nvJitLink)'
for f in "$home"/bin/* "$home"/tests/test_*; do
  while read -r soname arrow path _; do
    [[ $arrow == "=>" ]] || continue
    [[ $path == not ]] && die "$(basename "$f") needs $soname and the loader does not find it"
    [[ $soname =~ $node_provided ]] && continue
    [[ $(realpath -m "$path") == "$home"/lib/* ]] ||
      die "$(basename "$f") takes $soname from $path, not from the dist's lib/"
  done < <(ldd "$f")
done
say "ldd: every library of bin/ and tests/ resolves, from lib/ or from what a node provides"

# The CPU kernel tests, run from the dist as gpu-check.sh runs them (their data through
# SHARDLM_SOURCE_DIR): the x86-64-v3 build's kernels against their fp64 references.
for t in "$home"/tests/test_*; do
  [[ $(basename "$t") == test_cuda_* ]] && continue
  SHARDLM_SOURCE_DIR=$home OMP_NUM_THREADS=2 "$t" >"$tmp/test.log" 2>&1 ||
    { tail -30 "$tmp/test.log" >&2; die "$(basename "$t") failed from the unpacked dist"; }
done
say "the dist's CPU kernel tests pass from there"

if [[ $flavor == cpu ]]; then
  run=$tmp/run
  (cd "$home" && OMP_NUM_THREADS=2 bin/shardlm train --config configs/demo.json \
    --set train.max_steps=5 --set train.eval_every=0 --set sample.max_new_tokens=16 \
    --set sample.count=1 --set "log.dir=\"$run\"") >"$tmp/train.log" 2>&1 ||
    { tail -20 "$tmp/train.log" >&2; die "the demo config did not train from the unpacked dist"; }
  steps=$(grep -c '"step_ms"' "$run/metrics.jsonl")
  [[ $steps -eq 5 ]] || die "the demo run logged $steps steps, not 5"
  say "bin/shardlm trained the demo config 5 steps from the unpacked dist: $(grep '"step_ms"' "$run/metrics.jsonl" | tail -1 | grep -o '"loss":[0-9.]*')"
else
  mib=$(($(stat -c %s "$tarball") / 1048576))
  ((mib < max_cuda_mib)) || die "the CUDA tarball is $mib MiB, over $max_cuda_mib MiB"
  (cd "$home" && bin/shardlm plan --config configs/demo.json >/dev/null) ||
    die "bin/shardlm plan failed from the unpacked CUDA dist"
  say "the CUDA tarball is $mib MiB; bin/shardlm plans on the CPU"
  if nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
    say "this machine has a GPU: run $home/scripts/gpu-check.sh itself (the no-GPU message is for machines without one)"
  else
    rc=0
    "$home/scripts/gpu-check.sh" "$tmp/check" --phase tests 2>"$tmp/check.log" || rc=$?
    [[ $rc -eq 3 ]] && grep -q 'no NVIDIA GPU' "$tmp/check.log" ||
      die "gpu-check.sh without a GPU exited $rc, not 3 with 'no NVIDIA GPU': $(cat "$tmp/check.log")"
    say "without a GPU, gpu-check.sh exits 3 and says: $(cat "$tmp/check.log")"
  fi
fi
say "PASS ($flavor)"
