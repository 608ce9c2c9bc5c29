#!/usr/bin/env bash
# Tokenizer throughput: `shardlm tokenize` on 1 thread and on every core against Hugging Face
# `tokenizers` (Tokenizer.encode_batch, same thread counts) with the same tokenizer.json (GPT-2's
# real ranks) on the same documents (the KJV demo corpus, repeated BENCH_REPEAT times), and a
# markdown table of tokens/s. Also checks that the multithreaded shards are byte-identical to
# the single-threaded ones. Measures, never asserts. See bench/README.md.
# Usage: bench/tokenize.sh BUILD_DIR   (env: SHARDLM_VENV, BENCH_REPEAT (default 4))
set -euo pipefail

die() {
  echo "bench/tokenize.sh: $*" >&2
  exit 1
}

[[ $# -eq 1 ]] || die "usage: bench/tokenize.sh BUILD_DIR (the CMake build directory holding shardlm)"
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$(cd "$1" 2>/dev/null && pwd) || die "build directory '$1' does not exist; run 'make build'"
shardlm=$build/shardlm
[[ -x $shardlm ]] || die "$shardlm is missing; build it first ('make shardlm')"
cd "$repo"

venv=${SHARDLM_VENV:-$HOME/.cache/shardlm/venv}
SHARDLM_VENV=$venv bash scripts/setup-venv.sh >/dev/null || die "could not set up the venv at $venv"
python=$venv/bin/python
ranks=$venv/assets/gpt2.tiktoken
[[ -s $ranks ]] || die "$ranks is missing (scripts/setup-venv.sh fetches it)"
bash scripts/prepare-demo-data.sh data/kjv.txt >/dev/null

out=bench/results/tokenize
rm -rf "$out"
mkdir -p "$out"
repeat=${BENCH_REPEAT:-4}
text=$out/corpus.txt
for ((i = 0; i < repeat; i++)); do
  cat data/kjv.txt
  printf '\n'
done >"$text"
"$python" bench/tokenize_peer.py tokenizer "$ranks" "$out/gpt2"
cores=$(nproc)

# shardlm: best of 3 runs of the whole command's tokenize_files (read, encode, write shards),
# from its log line "... in S s on N threads (R tokens/s)".
shardlm_run() {
  local threads=$1 best="" line s
  for _ in 1 2 3; do
    rm -rf "$out/corpus_$threads"
    line=$("$shardlm" tokenize --tokenizer "$out/gpt2" --threads "$threads" --input "$text" \
      --output "$out/corpus_$threads" | grep '^tokenized')
    s=$(sed -E 's/.* in ([0-9.]+) s on.*/\1/' <<<"$line")
    if [[ -z $best ]] || awk -v a="$s" -v b="$best" 'BEGIN{exit !(a < b)}'; then best=$s; fi
  done
  local tokens
  tokens=$(sed -E 's/.*documents, ([0-9]+) tokens.*/\1/' <<<"$line")
  echo "$tokens $best"
}

read -r s_tokens s1 < <(shardlm_run 1)
read -r _ sn < <(shardlm_run "$cores")
identical=no
cmp -s <(cd "$out/corpus_1" && cat index.json shard_*.bin) \
  <(cd "$out/corpus_$cores" && cat index.json shard_*.bin) && identical=yes
p1=$("$python" bench/tokenize_peer.py encode "$out/gpt2" "$text" 1)
pn=$("$python" bench/tokenize_peer.py encode "$out/gpt2" "$text" "$cores")
field() { "$python" -c "import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])" "$1" "$2"; }
h_tokens=$(field "$p1" tokens)

rate() { awk -v t="$1" -v s="$2" 'BEGIN{printf "%.0f", t / s}'; }
{
  echo "Corpus: $(wc -c <"$text") bytes, $(field "$p1" documents) documents (data/kjv.txt x $repeat);"
  echo "tokens: shardlm $s_tokens, tokenizers $h_tokens (each + 1 end-of-text per document);"
  echo "shards of $cores threads byte-identical to 1 thread's: $identical. Best of 3 runs."
  echo "Load average when done: $(cut -d' ' -f1-3 /proc/loadavg) on $cores cores."
  echo
  echo "| engine | threads | seconds | tokens/s |"
  echo "| --- | ---: | ---: | ---: |"
  echo "| shardlm tokenize (read + encode + write shards) | 1 | $s1 | $(rate "$s_tokens" "$s1") |"
  echo "| shardlm tokenize (read + encode + write shards) | $cores | $sn | $(rate "$s_tokens" "$sn") |"
  printf '| tokenizers %s encode_batch (in memory) | 1 | %.3f | %.0f |\n' \
    "$("$python" -c 'import tokenizers; print(tokenizers.__version__)')" \
    "$(field "$p1" seconds)" "$(field "$p1" tokens_per_s)"
  printf '| tokenizers encode_batch (in memory) | %s | %.3f | %.0f |\n' "$cores" \
    "$(field "$pn" seconds)" "$(field "$pn" tokens_per_s)"
} | tee "$out/table.md"
