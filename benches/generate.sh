#!/usr/bin/env bash
# Generation benchmark, side by side in one run on the same files: `mlxhost generate` (every
# token chosen by the `standard` WASM sampler plugin; plugin-call share of decode time is
# instrumented) on the default (float32) and native paths, vs mlx-lm 0.32.2's stream_generate
# (its default 4-bit path, and the model dequantized to float32 with OpenBLAS preloaded).
#   benches/generate.sh                 # MAX_TOKENS=64 (mlx-lm 4-bit: NATIVE_MAX_TOKENS=4)
set -euo pipefail
cd "$(dirname "$0")/.."
MAX_TOKENS="${MAX_TOKENS:-64}"; NATIVE_MAX_TOKENS="${NATIVE_MAX_TOKENS:-4}"
. benches/side_by_side.sh
./scripts/build-plugins.sh
PROMPT="Write a short story about a lighthouse keeper."
ours() {  # $1 = dtype, $2 = max tokens
  "$BIN" generate --model "$MLX_DIR" --plugins plugins --dtype "$1" --prompt "$PROMPT" --max-tokens "$2" 2>&1 >/dev/null \
    | sed -n 's/^prompt: \([0-9]*\) tokens, \([0-9.]*\) tok\/s | generation: \([0-9]*\) tokens, \([0-9.]*\) tok\/s | plugins: \([0-9.]*\)%.*/{"engine": "mlxhost", "compute": "'"$1"'", "prompt_tokens": \1, "prompt_tok_s": \2, "generation_tokens": \3, "generation_tok_s": \4, "plugin_share_pct": \5}/p'
}
OUT=$(mktemp)
{
  ours float32 "$MAX_TOKENS"
  LD_PRELOAD="$OPENBLAS" "$VENV/bin/python" benches/mlx_lm_generate.py "$MLX_DIR" "$MAX_TOKENS" float32
  ours native "$MAX_TOKENS"
  "$VENV/bin/python" benches/mlx_lm_generate.py "$MLX_DIR" "$NATIVE_MAX_TOKENS"
} | tee "$OUT"
python3 - "$OUT" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print(f"\n{'engine':8} {'path':8} {'prompt tok/s':>12} {'gen tokens':>10} {'gen tok/s':>10} {'plugin share':>12}")
for r in rows:
    share = f"{r['plugin_share_pct']:.1f}%" if 'plugin_share_pct' in r else "-"
    print(f"{r['engine']:8} {r['compute']:8} {r['prompt_tok_s']:>12.1f} {r['generation_tokens']:>10} {r['generation_tok_s']:>10.2f} {share:>12}")
by = {(r['engine'], r['compute']): r for r in rows}
o, p, p32 = by[('mlxhost', 'float32')], by[('mlx-lm', 'native')], by[('mlx-lm', 'float32')]
print(f"\nmlxhost default vs mlx-lm default: {o['generation_tok_s']/p['generation_tok_s']:.1f}x; vs mlx-lm float32+OpenBLAS: {o['generation_tok_s']/p32['generation_tok_s']:.2f}x")
PY
rm -f "$OUT"
