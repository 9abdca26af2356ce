#!/usr/bin/env bash
# Runs the real Claude Code CLI (@anthropic-ai/claude-code from npm) against mlxhost, with
# the test-only `scripted` sampler standing in for a model that could act as an agent.
# See tests/agents/README.md. Usage: tests/agents/claude_code.sh   (from anywhere)
# Env: MLXHOST_BIN (default target/debug/mlxhost), CLAUDE_CODE_VERSION (2.1.197, the version
# the results in the README were seen with), CLAUDE_CODE_PREFIX (install cache,
# default ~/.cache/mlxhost/agents/claude-code), CC_FULL=1 also runs full (non --bare) mode
# (slow on a debug build: ~3k prompt tokens), KEEP=1 keeps the temp dir.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
MLXHOST=${MLXHOST_BIN:-$ROOT/target/debug/mlxhost}
PREFIX=${CLAUDE_CODE_PREFIX:-$HOME/.cache/mlxhost/agents/claude-code}
CLAUDE=$PREFIX/bin/claude
PY=${PYTHON:-python3}

# --- install (cached) -------------------------------------------------------------------
if ! "$CLAUDE" --version >/dev/null 2>&1; then
  echo "installing @anthropic-ai/claude-code under $PREFIX" >&2
  npm i -g --prefix "$PREFIX" "@anthropic-ai/claude-code@${CLAUDE_CODE_VERSION:-2.1.197}" >&2 || { echo "npm install failed" >&2; exit 2; }
fi
VERSION=$("$CLAUDE" --version 2>/dev/null)
[ -x "$MLXHOST" ] || { echo "no mlxhost binary at $MLXHOST (cargo build first)" >&2; exit 2; }

T=$(mktemp -d /tmp/mlxhost-claude.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  if [ "${KEEP:-0}" = 1 ]; then echo "kept $T" >&2; else rm -rf "$T"; fi
}
trap cleanup EXIT

# --- logging proxy: writes each request body to LOGDIR/NNN.json, one line per request to
# LOGDIR/index.tsv (n, method, path, request bytes, status), error bodies to NNN-STATUS.txt
cat > "$T/proxy.py" <<'EOF'
import http.client, http.server, os, sys, threading
UP = int(sys.argv[1]); LOG = sys.argv[2]; os.makedirs(LOG, exist_ok=True)
lock = threading.Lock(); count = [0]
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"
    def log_message(self, *a): pass
    def handle_one(self):
        n = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(n) if n else b""
        with lock:
            count[0] += 1; i = count[0]
        if body:
            open(os.path.join(LOG, f"{i:03d}.json"), "wb").write(body)
        skip = ("host", "connection", "content-length", "accept-encoding")
        hdrs = {k: v for k, v in self.headers.items() if k.lower() not in skip}
        c = http.client.HTTPConnection("127.0.0.1", UP, timeout=900)
        c.request(self.command, self.path, body=body or None, headers=hdrs)
        r = c.getresponse()
        with lock, open(os.path.join(LOG, "index.tsv"), "a") as f:
            f.write(f"{i}\t{self.command}\t{self.path}\t{len(body)}\t{r.status}\n")
        self.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("connection", "close"); self.end_headers()
        out = b""
        while True:
            chunk = r.read1(65536)
            if not chunk: break
            if len(out) < 100000: out += chunk
            self.wfile.write(chunk); self.wfile.flush()
        if r.status >= 400 and self.command != "HEAD":
            open(os.path.join(LOG, f"{i:03d}-{r.status}.txt"), "wb").write(out)
    do_GET = do_POST = do_HEAD = handle_one
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(f"proxy at {s.server_address[1]}", flush=True)
s.serve_forever()
EOF

