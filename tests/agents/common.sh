# Shared by the agent scripts (sourced, not run): a temp dir cleaned on exit, a logging proxy,
# `start NAME SCRIPT_TEXT [EXTRA_SERVE_ARGS...]` (mlxhost with the scripted sampler replying
# SCRIPT_TEXT, behind the proxy; sets PORT, LOG, and UP and SLOG, the server's port and log),
# `stop`, `jget`, `sizes`, `check`, and for real-model sessions `mark`, `session_report` (a
# per-request table from the server log and the proxy's index, and whether a failure is the
# model's or the server's) and `summary`.
# Needs ROOT, MLXHOST, PY and NAME (the temp dir's prefix) set by the caller.
T=$(mktemp -d /tmp/mlxhost-$NAME.XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; wait "$p" 2>/dev/null; done
  if [ "${KEEP:-0}" = 1 ]; then echo "kept $T" >&2; else rm -rf "$T"; fi
}
trap cleanup EXIT

# --- logging proxy: writes each request body to LOGDIR/NNN.json, one line per request to
# LOGDIR/index.tsv once answered (n, method, path, request bytes, status, the server's
# x-request-id) and to LOGDIR/arrived.tsv on arrival (n, method, path, bytes), the response body
# (first 1 MB) to NNN.resp and error bodies also to NNN-STATUS.txt
cat > "$T/proxy.py" <<'EOF'
import http.client, http.server, json, os, sys, threading
UP = int(sys.argv[1]); LOG = sys.argv[2]; os.makedirs(LOG, exist_ok=True)
lock = threading.Lock(); count = [0]
AFTER = os.environ.get("AFTER_TOOL_TEXT")
def after_tool(body):
    # With AFTER_TOOL_TEXT set, a request that carries a tool's result (Responses
    # `function_call_output`, Anthropic `tool_result`, a Chat `role: "tool"` message) gets
    # that reply scripted instead, so an agent's loop ends after one round trip.
    if not AFTER or not body: return body
    try: j = json.loads(body)
    except ValueError: return body
    items = j.get("input") if isinstance(j.get("input"), list) else []
    msgs = [m for m in j.get("messages") or [] if isinstance(m, dict)]
    blocks = [b for m in msgs if isinstance(m.get("content"), list) for b in m["content"]]
    if any(m.get("role") == "tool" for m in msgs) or \
       any(isinstance(x, dict) and x.get("type") in ("function_call_output", "tool_result") for x in items + blocks):
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
        with lock, open(os.path.join(LOG, "arrived.tsv"), "a") as f:
            f.write(f"{i}\t{self.command}\t{self.path}\t{len(body)}\n")
        body = after_tool(body)
        skip = ("host", "connection", "content-length", "accept-encoding")
        hdrs = {k: v for k, v in self.headers.items() if k.lower() not in skip}
        c = http.client.HTTPConnection("127.0.0.1", UP, timeout=3600)  # a 20k-token CPU prefill takes ~15 min
        c.request(self.command, self.path, body=body or None, headers=hdrs)
        r = c.getresponse()
        rid = r.getheader("x-request-id") or "-"
        with lock, open(os.path.join(LOG, "index.tsv"), "a") as f:
            f.write(f"{i}\t{self.command}\t{self.path}\t{len(body)}\t{r.status}\t{rid}\n")
        self.send_response(r.status)
        for k, v in r.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("connection", "close"); self.end_headers()
        out = b""
        while True:
            chunk = r.read1(65536)
            if not chunk: break
            if len(out) < 1000000: out += chunk
            try: self.wfile.write(chunk); self.wfile.flush()
            except OSError: break  # the client left; keep what came so far
        c.close()
        if self.command != "HEAD":
            open(os.path.join(LOG, f"{i:03d}.resp"), "wb").write(out)
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
  UP=$up; SLOG=$d/server.log; LOG=$d/requests
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


# --- real-model sessions: a per-request table and a verdict ------------------------------
# `mark` before a session; after it `session_report TITLE RC WORKDIR FILE` prints one row per
# request the session sent (from the proxy's index.tsv joined by x-request-id to the server's
# `generation finished` lines and /stats `batch.recent`), what the model replied (text or tool
# calls, parsed from the saved response) and what the request carried back (the last tool
# result), then whether FILE was created in WORKDIR and what `python3 FILE` prints; and
# records a verdict: ok (the file prints hello), model (every request answered 200 but the
# model did not call a tool, or called one wrongly), server (an HTTP error in index.tsv, a
# request the server never finished, or the client timed out). The table also goes to
# $T/tables.txt, printed again at the end by `summary`.
cat > "$T/report.py" <<'EOF'
import glob, json, os, re, subprocess, sys, urllib.request
LOG, SLOG, MARK, UP, TITLE, RC, WORK, FILE = sys.argv[1:9]
MARK, RC = int(MARK), int(RC)
def tsv(name):
    try: return [l.split("\t") for l in open(os.path.join(LOG, name)).read().splitlines()]
    except OSError: return []
