#!/usr/bin/env bash
# The main job, until `serve` lands: install everything, build the host and the default plugins,
# and generate a reply with the default model (SmolLM2-135M-Instruct), every token chosen by the
# `standard` sampler plugin from plugins/. Extra arguments go to `mlxhost generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
cargo build --release -q -p mlxhost
./scripts/build-plugins.sh
exec target/release/mlxhost generate --plugins plugins --prompt "What is the capital of France?" "$@"
