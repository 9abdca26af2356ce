#!/usr/bin/env bash
# Shared prefixes prefilled once (issue 44): two requests sharing a ~10k-token system prompt,
# alone and together, on Qwen2.5-Coder-0.5B by default. benches/shared_prefix.py starts the
# server and does the requests.
#   benches/shared_prefix.sh [MODEL]      # PREFIX_TOKENS=10000
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
cargo build --release -q -p mlxhost
./scripts/build-plugins.sh
target/release/mlxhost models pull "${1:-qwen2.5-coder-0.5b}" >/dev/null
python3 benches/shared_prefix.py target/release/mlxhost "${1:-qwen2.5-coder-0.5b}"