answered = {int(f[0]): (int(f[4]), (f + ["-"])[5]) for f in tsv("index.tsv")}
rows = []
for f in tsv("arrived.tsv")[MARK:]:  # a request never answered has no index.tsv line
    n = int(f[0]); st, rid = answered.get(n, (0, "-"))
    rows.append(dict(n=n, method=f[1], path=f[2], bytes=int(f[3]), status=st, rid=rid))
rows = [r for r in rows if r["method"] == "POST"]
# server log: generation lines by request id; client ids mapped to server ids
log = open(SLOG, errors="replace").read().splitlines()
alias, gen, failed = {}, {}, {}
kv = lambda s: dict(re.findall(r'(\w+)="?([^\s"]*)"?', s))
for l in log:
    m = re.search(r'request\{request_id=(\w+) client_request_id="?([^"\s}]*)"?\}', l)
    if m and m.group(2): alias[m.group(2)] = m.group(1)
    m = re.search(r'generate\{request_id=(\w+)\}.*generation finished (.*)', l)
    if m: gen[m.group(1)] = kv(m.group(2))
    m = re.search(r'generate\{request_id=(\w+)\}.*generation failed (.*)', l)
    if m: failed[m.group(1)] = m.group(2)[:80]
try:
    recent = json.load(urllib.request.urlopen(f"http://127.0.0.1:{UP}/stats", timeout=10))["batch"]["recent"]
except Exception:
    recent = []
def source(g):  # where the reused KV came from: match /stats batch.recent on (prompt, reused)
    for r in recent:
        if not r.get("_used") and r["prompt_tokens"] == int(g["prompt_tokens"]) and r["reused_tokens"] == int(g["cached_tokens"]):
            r["_used"] = True; return str(r["reused_from"]) if r["reused_tokens"] else "-"
    return "?"
def short(x, n=60):
    x = x if isinstance(x, str) else json.dumps(x)
    x = " ".join(x.split())
    return x if len(x) <= n else x[:n - 3] + "..."
def reply(path):  # what the model answered: text and/or tool calls, from SSE or JSON
    try: raw = open(path, errors="replace").read()
    except OSError: return "(no response saved)", []
    text, calls, chat = "", [], {}
    events = [l[5:].strip() for l in raw.splitlines() if l.startswith("data:")]
    if not events and raw.strip().startswith("{"): events = [raw]
    for e in events:
        try: j = json.loads(e)
        except ValueError: continue
        if not isinstance(j, dict): continue
        for c in j.get("choices") or []:  # chat completions (stream or not)
            d = c.get("delta") or c.get("message") or {}
            text += d.get("content") or ""
            for t in d.get("tool_calls") or []:
                k = t.get("index", len(chat))
                fn = t.get("function") or {}
                cur = chat.setdefault(k, ["", ""])
                cur[0] += fn.get("name") or ""; cur[1] += fn.get("arguments") or ""
        if j.get("type") == "response.completed" or (j.get("object") == "response" and "output" in j):
            for it in (j.get("response") or j).get("output") or []:  # responses
                if it.get("type") == "function_call": calls.append((it.get("name"), it.get("arguments")))
                if it.get("type") == "message":
                    text += "".join(c.get("text", "") for c in it.get("content") or [])
        if j.get("type") == "content_block_start":  # anthropic stream
            b = j.get("content_block") or {}
            if b.get("type") == "tool_use": calls.append([b.get("name"), ""])
        if j.get("type") == "content_block_delta":
            d = j.get("delta") or {}
            if d.get("type") == "text_delta": text += d.get("text", "")
            if d.get("type") == "input_json_delta" and calls: calls[-1][1] += d.get("partial_json", "")
        if j.get("type") == "message" and isinstance(j.get("content"), list):  # anthropic, not streamed
            for b in j["content"]:
                if b.get("type") == "text": text += b.get("text", "")
                if b.get("type") == "tool_use": calls.append((b.get("name"), json.dumps(b.get("input"))))
        if "error" in j and isinstance(j["error"], dict): text += "[error] " + str(j["error"].get("message"))
    calls += [tuple(v) for _, v in sorted(chat.items())]
    return text, calls
def carried(path):  # the tool result a request sends back (its last message / item)
    try: j = json.load(open(path))
    except (OSError, ValueError): return ""
    if isinstance(j.get("input"), list) and j["input"]:
        last = j["input"][-1]
        if last.get("type") == "function_call_output": return "result " + short(last.get("output"), 40)
    msgs = j.get("messages") or []
    if msgs:
        last = msgs[-1]
        if last.get("role") == "tool": return "result " + short(last.get("content"), 40)
        if isinstance(last.get("content"), list):
            rs = [b for b in last["content"] if isinstance(b, dict) and b.get("type") == "tool_result"]
            if rs:
                c = rs[-1].get("content")
                if isinstance(c, list): c = " ".join(b.get("text", "") for b in c if isinstance(b, dict))
                return ("error " if rs[-1].get("is_error") else "result ") + short(c, 40)
    return ""
