#!/usr/bin/env bash
# Writes the demo corpus: the King James Bible (public domain, Debian's bible-kjv-text) as
# plain text, one verse per line, chapters separated by a blank line (one document each).
# Usage: scripts/prepare-demo-data.sh OUTPUT.txt   (idempotent: keeps an existing file)
set -euo pipefail
out=${1:-data/kjv.txt}
if [[ -s "$out" ]]; then
  echo "prepare-demo-data: $out exists"
  exit 0
fi
if ! command -v bible >/dev/null 2>&1; then
  echo "prepare-demo-data: the 'bible' program is missing; run scripts/install-deps.sh" >&2
  exit 1
fi
mkdir -p "$(dirname "$out")"
# Lines look like "Ge1:1 In the beginning ..."; the reference is dropped, and a change of
# book or chapter starts a new document.
bible -f "Gen1:1-Rev22:21" | awk '
  match($0, /^[0-9]?[A-Za-z]+[0-9]+:[0-9]+ /) {
    ref = substr($0, 1, RLENGTH - 1); text = substr($0, RLENGTH + 1)
    split(ref, parts, ":"); chapter = parts[1]
    if (NR > 1 && chapter != last) printf "\n"
    last = chapter; print text
  }' > "$out.tmp"
mv "$out.tmp" "$out"
echo "prepare-demo-data: wrote $out ($(wc -c < "$out") bytes)"
