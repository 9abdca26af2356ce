# Shared by the agent scripts (sourced, not run): a temp dir cleaned on exit, a logging proxy,
# `start NAME SCRIPT_TEXT [EXTRA_SERVE_ARGS...]` (mlxhost with the scripted sampler replying
# SCRIPT_TEXT, behind the proxy; sets PORT and LOG), `stop`, `jget`, `sizes` and `check`.
# Needs ROOT, MLXHOST, PY and NAME (the temp dir's prefix) set by the caller.
T=$(mktemp -d /tmp/mlxhost-$NAME.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  if [ "${KEEP:-0}" = 1 ]; then echo "kept $T" >&2; else rm -rf "$T"; fi
}
trap cleanup EXIT

# --- logging proxy: writes each request body to LOGDIR/NNN.json, one line per request to
# LOGDIR/index.tsv (n, method, path, request bytes, status), error bodies to NNN-STATUS.txt
cat > "$T/proxy.py" <<'EOF'
import http.client, http.server, json, os, sys, threading
UP = int(sys.argv[1]); LOG = sys.argv[2]; os.makedirs(LOG, exist_ok=True)
lock = threading.Lock(); count = [0]
AFTER = os.environ.get("AFTER_TOOL_TEXT")
def after_tool(body):
    # With AFTER_TOOL_TEXT set, a request that carries a tool's result (Responses
    # `function_call_output`, Anthropic `tool_result`) gets that reply scripted instead,
    # so an agent's loop ends after one round trip.
    if not AFTER or not body: return body
    try: j = json.loads(body)
    except ValueError: return body
    items = j.get("input") if isinstance(j.get("input"), list) else []
    blocks = [b for m in j.get("messages") or [] if isinstance(m.get("content"), list) for b in m["content"]]
    if any(isinstance(x, dict) and x.get("type") in ("function_call_output", "tool_result") for x in items + blocks):
        j["sampler"] = "scripted"; j["plugin_params"] = {"scripted": {"text": AFTER}}
        return json.dumps(j).encode()
    return body
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
        body = after_tool(body)
        skip = ("host", "connection", "content-length", "accept-encoding")
        hdrs = {k: v for k, v in self.headers.items() if k.lower() not in skip}
        c = http.client.HTTPConnection("127.0.0.1", UP, timeout=3600)  # a 20k-token CPU prefill takes ~15 min
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
# SAMPLER=standard serves the real model's own tokens instead of the script.
start() {
  local name=$1 text=$2 d=$T/$1
  mkdir -p "$d/plugins"
  for p in anthropic openai responses standard hermes think; do
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
    --tool-parser hermes --sampler "${SAMPLER:-scripted}" "${@:3}" >"$d/server.log" 2>&1 &
  PIDS+=($!)
  local up=""
  for _ in $(seq 1 "${START_TRIES:-240}"); do
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

jget() { "$PY" -c 'import json,sys; j=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2" 2>/dev/null; }
sizes() { awk -F'\t' '$2=="POST"{printf "%s%s B (%s)", s, $4, $5; s=", "}' "$LOG/index.tsv"; }

PASS=0; FAIL=0; SUMMARY=()
check() { # check NAME COND_STATUS DETAIL
  if [ "$2" = 0 ]; then PASS=$((PASS+1)); SUMMARY+=("PASS  $1: $3"); else FAIL=$((FAIL+1)); SUMMARY+=("FAIL  $1: $3"); fi
}

