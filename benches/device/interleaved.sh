#!/usr/bin/env bash
# Batch-1 decode over HTTP side by side on the GPU machine (docs/benchmarks.md, "NVIDIA H200",
# run 11). After unpack.sh's environment is sourced. mlxhost (defaults), mlx_lm.server and
# mlxhost with its thread placement off run at once on the same files; benches/interleaved.py
# alternates C=1 requests between mlxhost and mlx_lm.server, then between mlxhost and mlxhost
# with placement off (PLACEMENT=0 leaves that server and pass out: run 12). Writes under $OUT
# (or ./interleaved-out).
set -uo pipefail
. "$(dirname "$0")/common.sh" interleaved
PAIRS="${PAIRS:-24}"
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null; wait' EXIT
"$BIN" serve --model "$MLX_DIR" --plugins plugins --port 18080 2>"$OUT/serve.log" & PIDS+=($!)
echo "{\"server\": \"mlxhost\", \"ready_s\": $(up http://127.0.0.1:18080/health)}"
python3 -m mlx_lm server --model "$MLX_DIR" --port 18081 2>"$OUT/mlx-lm.log" & PIDS+=($!)
echo "{\"server\": \"mlx_lm.server\", \"ready_s\": $(up http://127.0.0.1:18081/v1/models)}"
if [ "${PLACEMENT:-1}" != 0 ]; then
  MLXHOST_ISOLATE_BUSY_THREADS=off "$BIN" serve --model "$MLX_DIR" --plugins plugins --port 18082 2>"$OUT/serve-off.log" & PIDS+=($!)
  echo "{\"server\": \"mlxhost placement off\", \"ready_s\": $(up http://127.0.0.1:18082/health)}"
fi
grep -h busy "$OUT"/serve*.log | cut -c1-300
(cd benches && timeout 200 python3 interleaved.py mlxhost=http://127.0.0.1:18080 mlx_lm.server=http://127.0.0.1:18081 "$PAIRS") | tee "$OUT/vs-mlx-lm.jsonl" | tail -1
if [ "${PLACEMENT:-1}" != 0 ]; then
  (cd benches && timeout 150 python3 interleaved.py mlxhost=http://127.0.0.1:18080 placement-off=http://127.0.0.1:18082 "$PAIRS") | tee "$OUT/vs-placement-off.jsonl" | tail -1
fi
(cd benches && MAX_TOKENS=512 timeout 200 python3 interleaved.py mlxhost=http://127.0.0.1:18080 mlx_lm.server=http://127.0.0.1:18081 8) | tee "$OUT/vs-mlx-lm-512.jsonl" | tail -1
