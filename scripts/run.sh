#!/usr/bin/env bash
# The main job: install everything, build the host and the default plugins, and serve the default
# model (SmolLM2-135M-Instruct) with the default plugins (plugins/: the `standard` sampler and the
# `openai` Chat Completions adapter) on http://127.0.0.1:8080. Extra arguments go to
# `mlxhost serve` (e.g. --port 9000, --host 0.0.0.0).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
cargo build --release -q -p mlxhost
./scripts/build-plugins.sh
exec target/release/mlxhost serve --plugins plugins "$@"
