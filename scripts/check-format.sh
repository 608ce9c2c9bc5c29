#!/usr/bin/env bash
# Fails (listing the files) when any C++ source differs from .clang-format's output.
set -euo pipefail
CLANG_FORMAT=${1:-clang-format}
cd "$(dirname "$0")/.."
mapfile -t files < <(git ls-files -co --exclude-standard -- '*.h' '*.cpp' '*.cu' '*.cuh')
bad=()
for f in "${files[@]}"; do
  [[ -f "$f" ]] || continue
  if ! "$CLANG_FORMAT" --dry-run --Werror "$f" >/dev/null 2>&1; then bad+=("$f"); fi
done
if [[ ${#bad[@]} -gt 0 ]]; then
  echo "not formatted (run 'make format'):" >&2
  printf '  %s\n' "${bad[@]}" >&2
  exit 1
fi
echo "format: ${#files[@]} files ok"
