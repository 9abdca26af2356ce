#!/usr/bin/env bash
# Prompt cache benchmark over HTTP on SmolLM2 (default path), one run: TTFT of a ~4k-token
# conversation prefilled cold, resent with one more turn (RAM prompt-cache hit), and resent after
# a server restart with the SSD cache files evicted from the page cache (SSD restore).
# benches/prompt_cache.py starts the server and does the requests.
#   benches/prompt_cache.sh          # REPEATS=2 TURNS=30
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
cargo build --release -q -p mlxhost
./scripts/build-plugins.sh
python3 benches/prompt_cache.py target/release/mlxhost
