#!/usr/bin/env bash
# The main job: install everything, build the host and the default plugins, and serve the default
# model (SmolLM2-135M-Instruct) with the default plugins (plugins/: the `standard` sampler and the
# `openai` Chat Completions adapter) on http://127.0.0.1:8080. Extra arguments go to
# `mlxhost serve` (e.g. --port 9000, --host 0.0.0.0, --model qwen2.5-coder-0.5b).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "run: installing what is missing (scripts/setup.sh)" >&2
./scripts/setup.sh >/dev/null
echo "run: building mlxhost (release; the first build takes 10-20 minutes on 2 cores)" >&2
# On an NVIDIA machine the binary loads MLX's CUDA build (host/build.rs) and links no CPU BLAS.
features=()
[ "$(./scripts/mlx-backend.sh)" = cuda ] && features=(--no-default-features)
cargo build --release -p mlxhost "${features[@]}"
echo "run: building the plugins in plugins/ (scripts/build-plugins.sh)" >&2
./scripts/build-plugins.sh
# `--model NAME` with a known model's short name (`mlxhost models`): install it first.
args=("$@")
for i in "${!args[@]}"; do
  if [ "${args[$i]}" = "--model" ] && [ $((i + 1)) -lt ${#args[@]} ]; then
    model="${args[$((i + 1))]}"
    if [ ! -e "$model" ] && target/release/mlxhost models | awk 'NR > 1 {print $1}' | grep -qx "$model"; then
      echo "run: installing $model (mlxhost models pull)" >&2
      target/release/mlxhost models pull "$model" >/dev/null
    fi
  fi
done
exec target/release/mlxhost serve --plugins plugins "$@"
