#!/usr/bin/env bash
# Prints the MLX backend the set-up installs and the build links: `cuda` when MLX_BACKEND=cuda, or
# when MLX_BACKEND is unset (or `auto`) and an NVIDIA GPU and driver answer `nvidia-smi -L`;
# else `cpu` (Linux) or `metal` (macOS). MLX_BACKEND=cpu forces the CPU build on a GPU machine.
set -euo pipefail
case "${MLX_BACKEND:-auto}" in
  cuda|cpu|metal) echo "$MLX_BACKEND" ;;
  auto)
    if [ "$(uname -s)" = Darwin ]; then echo metal
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then echo cuda
    else echo cpu
    fi ;;
  *) echo "mlx-backend: MLX_BACKEND must be auto, cpu, cuda or metal (got '$MLX_BACKEND')" >&2; exit 2 ;;
esac
