#!/usr/bin/env bash
# One device call's worth of real-shape measurements, most wanted first, each part under its own
# time limit and all of them under the call's (DEADLINE seconds, default 540: the device tool
# allows 600 a call). A part that would start with less than MIN_PART seconds left is skipped and
# named, so the next call can go on with PARTS set to what is left. Run after unpack.sh's
# environment is sourced (docs/gpu.md); OUT is where each part's log and JSON lines go.
#
# Parts (PARTS, in order; default: all of them):
#   8b          Qwen3-8B shape, batch-1 step: mlxhost (its mat-vec kernel), MLXHOST_QMV=off,
#               --lookahead, mlx_lm.benchmark                                 (issue 35)
#   moe         Qwen3-30B-A3B shape, batch-1 step: mlxhost, --lookahead, mlx_lm.benchmark (37)
#   gpt-oss     gpt-oss-20b shape (MXFP4 experts), the same                   (issue 37)
#   32b         Qwen2.5-32B shape, batch-1 step: mlxhost, --lookahead, mlx-lm (issue 35)
#   hybrid      Qwen3.5-9B shape, batch-1 step: mlxhost, --lookahead, mlx-lm  (issue 38)
#   8b-batch    Qwen3-8B shape, batch-8 step: mlxhost, mlx-lm                 (issue 35)
#   8b-memory   Qwen3-8B shape, `real_shapes.sh memory`: memory after warm-up, first-50 TTFT
#   structured  Qwen3-8B shape, `real_shapes.sh structured`: constrained vs free step, b 1/8/16 (39)
#   structured-off      the same at b 8/16 with `--decode-lookahead off`          (not default)
#   structured-nodefer  the same at b 8/16 with MLXHOST_LOOKAHEAD_DEFER=off        (not default)
#   8b-kv       Qwen3-8B shape, `real_shapes.sh kv`: 16k/32k decode, float vs 8/4-bit KV, mlx-lm (41)
#   8b-http     Qwen3-8B shape, `real_shapes.sh http`: c=1/8/32 against mlx_lm.server        (35)
#   8b-two      Qwen3-8B shape, `real_shapes.sh two`: two servers on one card vs one alone     (35)
#   smoke       the tiny MoE shape, batch-1 step (checks the wiring on any machine; not default)
# Each shape's weights are made here the first time a part needs them (make_real_shape.py, ~1 min
# for 8B) and stay in $MODELS for the machine's life.
set -uo pipefail
cd "$(dirname "$0")/../.."
: "${MLXHOST_BIN:?source the output of benches/device/unpack.sh first}"
DEADLINE="${DEADLINE:-540}"
MIN_PART="${MIN_PART:-60}"
OUT="${OUT:-/tmp/wave}"
mkdir -p "$OUT"
start=$SECONDS
# mlx-lm shares the kernels mlxhost compiled (same MLX version; mlxhost keeps them under
# $MLXHOST_CACHE/gpu-kernels, host/src/gpu_kernel_cache.rs) instead of compiling its own in /tmp/mlx.
KERNELS="${MLXHOST_CACHE:-$HOME/.cache/mlxhost}/gpu-kernels"
mkdir -p "$KERNELS/cuda-driver"
export MLX_PTX_CACHE_DIR="${MLX_PTX_CACHE_DIR:-$KERNELS/mlx-$(python3 -c 'import mlx.core as mx; print(mx.__version__)' 2>/dev/null || echo 0.32.2)}"
export CUDA_CACHE_PATH="${CUDA_CACHE_PATH:-$KERNELS/cuda-driver}" CUDA_CACHE_MAXSIZE="${CUDA_CACHE_MAXSIZE:-1073741824}"
left() { echo $((DEADLINE - (SECONDS - start))); }

# part NAME LIMIT SHAPE MODE [env...]: real_shapes.sh MODE for SHAPE under min(LIMIT, time left).
part() {
  local name=$1 limit=$2 shape=$3 mode=$4
  shift 4
  local budget
  budget=$(left)
  if [ "$budget" -lt "$MIN_PART" ]; then
    echo "{\"part\": \"$name\", \"skipped\": \"${budget} s left\"}"
    return
  fi
  [ "$limit" -lt "$budget" ] && budget=$limit
  echo "{\"part\": \"$name\", \"limit_s\": $budget}"
  local t0=$SECONDS
  env "$@" SHAPE="$shape" OUT="$OUT/$name" timeout "$budget" bash benches/device/real_shapes.sh "$mode" \
    2>&1 | grep -v '^\[INFO\]' | tee "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  # The kernels' verdicts and the mat-vec kernel's per-shape choices (with their compile time).
  grep -h -E "in use|less accurate|failed; using|quantized mat-vec: " "$OUT/$name"/*.log 2>/dev/null \
    | head -8
  echo "{\"part\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}"
}

for p in ${PARTS:-8b moe gpt-oss 32b hybrid 8b-batch 8b-memory structured 8b-kv 8b-http 8b-two}; do
  case "$p" in
    8b) part 8b 300 qwen3-8b step BATCHES=1 VARIANTS="qmv off lookahead mlx-lm" ;;
    moe) part moe 300 qwen3-30b-a3b step BATCHES=1 VARIANTS="qmv lookahead mlx-lm" ;;
    gpt-oss) part gpt-oss 300 gpt-oss-20b step BATCHES=1 VARIANTS="qmv lookahead mlx-lm" ;;
    32b) part 32b 420 qwen2.5-32b step BATCHES=1 VARIANTS="qmv lookahead mlx-lm" ;;
    hybrid) part hybrid 300 qwen3.5-9b step BATCHES=1 VARIANTS="qmv lookahead mlx-lm" ;;
    8b-batch) part 8b-batch 240 qwen3-8b step BATCHES=8 VARIANTS="qmv mlx-lm" ;;
    8b-memory) part 8b-memory 300 qwen3-8b memory ;;
    structured) part structured 330 qwen3-8b structured ;;
    structured-off) part structured-off 200 qwen3-8b structured \
      EXTRA_SERVE_ARGS="--decode-lookahead off" BATCHES="8 16" ;;
    structured-nodefer) part structured-nodefer 200 qwen3-8b structured \
      MLXHOST_LOOKAHEAD_DEFER=off BATCHES="8 16" ;;
    8b-kv) part 8b-kv 420 qwen3-8b kv ;;
    8b-http) part 8b-http 300 qwen3-8b http ;;
    8b-two) part 8b-two 300 qwen3-8b two ;;
    smoke) part smoke 120 tiny-moe step BATCHES=1 VARIANTS="qmv mlx-lm" ;;
    *) echo "{\"part\": \"$p\", \"error\": \"unknown part (8b moe gpt-oss 32b hybrid 8b-batch 8b-memory structured 8b-kv 8b-http 8b-two smoke)\"}" ;;
  esac
done
# JIT_BACK=1: the compiled kernels come back as jit.tgz.aa, .ab, ... (the device tool returns at
# most 8 files of 16 MiB; an 8B+32B+MoE wave's kernels were 47 MB): joined into
# $MLXHOST_CACHE/device-jit/jit.tgz here, pack.sh carries them to the next machine, whose first
# runs then skip the NVRTC compiling (~2 min cold). Off by default: the parts take file slots.
if [ "${JIT_BACK:-0}" = 1 ]; then
  tar czf - -C / "${KERNELS#/}" 2>/dev/null | split -b 15000000 - "$OUT/jit.tgz."
fi
echo "{\"wave_seconds\": $((SECONDS - start))}"
