#!/usr/bin/env bash
# What to do with MLX's spinning CUDA completion worker, on the GPU machine (docs/benchmarks.md,
# "NVIDIA H200", run 11). After unpack.sh's environment is sourced. Writes under $OUT (or
# ./spinner-out): benches/spinner_modes.py against one server with mlxhost's own placement off
# (placements rotated over rounds), then eight C=1 requests to mlx_lm.server on the same files
# (benches/stream_gaps.py) for the ratio, then eight to mlxhost with its default placement.
set -uo pipefail
. "$(dirname "$0")/common.sh" spinner
ROUNDS="${ROUNDS:-4}"; N="${N:-3}"
MLXHOST_ISOLATE_BUSY_THREADS=off "$BIN" serve --model "$MLX_DIR" --plugins plugins --port 18080 --batch 1 2>"$OUT/serve-modes.log" & P=$!
echo "{\"server\": \"mlxhost placement off\", \"ready_s\": $(up http://127.0.0.1:18080/health)}"
(cd benches && timeout 300 python3 spinner_modes.py http://127.0.0.1:18080 "$P" "$ROUNDS" "$N") | tee "$OUT/modes.jsonl" | grep -v '"request"'
kill "$P"; wait "$P" 2>/dev/null
python3 -m mlx_lm server --model "$MLX_DIR" --port 18081 2>"$OUT/mlx-lm.log" & P=$!
echo "{\"server\": \"mlx_lm.server\", \"ready_s\": $(up http://127.0.0.1:18081/v1/models)}"
timeout 200 python3 benches/stream_gaps.py http://127.0.0.1:18081 8 | tee "$OUT/gaps-mlx-lm.jsonl"
kill "$P"; wait "$P" 2>/dev/null
"$BIN" serve --model "$MLX_DIR" --plugins plugins --port 18080 --batch 1 2>"$OUT/serve-default.log" & P=$!
echo "{\"server\": \"mlxhost default\", \"ready_s\": $(up http://127.0.0.1:18080/health)}"
timeout 120 python3 benches/stream_gaps.py http://127.0.0.1:18080 8 | tee "$OUT/gaps-default.jsonl"
kill "$P"; wait "$P" 2>/dev/null
