#!/usr/bin/env bash
# Tensor parallelism on this CPU: `mlxhost bench` with 1 rank and with 2 ranks (MLX's ring backend
# over 127.0.0.1, both processes on this machine), decode at batch 1 and 8 and prefill, on the
# default (quantized) path. 1 rank runs twice: as shipped (the fused one-layer decode op) and with
# that op off (MLXHOST_DECODE_LAYER=mlx: the per-layer ops the ranks run, since a rank must all-sum
# inside each layer). Prints one JSON line per run, then a table of medians.
#   benches/tensor_parallel.sh [MODEL...]   # PROMPT_TOKENS=128 DECODE_TOKENS=32 ROUNDS=2
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${MLXHOST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mlxhost}"
BIN="${BIN:-target/release/mlxhost}"
PROMPT_TOKENS="${PROMPT_TOKENS:-128}"; DECODE_TOKENS="${DECODE_TOKENS:-32}"; ROUNDS="${ROUNDS:-2}"
MODELS=("$@")
[ ${#MODELS[@]} -gt 0 ] || MODELS=("$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf" \
  "$CACHE/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
OUT=$(mktemp)
run() {  # $1 = label, $2 = ranks, $3 = batch, $4 = model, then env assignments
  local label=$1 ranks=$2 batch=$3 model=$4; shift 4
  env "$@" "$BIN" bench --model "$model" --tensor-parallel "$ranks" --batch "$batch" \
    --prompt-tokens "$PROMPT_TOKENS" --decode-tokens "$DECODE_TOKENS" 2>/dev/null |
    python3 -c "import json,sys; r=json.loads(sys.stdin.read()); r['label']='$label'; r['ranks']=$ranks; print(json.dumps(r))"
}
for model in "${MODELS[@]}"; do
  for _ in $(seq "$ROUNDS"); do
    for batch in 1 8; do
      run "1 rank" 1 "$batch" "$model"
      run "1 rank, unfused" 1 "$batch" "$model" MLXHOST_DECODE_LAYER=mlx
      run "2 ranks" 2 "$batch" "$model"
    done
  done
done | tee -a "$OUT"
python3 - "$OUT" <<'PY'
import json, os, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
groups = {}
for r in rows:
    groups.setdefault((os.path.basename(r["model"]), r["label"], r["batch"]), []).append(r)
print(f"\n{'model':45} {'run':16} {'batch':>5} {'prefill tok/s':>13} {'decode ms/step':>14} {'tok/s':>8} {'RSS MiB (rank 0)':>16}")
for (m, label, b), rs in groups.items():
    med = lambda f: statistics.median(r[f] for r in rs)
    ms = med("decode_ms_per_step")
    print(f"{m:45} {label:16} {b:>5} {med('prefill_tok_s'):>13.1f} {ms:>14.2f} {b*1e3/ms:>8.1f} {med('peak_rss_mib'):>16.0f}")
PY
