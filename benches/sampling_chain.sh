#!/usr/bin/env bash
# The cost of choosing tokens through WASM plugins, at batch 1 on SmolLM2 (default path): the
# full chain (logit_bias on 10 ids, repetition_penalty 1.1 over 64 tokens, presence 0.5,
# frequency 0.5, top_k 40, top_p 0.9, min_p 0.05, temperature 0.8, fixed seed) through the
# first-party plugins vs the same device ops called natively, in alternating runs
# (`mlxhost bench-chain`). Reports the instrumented plugin share of decode time and the median
# WASM/native decode tok/s ratio with its spread.
#   benches/sampling_chain.sh            # PAIRS=7 TOKENS=64
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
cargo build --release -q -p mlxhost
./scripts/build-plugins.sh
target/release/mlxhost bench-chain --plugins plugins --pairs "${PAIRS:-7}" --tokens "${TOKENS:-64}"
