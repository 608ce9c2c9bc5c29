#!/usr/bin/env bash
# `shardlm convert hf-import`: time and peak resident memory (GNU time's %M) importing a
# transformers-made Llama of dim 512, 12 layers of MLP width 6144 (126M parameters, 481 MiB in
# f32, one model.safetensors) as fp32 and bf16. Needs the reference venv (torch, transformers).
# Usage: bench/hf_import.sh BUILD_DIR_OR_BINARY
set -euo pipefail
BIN=${1:?usage: bench/hf_import.sh BUILD_DIR_OR_BINARY}
[[ -d "$BIN" ]] && BIN="$BIN/shardlm"
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=${SHARDLM_BENCH_OUT:-$ROOT/bench/results/hf_import}
PY=${SHARDLM_VENV:-$HOME/.cache/shardlm/venv}/bin/python
mkdir -p "$OUT"
if [[ ! -f "$OUT/hf/model.safetensors" ]]; then
  "$PY" - "$OUT/hf" <<'PYEOF'
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
c = LlamaConfig(hidden_size=512, intermediate_size=6144, num_hidden_layers=12,
                num_attention_heads=8, num_key_value_heads=8, vocab_size=320,
                max_position_embeddings=1024, tie_word_embeddings=False)
LlamaForCausalLM(c).to(torch.float32).save_pretrained(sys.argv[1], safe_serialization=True)
PYEOF
fi
cat "$OUT/hf/model.safetensors" >/dev/null  # in the page cache for every run alike
for dtype in fp32 bf16; do
  rm -rf "$OUT/ck_$dtype"
  /usr/bin/time -f "hf-import --dtype $dtype: %e s, peak resident %M KiB" \
    "$BIN" convert hf-import "$OUT/hf" --output "$OUT/ck_$dtype" --dtype "$dtype" >/dev/null
done
