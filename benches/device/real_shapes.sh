#!/usr/bin/env bash
# On the GPU machine (issue 35), after benches/device/unpack.sh's environment is sourced: makes a
# random-weight model at a published shape (benches/make_real_shape.py; SHAPE, default qwen3-8b;
# also qwen2.5-32b, qwen3-30b-a3b, gpt-oss-20b; tokenizer files from $TOK) and measures, on the same files in the same run:
#   step   the bytes a step streams and the card's bandwidth limit; `mlxhost bench` (also with
#          MLXHOST_QMV=off: MLX's quantized_matmul; and --lookahead) and `mlx_lm.benchmark` at batch 1 and 8
#          (BATCHES; prompt 512, 128 tokens; VARIANTS picks among "qmv off lookahead mlx-lm")
#   memory `mlxhost serve` with its default limits (--memory-limit: 90% of the device, a tenth as
#          buffer cache): /stats `memory` and nvidia-smi's used memory after warm-up, the first
#          50 requests' TTFT against warm (benches/first_requests.py), memory after 16
#          concurrent requests, the first prompt-cache hit; EXTRA_SERVE_ARGS are passed on
#   structured  `mlxhost serve`, then benches/structured_output.py: a JSON-Schema-constrained decode
#          step against a free one at batch 1, 8 and 16 (BATCHES; issue 39)
#   kv     benches/device/kv_quant_gpu.sh: decode at 16k/32k context, float vs --kv-bits 8/4 and
#          mlx-lm's quantized KV (issue 41)
#   http   `mlxhost serve` and mlx_lm.server: streamed requests at concurrency 1, 8, 32 (LEVELS)
#   two    two `mlxhost serve` on one card (--memory-limit TWO_LIMIT GiB each): A alone, then A and
#          B at once, concurrency 1 and 8
# Usage: benches/device/real_shapes.sh step|memory|structured|kv|http|two|all   (OUT: where logs and JSON go)
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN="${MLXHOST_BIN:?source the output of benches/device/unpack.sh first}"
SHAPE="${SHAPE:-qwen3-8b}"
DIR="${MODELS:-/tmp/g/models}/$SHAPE"
OUT="${OUT:-${OUT_DIR:-/tmp}/real-shapes}"; mkdir -p "$OUT"
[ -f "$DIR/model.safetensors" ] || python3 benches/make_real_shape.py "$SHAPE" "$DIR" "${TOK:-/tmp/g/tok}"
# The model code's info lines: which CUDA kernels passed their self-tests (with the time, mostly
# NVRTC compiling) and the quantized mat-vec kernel's per-shape choice against MLX's op.
export MLXHOST_LOG="${MLXHOST_LOG:-warn,mlxhost::model=info}"
used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }
echo "{\"shape\": \"$SHAPE\", \"gpu_used_mib_before\": $(used)}"
# Bytes a decode step streams (every tensor but the input embedding, unless it is the tied head) and
# the card's bandwidth limit: the step time at which every byte is read once.
limits() {
  python3 - "$DIR" <<'PY'
import json, struct, subprocess, sys
d = sys.argv[1]
with open(f"{d}/model.safetensors", "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0]
    head = json.loads(f.read(n))
tied = json.load(open(f"{d}/config.json")).get("tie_word_embeddings", False)
size = lambda v: v["data_offsets"][1] - v["data_offsets"][0]
total = sum(size(v) for k, v in head.items() if k != "__metadata__")
embed = sum(size(v) for k, v in head.items() if "embed_tokens" in k)
step = total if tied else total - embed
name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
tbs = 4.8 if "H200" in name else 3.35  # HBM3e / HBM3 (SXM) peak, TB/s
print(json.dumps({"gpu": name, "step_bytes": step, "bandwidth_tb_s": tbs,
                  "limit_ms_per_step": step / tbs / 1e9, "limit_tok_s": tbs * 1e12 / step}))
PY
}
if [ "${1:-all}" = step ] || [ "${1:-all}" = all ]; then
  limits
  has() { [[ " ${VARIANTS:-qmv off lookahead mlx-lm} " == *" $1 "* ]]; }
  # Each run under its own limit (VARIANT_LIMIT seconds), so one that stalls (a cold NVRTC compile,
  # a hang) costs that run, not the others; a run cut off or failing prints {"timed_out_or_failed": ..., "rc": ...}.
  lim() { timeout "${VARIANT_LIMIT:-200}" "$@" || echo "{\"timed_out_or_failed\": \"$*\", \"rc\": $?}" | cut -c1-300; }
  for b in ${BATCHES:-1 8}; do
    has qmv && lim "$BIN" bench --model "$DIR" --prompt-tokens 512 --decode-tokens 128 --batch "$b" \
      2>"$OUT/bench-$b.log" | tail -1
    # The same step with MLX's quantized_matmul in place of mlxhost's mat-vec kernel (model::cuda_qmv).
    has off && MLXHOST_QMV=off lim "$BIN" bench --model "$DIR" --prompt-tokens 512 --decode-tokens 128 \
      --batch "$b" 2>"$OUT/bench-$b-mlx-qmv.log" | tail -1 | sed 's/^{/{"mlxhost_qmv": "off", /'
    # Step N+1 built while the device computes step N (serve --decode-lookahead; mlx-lm's loop).
    has lookahead && lim "$BIN" bench --model "$DIR" --prompt-tokens 512 --decode-tokens 128 --batch "$b" \
      --lookahead 2>"$OUT/bench-$b-lookahead.log" | tail -1
    # mlx-lm through benches/mlx_lm_run.py: its quantized MoE layers need the gather_qmm shim.
    has mlx-lm && lim python3 benches/mlx_lm_run.py benchmark --model "$DIR" --prompt-tokens 512 \
      --generation-tokens 128 --num-trials 3 --batch-size "$b" 2>&1 | tail -4
  done
fi
# wait_up URL PID LOG: until URL answers; if PID exits first, LOG's tail and exit 1.
wait_up() {
  until curl -sf "$1" >/dev/null; do
    kill -0 "$2" 2>/dev/null || { tail -20 "$3"; exit 1; }
    sleep 1
  done
}
# `mlxhost serve` on port 18080 with the default plugins (and EXTRA_SERVE_ARGS), waited for.
start_server() {
  "$BIN" serve --model "$DIR" --plugins plugins --port 18080 ${EXTRA_SERVE_ARGS:-} 2>"$OUT/serve.log" &
  PID=$!
  trap 'kill $PID 2>/dev/null || true' EXIT
  t0=$SECONDS
  wait_up http://127.0.0.1:18080/health $PID "$OUT/serve.log"
}
if [ "${1:-all}" = structured ]; then
  # Issue 39 on the card: a constrained decode step (the grammar plugin's JSON-Schema mask, a
  # bitset applied on the device) against a free one at each batch size, rounds interleaved.
  start_server
  BATCHES="${BATCHES:-1 8 16}" ROUNDS="${ROUNDS:-2}" MAX_TOKENS="${MAX_TOKENS:-96}" \
    python3 benches/structured_output.py http://127.0.0.1:18080
  exit 0
fi
if [ "${1:-all}" = kv ]; then
  # Issue 41 on the card: decode at 16k and 32k context, float against --kv-bits 8 and 4, and
  # mlx-lm's own quantized KV beside it (benches/device/kv_quant_gpu.sh).
  MLXHOST_BIN="$BIN" bash benches/device/kv_quant_gpu.sh "$DIR"
  exit 0
fi
if [ "${1:-all}" = http ]; then
  # Issue 35's HTTP targets: aggregate tok/s at concurrency 1, 8 and 32 against mlx_lm.server (its
  # default batching) on the same files, levels interleaved between the servers.
  start_server
  python3 benches/mlx_lm_run.py server --model "$DIR" --port 18081 2>"$OUT/mlx-lm-server.log" &
  MPID=$!
  trap 'kill $PID $MPID 2>/dev/null || true' EXIT
  wait_up http://127.0.0.1:18081/v1/models $MPID "$OUT/mlx-lm-server.log"
  LEVELS="${LEVELS:-1 8 32}" MAX_TOKENS="${MAX_TOKENS:-64}" WARMUP=1 \
    python3 benches/concurrency.py mlxhost=http://127.0.0.1:18080 mlx_lm.server=http://127.0.0.1:18081
  exit 0
fi
if [ "${1:-all}" = two ]; then
  # Issue 35: two servers on one card, each under --memory-limit (TWO_LIMIT GiB), keep their solo
  # speed: server A alone at concurrency 1 and 8, then A and B measured at the same time.
  EXTRA_SERVE_ARGS="--memory-limit ${TWO_LIMIT:-30} ${EXTRA_SERVE_ARGS:-}" start_server
  APID=$PID
  echo '{"two": "A alone"}'
  LEVELS="1 8" MAX_TOKENS=64 ROUNDS=2 WARMUP=1 python3 benches/concurrency.py A=http://127.0.0.1:18080 | grep '^{'
  "$BIN" serve --model "$DIR" --plugins plugins --port 18081 --memory-limit "${TWO_LIMIT:-30}" \
    ${EXTRA_SERVE_ARGS:-} 2>"$OUT/serve-b.log" &
  BPID=$!
  trap 'kill $APID $BPID 2>/dev/null || true' EXIT
  wait_up http://127.0.0.1:18081/health $BPID "$OUT/serve-b.log"
  echo "{\"two\": \"A and B together\", \"gpu_used_mib\": $(used)}"
  LEVELS="1 8" MAX_TOKENS=64 ROUNDS=2 WARMUP=1 python3 benches/concurrency.py A=http://127.0.0.1:18080 | grep '^{' &
  LEVELS="1 8" MAX_TOKENS=64 ROUNDS=2 WARMUP=1 python3 benches/concurrency.py B=http://127.0.0.1:18081 | grep '^{'
  wait
  exit 0
fi
if [ "${1:-all}" != step ]; then
  start_server
  echo "{\"ready_s\": $((SECONDS - t0)), \"gpu_used_mib\": $(used), \"after\": \"warm-up\"}"
  curl -s http://127.0.0.1:18080/stats | python3 -c 'import json,sys; d=json.load(sys.stdin); print(json.dumps({"memory": d["memory"], "memory_budget_bytes": d["batch"]["memory_budget_bytes"]}))'
  # The first 50 requests after ready, of mixed kinds, against the same kinds warm.
  python3 benches/first_requests.py http://127.0.0.1:18080
  pids=()
  for i in $(seq 16); do
    curl -s http://127.0.0.1:18080/v1/completions -H 'content-type: application/json' \
      -d "{\"prompt\": \"Request $i: write a long story about the sea.\", \"max_tokens\": 128}" >/dev/null &
    pids+=($!)
  done
  wait "${pids[@]}" || true
  echo "{\"gpu_used_mib\": $(used), \"after\": \"16 concurrent requests\"}"
  # The first prompt-cache hit after ready (request 1's prompt, extended): seconds to the answer.
  hit=$(curl -s -o /dev/null -w '%{time_total}' http://127.0.0.1:18080/v1/completions \
    -H 'content-type: application/json' \
    -d '{"prompt": "Request 1: write a long story about the sea. And then", "max_tokens": 1}')
  echo "{\"first_cache_hit_s\": $hit}"
  grep -E "warm-up done" "$OUT/serve.log" | tail -1 || true
  curl -s http://127.0.0.1:18080/stats | python3 -c 'import json,sys; d=json.load(sys.stdin); print(json.dumps({"memory": d["memory"]}))'
  grep -E "memory limits|memory_budget" "$OUT/serve.log" | head -3 || true
fi