# --- start: plugin folder with the scripted sampler's [defaults] = the reply script -----
# start NAME SCRIPT_TEXT: starts mlxhost + proxy; sets PORT (the proxy's) and LOG.
start() {
  local name=$1 text=$2 d=$T/$1
  mkdir -p "$d/plugins"
  for p in anthropic openai standard hermes think; do
    mkdir -p "$d/plugins/$p"
    cp "$ROOT/plugins/$p/plugin.toml" "$ROOT"/plugins/$p/*.wasm "$d/plugins/$p/"
  done
  mkdir -p "$d/plugins/scripted"
  cp "$ROOT/plugins/testing/scripted/scripted.wasm" "$d/plugins/scripted/"
  TEXT="$text" "$PY" - "$ROOT/plugins/testing/scripted/plugin.toml" "$d/plugins/scripted/plugin.toml" <<'EOF'
import json, os, sys
base = open(sys.argv[1]).read()
open(sys.argv[2], "w").write(base + "\n[defaults]\ntext = " + json.dumps(os.environ["TEXT"]) + "\n")
EOF
  MLXHOST_LOG=${MLXHOST_LOG:-info} "$MLXHOST" serve --port 0 --plugins "$d/plugins" \
    --tool-parser hermes --sampler scripted >"$d/server.log" 2>&1 &
  PIDS+=($!)
  local up=""
  for _ in $(seq 1 240); do
    up=$(grep -o 'serving .* at http://127.0.0.1:[0-9]*' "$d/server.log" | grep -o '[0-9]*$')
    [ -n "$up" ] && break; sleep 0.25
  done
  [ -n "$up" ] || { echo "server did not start:"; tail -20 "$d/server.log"; exit 1; }
  LOG=$d/requests
  "$PY" "$T/proxy.py" "$up" "$LOG" >"$d/proxy.out" 2>&1 &
  PIDS+=($!)
  PORT=""
  for _ in $(seq 1 40); do
    PORT=$(grep -o 'proxy at [0-9]*' "$d/proxy.out" | grep -o '[0-9]*$'); [ -n "$PORT" ] && break; sleep 0.25
  done
  [ -n "$PORT" ] || { echo "proxy did not start"; cat "$d/proxy.out"; exit 1; }
}
stop() { for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done; PIDS=(); }

# claude DIR ARGS...: runs Claude Code in DIR with a fresh HOME; stdout -> DIR/out.json
claude() {
  local dir=$1; shift
  mkdir -p "$dir/home" "$dir/work"
  (cd "$dir/work" && env HOME="$dir/home" ANTHROPIC_BASE_URL="http://127.0.0.1:$PORT" \
     ANTHROPIC_API_KEY=dummy ANTHROPIC_MODEL=m ANTHROPIC_DEFAULT_HAIKU_MODEL=m \
     CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 \
     timeout "${CC_TIMEOUT:-300}" "$CLAUDE" "$@" --output-format json \
     >"$dir/out.json" 2>"$dir/err.txt")
  echo $?
}
# jget FILE EXPR: a Python expression over the JSON `j` in FILE
jget() { "$PY" -c 'import json,sys; j=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2" 2>/dev/null; }
sizes() { awk -F'\t' '$2=="POST"{printf "%s%s B (%s)", s, $4, $5; s=", "}' "$LOG/index.tsv"; }

PASS=0; FAIL=0; SUMMARY=()
check() { # check NAME COND_STATUS DETAIL
  if [ "$2" = 0 ]; then PASS=$((PASS+1)); SUMMARY+=("PASS  $1: $3"); else FAIL=$((FAIL+1)); SUMMARY+=("FAIL  $1: $3"); fi
}

# --- 1. bare one-shot -----------------------------------------------------------------
start hello "Hello from mlxhost."
D=$T/hello; rc=$(claude "$D" -p "Say hi" --bare)
res=$(jget "$D/out.json" 'j["result"]'); err=$(jget "$D/out.json" 'j["is_error"]')
[ "$rc" = 0 ] && [ "$err" = False ] && [ "$res" = "Hello from mlxhost." ]
check "bare one-shot" $? "rc=$rc is_error=$err result='$res'; requests: $(sizes)"
[ "$rc" = 0 ] || { echo "--- stdout"; cat "$D/out.json"; echo "--- stderr"; tail -20 "$D/err.txt"; }

# --- 2. context overflow (bare, a ~12k-token prompt): a clear 400 shown by Claude Code --
D=$T/overflow; long=$("$PY" -c "print('the quick brown fox jumps over the lazy dog. ' * 1200)")
rc=$(claude "$D" -p "$long" --bare)
res=$(jget "$D/out.json" 'j["result"]'); st=$(jget "$D/out.json" 'j["api_error_status"]')
[ "$rc" != 0 ] && [ "$st" = 400 ] && [[ "$res" == *"maximum context length"* ]]
check "context overflow" $? "rc=$rc api_error_status=$st result='$res'; requests: $(sizes)"
stop

# --- 3. tool round trip (bare mode offers Bash, Edit, Read; no Write) ----------------------
D=$T/tool; mkdir -p "$D/work"
CALL=$("$PY" -c 'import json,sys; print("<tool_call>\n" + json.dumps({"name": "Bash", "arguments": {"command": "echo hi > " + sys.argv[1] + "/hello.txt", "description": "Write hello.txt"}}) + "\n</tool_call>")' "$D/work")
start tool "$CALL"
rc=$(claude "$D" -p "Write hi to hello.txt" --bare --allowedTools Bash --max-turns 2)
sub=$(jget "$D/out.json" 'j["subtype"]'); den=$(jget "$D/out.json" 'len(j["permission_denials"])')
content=$(cat "$D/work/hello.txt" 2>/dev/null)
# the second request must answer the first tool_use with a tool_result
tr=$("$PY" - "$LOG" <<'EOF'
import glob, json, sys
reqs = [json.load(open(f)) for f in sorted(glob.glob(sys.argv[1] + "/*.json"))]
if len(reqs) < 2: print("only %d request(s)" % len(reqs)); sys.exit()
msgs = reqs[1]["messages"]
uses = [b for m in msgs if m["role"] == "assistant" and isinstance(m["content"], list) for b in m["content"] if b.get("type") == "tool_use"]
res = [b for m in msgs if m["role"] == "user" and isinstance(m["content"], list) for b in m["content"] if b.get("type") == "tool_result"]
ok = uses and res and res[0]["tool_use_id"] == uses[0]["id"] and not res[0].get("is_error")
print(("ok" if ok else "BAD") + ": tool_use %s %s -> tool_result %s" % (uses[0]["name"] if uses else None, json.dumps(uses[0]["input"]) if uses else "", json.dumps(res[0].get("content")) if res else None))
EOF
)
[ "$content" = hi ] && [ "$den" = 0 ] && [[ "$tr" == ok* ]] && [ "$sub" = error_max_turns ]
check "tool round trip" $? "rc=$rc subtype=$sub denials=$den file='$content'; $tr; requests: $(sizes)"
stop

# --- 4. full mode (optional, slow on a debug build) ---------------------------------------
if [ "${CC_FULL:-0}" = 1 ]; then
  start full "Hello from mlxhost."
  D=$T/full; rc=$(CC_TIMEOUT=900 claude "$D" -p "Say hi")
  res=$(jget "$D/out.json" 'j["result"]'); err=$(jget "$D/out.json" 'j["is_error"]')
  ntools=$(jget "$LOG/002.json" 'len(j["tools"])')
  ptok=$(grep -o 'prompt_tokens=[0-9]*' "$T/full/server.log" | head -1)
  [ "$rc" = 0 ] && [ "$err" = False ]
  check "full mode" $? "rc=$rc is_error=$err result='$res'; tools=$ntools $ptok; requests: $(sizes)"
  stop
fi

echo "Claude Code $VERSION against $("$MLXHOST" --version 2>/dev/null || echo mlxhost)"
printf '%s\n' "${SUMMARY[@]}"
echo "passed $PASS, failed $FAIL"
[ "$FAIL" = 0 ]
