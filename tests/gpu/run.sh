#!/usr/bin/env bash
# GPU acceptance test (issue "NVIDIA"): every command of the mlxhost binary on MLX's GPU backend,
# against mlx-lm's reference and the CPU path's recorded outputs on the same SmolLM2 GGUF
# (tests/gpu/check.py says what each step checks). CI has no GPU: run it on an NVIDIA machine
# after the set-up (README, "NVIDIA GPUs"), or through the `device` tool (docs/gpu.md).
#   tests/gpu/run.sh                 # exit 1 when a step fails; one JSON line per step
#   RECORD=1 tests/gpu/run.sh        # on the CPU: rewrite tests/fixtures/gpu/smollm2-cpu.json
# Env: MLXHOST_BIN (default target/release/mlxhost), GGUF (default: the installed SmolLM2
# Q4_1), PLUGINS (plugins), WORK (a fresh temporary folder), PORT (18090).
set -euo pipefail
cd "$(dirname "$0")/../.."
CACHE="${MLXHOST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mlxhost}"
BIN="${MLXHOST_BIN:-target/release/mlxhost}"
GGUF="${GGUF:-$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
WORK="${WORK:-$(mktemp -d)}"
args=(--bin "$BIN" --gguf "$GGUF" --plugins "${PLUGINS:-plugins}" --work "$WORK" --port "${PORT:-18090}")
[ -n "${RECORD:-}" ] && args+=(--record tests/fixtures/gpu/smollm2-cpu.json)
exec python3 tests/gpu/check.py "${args[@]}"
