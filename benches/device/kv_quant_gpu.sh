#!/usr/bin/env bash
# Quantized KV cache on an NVIDIA GPU (issue 41), for the lead's device run. Same model directory,
# same run: `mlxhost bench` at CONTEXTS (default 16384 32768) and BATCHES (1 8) with the float cache
# and --kv-bits 8 and 4 (group size 64), each with decode lookahead (BENCH_ARGS, default
# --lookahead: what `serve` does on a GPU for models of 1 GiB or more), and mlx-lm 0.32.2's own quantized KV beside it
# (`mlx_lm.generate --kv-bits`, --quantized-kv-start 0, batch 1: a prompt of the same length, its
# generation tok/s). Prints JSON lines only: mlxhost's bench lines (decode_ms_per_token, kv,
# kv_bytes_per_token, batch, prompt_tokens) and `{"engine": "mlx-lm", "kv": ..., "context": ...,
# "decode_tok_s": ...}`.
#   MLXHOST_BIN=/path/to/mlxhost benches/device/kv_quant_gpu.sh MODEL_DIR
#   (CONTEXTS, BATCHES, DECODE_TOKENS=64; MLX_LM=0 skips mlx-lm)
set -uo pipefail
cd "$(dirname "$0")/../.."
BIN="${MLXHOST_BIN:?MLXHOST_BIN: the mlxhost binary to measure}"
DIR="${1:?usage: kv_quant_gpu.sh MODEL_DIR}"
CONTEXTS="${CONTEXTS:-16384 32768}"; BATCHES="${BATCHES:-1 8}"; DECODE_TOKENS="${DECODE_TOKENS:-64}"
for ctx in $CONTEXTS; do
  for batch in $BATCHES; do
    for kv in "" "--kv-bits 8" "--kv-bits 4"; do
      # --context: the rows' caches hold ctx positions of random keys and values (quantized as
      # written under --kv-bits), so the run pays for no 16-32k-token prefill per row.
      # shellcheck disable=SC2086
      "$BIN" bench --model "$DIR" --context "$ctx" --prompt-tokens 32 --decode-tokens "$DECODE_TOKENS" \
        --repeats 1 --batch "$batch" $kv ${BENCH_ARGS---lookahead} 2>/tmp/kv_bench.err | grep '^{' \
        || { echo "{\"engine\": \"mlxhost\", \"context\": $ctx, \"batch\": $batch, \"kv\": \"${kv:-float}\", \"error\": \"bench failed\"}"
             grep -v '^\[INFO\]' /tmp/kv_bench.err | tail -3 >&2; }
      # The kernels' verdicts (split-K decode attention) for the log.
      grep -h -E "in use|disagrees|failed; using" /tmp/kv_bench.err | sed 's/^/  /' >&2
    done
  done
  if [ "${MLX_LM:-1}" = 1 ] && python3 -c "import mlx_lm" 2>/dev/null; then
    # A prompt of about ctx tokens (any text; the chat template is skipped).
    prompt=$(python3 -c "import sys; print(' '.join(['token'] * (int(sys.argv[1]) - 8)))" "$ctx")
    for bits in none 8 4; do
      args=(); [ "$bits" != none ] && args=(--kv-bits "$bits" --kv-group-size 64 --quantized-kv-start 0)
      echo "$prompt" | python3 benches/mlx_lm_run.py generate --model "$DIR" --prompt - \
        --ignore-chat-template --max-tokens "$DECODE_TOKENS" "${args[@]}" > /tmp/kv_mlx_lm.out 2>&1
      tps=$(sed -n 's/^Generation: .*, \([0-9.]*\) tokens-per-sec.*/\1/p' /tmp/kv_mlx_lm.out | tail -1)
      [ -z "$tps" ] && tail -3 /tmp/kv_mlx_lm.out >&2
      echo "{\"engine\": \"mlx-lm\", \"kv\": \"$bits\", \"context\": $ctx, \"batch\": 1, \"decode_tok_s\": ${tps:-null}}"
    done
  fi
done
