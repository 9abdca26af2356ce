#!/usr/bin/env bash
# Model-forward benchmark, side by side in one run on the same files:
#   mlxhost --dtype native | float32 (the CPU default)  vs  mlx-lm 0.32.2 (its default 4-bit
#   path, and the same model dequantized to float32 with OpenBLAS preloaded).
# Reports prefill tok/s and per-token decode forward time (argmax fed back, each step evaluated).
#
#   benches/model_forward.sh            # defaults below
#   PROMPT=256 DECODE=64 REPEATS=3 benches/model_forward.sh
#
# mlx-lm is installed in a venv under $MLXHOST_CACHE (once); the model is the installed SmolLM2
# converted to the MLX layout by `mlxhost convert` (once), so both engines read identical files.
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPT="${PROMPT:-128}"; DECODE="${DECODE:-32}"; REPEATS="${REPEATS:-3}"
# mlx-lm's 4-bit path runs ~5 s per token on x86 CPUs (float16 quantized matmul), so it gets fewer steps.
NATIVE_PROMPT="${NATIVE_PROMPT:-16}"; NATIVE_DECODE="${NATIVE_DECODE:-3}"

. benches/side_by_side.sh

OUT=$(mktemp)
{
  "$BIN" bench --model "$MLX_DIR" --dtype float32 --prompt-tokens "$PROMPT" --decode-tokens "$DECODE" --repeats "$REPEATS"
  LD_PRELOAD="$OPENBLAS" "$VENV/bin/python" benches/mlx_lm_forward.py "$MLX_DIR" "$PROMPT" "$DECODE" "$REPEATS" float32
  "$BIN" bench --model "$MLX_DIR" --dtype native --prompt-tokens "$NATIVE_PROMPT" --decode-tokens "$NATIVE_DECODE" --repeats 1
  "$VENV/bin/python" benches/mlx_lm_forward.py "$MLX_DIR" "$NATIVE_PROMPT" "$NATIVE_DECODE" 1
} | tee "$OUT"

python3 - "$OUT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print()
print(f"{'engine':8} {'path':8} {'prompt':>6} {'prefill tok/s':>14} {'decode ms/tok':>14} {'decode tok/s':>13}")
for r in rows:
    print(f"{r['engine']:8} {r['compute']:8} {r['prompt_tokens']:>6} {r['prefill_tok_s']:>14.1f} {r['decode_ms_per_token']:>14.1f} {r['decode_tok_s']:>13.2f}")
by = {(r['engine'], r['compute']): r for r in rows}
ours, peer = by[('mlxhost', 'float32')], by[('mlx-lm', 'native')]
peer32 = by[('mlx-lm', 'float32')]
print()
print(f"default path (mlxhost float32) vs mlx-lm default (4-bit): decode {ours['decode_tok_s']/peer['decode_tok_s']:.1f}x, prefill {ours['prefill_tok_s']/peer['prefill_tok_s']:.1f}x")
print(f"mlxhost float32 vs mlx-lm float32+OpenBLAS: decode {ours['decode_tok_s']/peer32['decode_tok_s']:.2f}x, prefill {ours['prefill_tok_s']/peer32['prefill_tok_s']:.2f}x")
nat = by[('mlxhost', 'native')]
print(f"mlxhost native vs mlx-lm native: decode {nat['decode_tok_s']/peer['decode_tok_s']:.2f}x")
PY
rm -f "$OUT"
