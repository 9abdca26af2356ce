#!/usr/bin/env bash
# GPU benchmark (issue "NVIDIA"), in one run on the same files: mlxhost vs mlx-lm 0.32.2 on MLX's
# CUDA build (or Metal), both on the MLX directory `mlxhost convert` writes from the SmolLM2 GGUF
# (4-bit weights, mlx-lm's own numerics on both sides):
#   1. `mlxhost bench` beside `mlx_lm.benchmark` (batch 1 and 8; prompt 512, 128 tokens)
#   2. `mlxhost serve` and `mlx_lm.server` (its default batching): seconds to ready, the first
#      request after ready (TTFT), prefill of a ~4k-token prompt, then streamed requests at
#      concurrency 1, 4, 8 and 16 (benches/concurrency.py: aggregate tok/s, per-request decode
#      tok/s, TTFT median and p95)
#      and batch-1 decode side by side: C=1 requests alternating between the two servers
#      (benches/interleaved.py, ROUNDS_SIDE_BY_SIDE rounds: per-round ratio, so the machine's
#      drift falls on both; docs/benchmarks.md "Run 11")
#   3. mlxhost's step time by batch size (/stats), then, with mlx_lm.server stopped, the
#      per-token gaps of eight C=1 requests to mlxhost (benches/stream_gaps.py: whether the
#      one-row step's cost moves between requests, docs/benchmarks.md "Run 10")
# Run on an NVIDIA machine after the set-up (README, "NVIDIA GPUs") or through the `device` tool
# (docs/gpu.md). Env: MLXHOST_BIN (target/release/mlxhost), MLX_LM_PYTHON (python3 with mlx-lm
# and MLX's GPU build), GGUF, MLX_DIR, LEVELS ("1 4 8 16"), MAX_TOKENS (128), ROUNDS (3: rounds
# per level, so C=1 is a median over three requests), ROUNDS_SIDE_BY_SIDE (16), PREFILL (4096),
# PLUGINS (plugins), EXTRA_SERVE_ARGS (more `mlxhost serve` flags), SKIP_STEP (1: no section 1). For a real-shape directory
# (benches/make_real_shape.py) set MLX_DIR to it. Prints JSON lines and concurrency.py's table.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${MLXHOST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mlxhost}"
BIN="${MLXHOST_BIN:-target/release/mlxhost}"
PY="${MLX_LM_PYTHON:-python3}"
GGUF="${GGUF:-$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
MLX_DIR="${MLX_DIR:-$CACHE/models/SmolLM2-135M-Instruct-mlx}"
[ -f "$MLX_DIR/model.safetensors" ] || "$BIN" convert "$GGUF" "$MLX_DIR"
export LEVELS="${LEVELS:-1 4 8 16}" MAX_TOKENS="${MAX_TOKENS:-128}" ROUNDS="${ROUNDS:-3}"
LOGS=$(mktemp -d); PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true' EXIT
wait_up() {  # $1 = url, $2 = log; prints seconds waited
  local t0=$SECONDS
  for _ in $(seq 1200); do
    curl -sf "$1" >/dev/null 2>&1 && { echo $((SECONDS - t0)); return 0; }
    sleep 0.5
  done
  echo "server at $1 did not come up:" >&2; tail -20 "$2" >&2; exit 1
}

# mlx-lm through benches/mlx_lm_run.py: its quantized mixture-of-experts layers need the shim.
MLX_LM=("$PY" benches/mlx_lm_run.py)
if [ "${SKIP_STEP:-0}" != 1 ]; then  # SKIP_STEP=1: benches/device/real_shapes.sh measured it
  echo "# 1. model step alone"
  "$BIN" bench --model "$MLX_DIR" --prompt-tokens 512 --decode-tokens 128
  "$BIN" bench --model "$MLX_DIR" --prompt-tokens 512 --decode-tokens 128 --batch 8
  "${MLX_LM[@]}" benchmark --model "$MLX_DIR" --prompt-tokens 512 --generation-tokens 128 --num-trials 3
  "${MLX_LM[@]}" benchmark --model "$MLX_DIR" --prompt-tokens 512 --generation-tokens 128 --num-trials 3 --batch-size 8
fi

echo "# 2. servers: ready, first request, ${PREFILL:-4096}-token prefill"
"$BIN" serve --model "$MLX_DIR" --plugins "${PLUGINS:-plugins}" --port 18080 ${EXTRA_SERVE_ARGS:-} 2>"$LOGS/mlxhost.log" & PIDS+=($!)
echo "{\"server\": \"mlxhost\", \"ready_s\": $(wait_up http://127.0.0.1:18080/health "$LOGS/mlxhost.log")}"
python3 benches/gpu_requests.py first http://127.0.0.1:18080
"${MLX_LM[@]}" server --model "$MLX_DIR" --port 18081 2>"$LOGS/mlx-lm.log" & PIDS+=($!); MLXLM_PID=$!
echo "{\"server\": \"mlx_lm.server\", \"ready_s\": $(wait_up http://127.0.0.1:18081/v1/models "$LOGS/mlx-lm.log")}"
python3 benches/gpu_requests.py first http://127.0.0.1:18081
for url in http://127.0.0.1:18080 http://127.0.0.1:18081; do
  python3 benches/gpu_requests.py prefill "$url" "${PREFILL:-4096}"
done

echo "# 3. concurrency"
WARMUP="${WARMUP:-1}" python3 benches/concurrency.py mlxhost=http://127.0.0.1:18080 mlx_lm.server=http://127.0.0.1:18081

echo "# 3b. batch 1 side by side (benches/interleaved.py)"
python3 benches/interleaved.py mlxhost=http://127.0.0.1:18080 mlx_lm.server=http://127.0.0.1:18081 \
  "${ROUNDS_SIDE_BY_SIDE:-16}" | tail -1

echo "# 4. mlxhost's step time by batch size (GET /stats, all steps above: warm-up, prefill, decode)"
curl -s http://127.0.0.1:18080/stats | python3 -c '
import json, sys
for s in json.load(sys.stdin)["batch"]["by_batch_size"]:
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in s.items()}))'

echo "# 5. mlxhost's per-token gaps over eight C=1 requests in a row (benches/stream_gaps.py)"
# mlx_lm.server stops first: its own MLX CUDA worker spins and could share our engine's core.
kill "$MLXLM_PID" 2>/dev/null || true; wait "$MLXLM_PID" 2>/dev/null || true
python3 benches/stream_gaps.py http://127.0.0.1:18080 8
