#!/usr/bin/env bash
# Prompt cache benchmark over HTTP on SmolLM2 (default path): TTFT of a ~4k-token conversation
# prefilled cold vs resent with one more turn (a RAM prompt-cache hit). benches/prompt_cache.py
# does the requests. (The SSD tier is not built yet.)
#   benches/prompt_cache.sh          # REPEATS=2 TURNS=24
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh >/dev/null
cargo build --release -q -p mlxhost
./scripts/build-plugins.sh
LOG=$(mktemp)
target/release/mlxhost serve --plugins plugins --port 18090 --prompt-cache 2 2>"$LOG" & PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -f "$LOG"' EXIT
for _ in $(seq 600); do curl -sf http://127.0.0.1:18090/health >/dev/null && break; sleep 0.5; done
python3 benches/prompt_cache.py http://127.0.0.1:18090
