#!/usr/bin/env bash
# HTTP benchmark, side by side in one run on the same files: `mlxhost serve` (default path,
# plugins/ with the `standard` sampler and the `openai` adapter) vs mlx-lm 0.32.2's own
# `mlx_lm.server` on the model dequantized to float32 with OpenBLAS preloaded (its default 4-bit
# path runs at ~0.1 tok/s on x86 CPUs; add it with MLX_LM_NATIVE=1). Both servers run at once,
# idle between requests; requests alternate between them (benches/http_bench.py).
#   benches/serve.sh            # REPEATS=3 MAX_TOKENS=64 LONG_WORDS=700
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/side_by_side.sh
. benches/servers.sh
"$BIN" serve --model "$MLX_DIR" --plugins plugins --port 18080 2>"$LOGS/mlxhost.log" & PIDS+=($!)
LD_PRELOAD="$OPENBLAS" "$VENV/bin/python" benches/mlx_lm_server.py --float32 --model "$MLX_DIR" --port 18081 \
  2>"$LOGS/mlx-lm.log" & PIDS+=($!)
SERVERS=("mlxhost=http://127.0.0.1:18080" "mlx-lm-float32=http://127.0.0.1:18081")
if [ "${MLX_LM_NATIVE:-0}" = 1 ]; then
  "$VENV/bin/python" -m mlx_lm.server --model "$MLX_DIR" --port 18082 2>"$LOGS/mlx-lm-native.log" & PIDS+=($!)
  SERVERS+=("mlx-lm-native=http://127.0.0.1:18082")
fi
wait_up http://127.0.0.1:18080/health "$LOGS/mlxhost.log"
wait_up http://127.0.0.1:18081/v1/models "$LOGS/mlx-lm.log"
[ "${MLX_LM_NATIVE:-0}" = 1 ] && wait_up http://127.0.0.1:18082/v1/models "$LOGS/mlx-lm-native.log"
python3 benches/http_bench.py "${SERVERS[@]}"
