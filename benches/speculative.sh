#!/usr/bin/env bash
# Speculative decoding benchmark (docs/speculative.md, numbers in docs/benchmarks.md): one
# `mlxhost serve` of MODEL (default qwen2.5-coder-0.5b, installed with `mlxhost models pull`)
# with DRAFT_MODEL as its --draft-model (default qwen2.5-coder-0.5b: the 0.5B drafting for the
# 1.5B, or for itself as a wiring check; DRAFT_MODEL=none: no draft model), plugins/ (built by
# scripts/build-plugins.sh), the same prompts without speculation, with prompt lookup and with
# the draft model, at batch 1 and at concurrency 8 (benches/speculative.py; its env:
# MAX_TOKENS, N1, LEVELS, SETS, ROUNDS, DRAFTERS, N_MAX).
#   benches/speculative.sh                       # MODEL=qwen2.5-coder-0.5b
#   MODEL=qwen2.5-coder-1.5b benches/speculative.sh   # the 0.5B drafting for the 1.5B
#   MODEL=smollm2-135m DRAFT_MODEL=smollm2-135m benches/speculative.sh
#   BIN=target/debug/mlxhost benches/speculative.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${BIN:-target/release/mlxhost}"
MODEL="${MODEL:-qwen2.5-coder-0.5b}"
PORT="${PORT:-18090}"
DRAFT_MODEL="${DRAFT_MODEL:-qwen2.5-coder-0.5b}"
LOG=$(mktemp -t mlxhost-speculative.XXXXXX.log)
DRAFT_ARGS=()
if [ "$DRAFT_MODEL" != none ]; then
  DRAFT_ARGS=(--draft-model "$DRAFT_MODEL")
  export DRAFTERS="${DRAFTERS:-prompt-lookup draft-model}"
fi
# No prompt cache: every mode sends the same prompts and must prefill them alike.
"$BIN" serve --model "$MODEL" "${DRAFT_ARGS[@]}" --plugins plugins --port "$PORT" --prompt-cache 0 ${MLXHOST_ARGS:-} 2>"$LOG" &
PID=$!
trap 'kill $PID 2>/dev/null || true; wait $PID 2>/dev/null || true' EXIT
for _ in $(seq 1 600); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  kill -0 $PID 2>/dev/null || { cat "$LOG" >&2; exit 1; }
  sleep 0.5
done
echo "mlxhost $("$BIN" --version 2>/dev/null || true), model $MODEL, draft model $DRAFT_MODEL, $(nproc) cores, $(date -u +%FT%TZ)" >&2
python3 benches/speculative.py "http://127.0.0.1:$PORT"
