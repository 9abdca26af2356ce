#!/usr/bin/env bash
# TTFT of each turn of an agent-style conversation on the tiny Qwen3.5 fixture (hybrid: gated
# DeltaNet + full attention), mlxhost serve vs mlx_lm.server on the same files, one run
# (benches/hybrid_turns.py does the requests). The fixture is copied with a 32k context so 20 turns
# of ~1000 tokens fit. mlx-lm 0.32.2 from $VENV (default /tmp/mlxvenv).
#   benches/hybrid_turns.sh          # TURNS=20 TURN_TOKENS=1000
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${MLXHOST_BIN:-target/release/mlxhost}"
VENV="${VENV:-/tmp/mlxvenv}"
DIR=$(mktemp -d)
trap 'kill ${PIDS:-} 2>/dev/null || true; rm -rf "$DIR"' EXIT
cp tests/fixtures/models/qwen3.5-tiny/* "$DIR/"
python3 - "$DIR/config.json" <<'PY'
import json, sys
c = json.load(open(sys.argv[1]))
c["text_config"]["max_position_embeddings"] = 32768
json.dump(c, open(sys.argv[1], "w"), indent=1)
PY
"$BIN" serve --model "$DIR" --plugins plugins --port 18191 --prompt-cache 2 2>"$DIR/mlxhost.log" &
PIDS="$!"
"$VENV/bin/python" -m mlx_lm.server --model "$DIR" --port 18192 2>"$DIR/mlx-lm.log" &
PIDS="$PIDS $!"
for port in 18191 18192; do
  for _ in $(seq 240); do curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break \
    || curl -sf "http://127.0.0.1:$port/v1/models" >/dev/null 2>&1 && break; sleep 0.5; done
done
python3 benches/hybrid_turns.py mlxhost=http://127.0.0.1:18191 mlx-lm=http://127.0.0.1:18192
curl -s http://127.0.0.1:18191/stats | python3 -c 'import json,sys; d=json.load(sys.stdin); print(json.dumps({"mlxhost prompt_cache": d.get("prompt_cache")}))'
