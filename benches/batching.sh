#!/usr/bin/env bash
# Continuous-batching benchmark, in one run on the same files: `mlxhost serve` (default path,
# default --batch, plugins/ with the `standard` sampler and the `openai` adapter) vs mlx-lm
# 0.32.2's own `mlx_lm.server` with its default batching (--decode-concurrency 32,
# --prompt-concurrency 8) on the model dequantized to float32 with OpenBLAS preloaded, as
# benches/serve.sh runs it. Streamed requests at concurrency 1, 2, 4, 8 and 16
# (benches/concurrency.py): aggregate tok/s, per-request decode tok/s, TTFT median and p95.
#   benches/batching.sh                 # LEVELS="1 2 4 8 16" MAX_TOKENS=64 ROUNDS=1
#   MLXHOST_ARGS="--batch 8" benches/batching.sh
#   BASELINE_BIN=/path/to/older/mlxhost benches/batching.sh   # adds that build as a third server
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/side_by_side.sh
. benches/servers.sh
# shellcheck disable=SC2086
"$BIN" serve --model "$MLX_DIR" --plugins plugins --port 18080 ${MLXHOST_ARGS:-} 2>"$LOGS/mlxhost.log" & PIDS+=($!)
LD_PRELOAD="$OPENBLAS" "$VENV/bin/python" benches/mlx_lm_server.py --float32 --model "$MLX_DIR" --port 18081 \
  2>"$LOGS/mlx-lm.log" & PIDS+=($!)
SERVERS=("mlxhost=http://127.0.0.1:18080" "mlx-lm-float32=http://127.0.0.1:18081")
if [ -n "${BASELINE_BIN:-}" ]; then
  "$BASELINE_BIN" serve --model "$MLX_DIR" --plugins plugins --port 18082 2>"$LOGS/baseline.log" & PIDS+=($!)
  SERVERS+=("mlxhost-baseline=http://127.0.0.1:18082")
  wait_up http://127.0.0.1:18082/health "$LOGS/baseline.log"
fi
wait_up http://127.0.0.1:18080/health "$LOGS/mlxhost.log"
wait_up http://127.0.0.1:18081/v1/models "$LOGS/mlx-lm.log"
python3 benches/concurrency.py "${SERVERS[@]}"
