#!/usr/bin/env bash
# The main job, until `serve` lands: install everything, build, and score a chat continuation
# with the default model (SmolLM2-135M-Instruct), printing per-token log-probabilities.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
cargo build --release -q -p mlxhost
INPUT=$(mktemp); trap 'rm -f "$INPUT"' EXIT
echo '{"messages": [{"role": "user", "content": "What is the capital of France?"}], "continuation_ids": [504, 3575, 282, 4649, 314, 7042, 30, 2]}' > "$INPUT"
exec target/release/mlxhost score --input "$INPUT" --top-logprobs 3 "$@"