out, any_calls, http_err, unfinished, last_text = [], [], [], [], ""
hdr = f"{'#':>3} {'path':<24} {'bytes':>6} {'st':>3} {'prompt':>6} {'cached':>6} {'from':<11} {'ttft_ms':>8} {'out':>4} {'finish':<9} carried -> reply"
out.append(f"--- {TITLE}: {len(rows)} request(s)")
out.append(hdr)
for r in rows:
    sid = alias.get(r["rid"], r["rid"])
    g = gen.get(sid)
    text, calls = reply(os.path.join(LOG, f"{r['n']:03d}.resp"))
    any_calls += calls
    if text.strip(): last_text = text
    if r["status"] >= 400: http_err.append(f"#{r['n']} {r['status']} {short(text, 120)!r}")
    elif r["status"] == 0: unfinished.append(f"#{r['n']} (no response)")
    elif not g: unfinished.append(f"#{r['n']}" + (f" ({failed[sid]})" if sid in failed else ""))
    rep = "; ".join(f"{n}({short(a, 50)})" for n, a in calls) if calls else "text " + repr(short(text, 50))
    c = carried(os.path.join(LOG, f"{r['n']:03d}.json"))
    if g:
        out.append(f"{r['n']:>3} {r['path'][:24]:<24} {r['bytes']:>6} {r['status']:>3} {g.get('prompt_tokens','?'):>6} {g.get('cached_tokens','?'):>6} {source(g):<11} {g.get('ttft_ms','-'):>8} {g.get('completion_tokens','?'):>4} {g.get('finish','?'):<9} {c + ' -> ' if c else ''}{rep}")
    else:
        out.append(f"{r['n']:>3} {r['path'][:24]:<24} {r['bytes']:>6} {r['status']:>3} {'-':>6} {'-':>6} {'-':<11} {'-':>8} {'-':>4} {'-':<9} {c + ' -> ' if c else ''}{rep}")
fp = os.path.join(WORK, FILE)
if os.path.exists(fp):
    try:
        p = subprocess.run([sys.executable, FILE], cwd=WORK, capture_output=True, text=True, timeout=20)
        ran, prints = (p.stdout + p.stderr).strip(), p.returncode == 0 and "hello" in p.stdout.lower()
    except subprocess.TimeoutExpired:
        ran, prints = "(timed out)", False
    outcome = f"{FILE} created ({os.path.getsize(fp)} B), `python3 {FILE}` prints {short(ran, 60)!r}"
else:
    prints, outcome = False, f"no {FILE} in the work dir"
if http_err: v = "server", "HTTP error " + ", ".join(http_err)
elif unfinished: v = "server", ("the client timed out (rc 124) waiting for " if RC == 124 else "no finished generation for ") + ", ".join(unfinished)
elif not rows: v = "server", f"no request reached the server (client rc {RC})"
elif prints: v = "ok", outcome
elif RC == 124: v = "model", "still going at the client's time limit (every request answered); " + outcome
elif not any_calls: v = "model", f"answered without calling a tool ({short(last_text, 160)!r}); " + outcome
else: v = "model", "called " + ", ".join(sorted({str(n) for n, _ in any_calls})) + " but " + outcome
out.append(f"client rc={RC}; {outcome}")
out.append(f"verdict: {v[0]} ({v[1]})")
print("\n".join(out))
open(os.environ["TABLES"], "a").write("\n".join(out) + "\n\n")
print(f"VERDICT\t{v[0]}\t{v[1]}")
EOF

# mark: where the next session's requests start in the proxy's index
mark() { MARK=$(cat "$LOG/arrived.tsv" 2>/dev/null | wc -l); }
# session_report TITLE RC WORKDIR FILE: table + verdict (see above); the verdict is recorded as
# PASS (ok), MODEL (the model's own failure: not a failed check unless STRICT=1) or FAIL (server)
MODELFAIL=0
session_report() {
  local out v why
  out=$(TABLES="$T/tables.txt" "$PY" "$T/report.py" "$LOG" "$SLOG" "${MARK:-0}" "$UP" "$1" "$2" "$3" "$4")
  printf '%s\n' "$out" | grep -v '^VERDICT'
  v=$(printf '%s\n' "$out" | awk -F'\t' '/^VERDICT/{print $2}')
  why=$(printf '%s\n' "$out" | awk -F'\t' '/^VERDICT/{print $3}')
  case "$v" in
    ok) check "$1" 0 "$why" ;;
    model) MODELFAIL=$((MODELFAIL+1)); SUMMARY+=("MODEL $1: the model's failure: $why")
           [ "${STRICT:-0}" = 1 ] && FAIL=$((FAIL+1)) ;;
    *) check "$1" 1 "server: ${why:-no report}" ;;
  esac
}
# summary: the tables seen, the PASS/MODEL/FAIL lines, the counts; exit status 1 on a FAIL
summary() {
  [ -s "$T/tables.txt" ] && { echo; echo "=== per-request tables"; cat "$T/tables.txt"; }
  printf '%s\n' "${SUMMARY[@]}"
  echo "passed $PASS, failed $FAIL, model failures $MODELFAIL"
  [ "$FAIL" = 0 ]
}
