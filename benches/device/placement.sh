#!/usr/bin/env bash
# Thread placement and MLX graph settings against the one-row decode step, on the GPU machine
# (docs/benchmarks.md, "NVIDIA H200", run 11). After unpack.sh's environment is sourced. Writes
# everything under $OUT (or ./placement-out): the CPU topology, benches/thread_placement.py
# against a server with mlxhost's own thread isolation off, then eight C=1 requests
# (benches/stream_gaps.py) against a server per setting: the isolation on (the default), `pin`,
# MLX_USE_CUDA_GRAPHS=0, a graph cache too large to be dropped. Last, MLX's and the driver's
# kernel caches as jit.tgz (benches/device/pack.sh carries them to the next machine). Servers run
# with `--batch 1`: only one-row steps are measured, and its warm-up compiles far less.
set -uo pipefail
. "$(dirname "$0")/common.sh" placement
lscpu > "$OUT/lscpu.txt" 2>&1; nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
grep Cpus_allowed_list /proc/self/status
serve() {  # $1 name, env in the caller; starts, waits, leaves PID in $P
  "$BIN" serve --model "$MLX_DIR" --plugins plugins --port 18080 --batch 1 2>"$OUT/serve-$1.log" & P=$!
  echo "{\"server\": \"$1\", \"ready_s\": $(up http://127.0.0.1:18080/health)}"
}
stop() { kill "$P"; wait "$P" 2>/dev/null; }

MLXHOST_ISOLATE_BUSY_THREADS=off serve placement
(cd benches && timeout 240 python3 thread_placement.py http://127.0.0.1:18080 "$P" 3) | tee "$OUT/placement.jsonl"
stop
tar czf "$OUT/jit.tgz" /tmp/mlx "$HOME/.nv/ComputeCache" 2>/dev/null; ls -la "$OUT/jit.tgz"
for cfg in "isolation-on" "isolation-pin MLXHOST_ISOLATE_BUSY_THREADS=pin" "isolation-off MLXHOST_ISOLATE_BUSY_THREADS=off" "no-graphs MLX_USE_CUDA_GRAPHS=0" \
           "graph-cache-1e6 MLX_CUDA_GRAPH_CACHE_SIZE=1000000"; do
  set -- $cfg; name=$1; shift
  env "$@" "$BIN" serve --model "$MLX_DIR" --plugins plugins --port 18080 --batch 1 2>"$OUT/serve-$name.log" & P=$!
  echo "{\"server\": \"$name\", \"ready_s\": $(up http://127.0.0.1:18080/health)}"
  timeout 120 python3 benches/stream_gaps.py http://127.0.0.1:18080 8 | tee "$OUT/gaps-$name.jsonl"
  stop
done
