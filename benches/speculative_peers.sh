#!/usr/bin/env bash
# The peers' own speculative decoding beside benches/speculative.sh (issue 40; numbers in
# docs/speculative.md): the same prompts (benches/speculative.py's code edits and free text),
# greedy, batch 1, on the same files:
#   - llama.cpp's `llama-server` (built by benches/llama_server_env.sh from the llama-cpp-python
#     0.3.16 sdist) on the TARGET GGUF, without and with `-md DRAFT` (its draft-model
#     speculation; --draft-max 16, the rest its defaults), two servers side by side, requests
#     alternating;
#   - `mlx_lm.generate` (mlx-lm 0.32.2, benches/side_by_side.sh's venv) on `mlxhost convert` of
#     the same GGUFs, without and with `--draft-model`.
#   benches/speculative_peers.sh                     # 1.5B target, 0.5B draft
#   PEERS=llama benches/speculative_peers.sh         # llama.cpp only (PEERS="llama mlx-lm")
# Env: TARGET, DRAFT (GGUF file names under $MLXHOST_CACHE/models, installed by `mlxhost models
# pull`), MAX_TOKENS, N1, SETS (benches/speculative_peers.py).
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${MLXHOST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mlxhost}"
TARGET="$CACHE/models/${TARGET:-qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}"
DRAFT="$CACHE/models/${DRAFT:-qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}"
PEERS="${PEERS:-llama mlx-lm}"
for f in "$TARGET" "$DRAFT"; do
  [ -f "$f" ] || { echo "speculative_peers: $f is missing (mlxhost models pull ...)" >&2; exit 1; }
done
echo "$(nproc) cores, $(date -u +%FT%TZ), target $(basename "$TARGET"), draft $(basename "$DRAFT")" >&2
if [[ " $PEERS " == *" llama "* ]]; then
  # shellcheck source=benches/llama_server_env.sh
  . benches/llama_server_env.sh
  P1=18191 P2=18192
  "$LLAMA_SERVER" -m "$TARGET" -c 8192 -t "$(nproc)" -np 1 --port $P1 >/tmp/llama-plain.log 2>&1 &
  A=$!
  "$LLAMA_SERVER" -m "$TARGET" -md "$DRAFT" --draft-max 16 -c 8192 -t "$(nproc)" -np 1 \
    --port $P2 >/tmp/llama-draft.log 2>&1 &
  B=$!
  trap 'kill $A $B 2>/dev/null || true' EXIT
  for p in $P1 $P2; do
    for _ in $(seq 1 300); do curl -sf "http://127.0.0.1:$p/health" >/dev/null && break; sleep 1; done
  done
  python3 benches/speculative_peers.py llama "http://127.0.0.1:$P1" "http://127.0.0.1:$P2"
  kill $A $B 2>/dev/null || true
  trap - EXIT
fi
if [[ " $PEERS " == *" mlx-lm "* ]]; then
  # shellcheck source=benches/side_by_side.sh
  . benches/side_by_side.sh
  T_DIR="$CACHE/models/$(basename "$TARGET" .gguf)-mlx"
  D_DIR="$CACHE/models/$(basename "$DRAFT" .gguf)-mlx"
  [ -f "$T_DIR/config.json" ] || "$BIN" convert "$TARGET" "$T_DIR" >&2
  [ -f "$D_DIR/config.json" ] || "$BIN" convert "$DRAFT" "$D_DIR" >&2
  python3 benches/speculative_peers.py mlx-lm "$VENV/bin/python" "$T_DIR" "$D_DIR"
fi
