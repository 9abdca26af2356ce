#!/usr/bin/env bash
# Does the C/C++ allocator under MLX change the one-row step? On the GPU machine (docs/benchmarks.md,
# "NVIDIA H200", run 11), after unpack.sh's environment is sourced, with libjemalloc.so.2 and
# libmimalloc.so.2.0 (Debian's) in /tmp/g. mlxhost with glibc's malloc, with jemalloc and with
# mimalloc (LD_PRELOAD) and mlx_lm.server run at once on the same files; benches/interleaved.py
# goes round them. mlxhost runs at `--batch 1` (a shorter warm-up; only one-row steps are measured).
# Writes under $OUT (or ./allocators-out).
set -uo pipefail
. "$(dirname "$0")/common.sh" allocators
ROUNDS="${ROUNDS:-12}"
# An executable's own malloc comes before a preloaded one: a binary that links mimalloc (since
# run 11) would run mimalloc under every "allocator" here.
if nm "$BIN" 2>/dev/null | grep -q ' mi_malloc$'; then
  echo "allocators.sh: $BIN links mimalloc itself; use a binary from before run 11 (648d2be)" >&2; exit 2
fi
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null; wait' EXIT
serve() {  # $1 name, $2 port, then env
  local name=$1 port=$2; shift 2
  env "$@" "$BIN" serve --model "$MLX_DIR" --plugins plugins --port "$port" --batch 1 2>"$OUT/serve-$name.log" & PIDS+=($!)
  echo "{\"server\": \"$name\", \"ready_s\": $(up "http://127.0.0.1:$port/health"), \"allocator_mapped\": \"$(grep -o 'lib[a-z]*malloc[^ ]*' /proc/$!/maps | sort -u | tr '\n' ' ')\"}" | tee -a "$OUT/servers.jsonl"
}
serve glibc 18080
serve jemalloc 18082 LD_PRELOAD=/tmp/g/libjemalloc.so.2
serve mimalloc 18083 LD_PRELOAD=/tmp/g/libmimalloc.so.2.0
python3 -m mlx_lm server --model "$MLX_DIR" --port 18081 2>"$OUT/mlx-lm.log" & PIDS+=($!)
echo "{\"server\": \"mlx_lm.server\", \"ready_s\": $(up http://127.0.0.1:18081/v1/models)}"
(cd benches && timeout 300 python3 interleaved.py glibc=http://127.0.0.1:18080 jemalloc=http://127.0.0.1:18082 \
  mimalloc=http://127.0.0.1:18083 mlx_lm.server=http://127.0.0.1:18081 "$ROUNDS") | tee "$OUT/allocators.jsonl" | tail -1
