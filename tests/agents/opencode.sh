#!/usr/bin/env bash
# Runs the real opencode CLI (opencode-ai from npm) against mlxhost through the OpenAI Chat
# Completions adapter (an `@ai-sdk/openai-compatible` provider in opencode.json whose model has
# no `limit`, so opencode sends its default max_tokens 32000), with the test-only `scripted`
# sampler standing in for a model that could act as an agent; REAL=1 also runs a real model
# in two sessions against one server. See tests/agents/README.md.
# Usage: tests/agents/opencode.sh   (from anywhere)
# Env: MLXHOST_BIN (default target/debug/mlxhost; target/release/mlxhost with REAL=1),
# OPENCODE_VERSION (1.18.33, the version the results in the README were seen with),
# OPENCODE_PREFIX (install cache, default ~/.cache/mlxhost/agents/opencode), REAL=1 (the real
# two-session test; MODEL, default qwen2.5-coder-1.5b; TASK; TEMP, default 0; OC_REAL_TIMEOUT
# per session, default 1800 s; STRICT=1 counts the model's own failures as failed checks),
# KEEP=1 keeps the temp dir.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
REAL=${REAL:-0}
if [ "$REAL" = 1 ]; then MLXHOST=${MLXHOST_BIN:-$ROOT/target/release/mlxhost}; else MLXHOST=${MLXHOST_BIN:-$ROOT/target/debug/mlxhost}; fi
PREFIX=${OPENCODE_PREFIX:-$HOME/.cache/mlxhost/agents/opencode}
OPENCODE=$PREFIX/bin/opencode
PY=${PYTHON:-python3}

# --- install (cached) -------------------------------------------------------------------
# npm 11 skips the package's postinstall (allow-scripts); bin/opencode is the platform binary
# and works without it.
if ! "$OPENCODE" --version >/dev/null 2>&1; then
  echo "installing opencode-ai under $PREFIX" >&2
  npm i -g --prefix "$PREFIX" "opencode-ai@${OPENCODE_VERSION:-1.18.33}" >&2 || { echo "npm install failed" >&2; exit 2; }
fi
VERSION=$("$OPENCODE" --version 2>/dev/null)
[ -x "$MLXHOST" ] || { echo "no mlxhost binary at $MLXHOST (cargo build first)" >&2; exit 2; }

NAME=opencode
# shellcheck source=tests/agents/common.sh
. "$ROOT/tests/agents/common.sh"

# opencode DIR WORK OUT ARGS...: `opencode run` in WORK with HOME and the XDG dirs under DIR,
# the server as provider `mlxhost` (model `m`, no `limit`); JSON events -> DIR/OUT.jsonl, rc
# echoed. `--pure` (no external plugins) keeps opencode from installing @opencode-ai/plugin
# from npm into the config dir at start; OPENCODE_DISABLE_MODELS_FETCH keeps it off models.dev.
opencode() {
  local dir=$1 work=$2 out=$3; shift 3
  mkdir -p "$dir/home" "$dir/config/opencode" "$dir/data" "$dir/cache" "$dir/state" "$work"
  cat > "$dir/config/opencode/opencode.json" <<EOF
{
  "\$schema": "https://opencode.ai/config.json",
  "provider": {
    "mlxhost": {
      "npm": "@ai-sdk/openai-compatible",
      "name": "mlxhost",
      "options": { "baseURL": "http://127.0.0.1:$PORT/v1", "apiKey": "dummy" },
      "models": { "m": { "name": "m" } }
    }
  },
  "model": "mlxhost/m",
  "autoupdate": false,
  "share": "disabled"
}
EOF
  (cd "$work" && env HOME="$dir/home" XDG_CONFIG_HOME="$dir/config" XDG_DATA_HOME="$dir/data" \
     XDG_CACHE_HOME="$dir/cache" XDG_STATE_HOME="$dir/state" \
     OPENCODE_DISABLE_MODELS_FETCH=1 OPENCODE_DISABLE_AUTOUPDATE=1 OPENCODE_DISABLE_LSP_DOWNLOAD=1 \
     OPENCODE_DISABLE_SHARE=1 \
     timeout "${OC_TIMEOUT:-300}" "$OPENCODE" run --pure --format json "$@" \
     </dev/null >"$dir/$out.jsonl" 2>"$dir/$out.err")
  echo $?
}
# events FILE: the JSON event types opencode printed, space-separated
events() { "$PY" -c 'import json,sys; print(" ".join(json.loads(l)["type"] for l in open(sys.argv[1]) if l.strip().startswith("{")))' "$1" 2>/dev/null; }
# message FILE: the last text part
message() { "$PY" -c '
import json, sys
m = [e["part"]["text"] for e in map(json.loads, filter(lambda l: l.strip().startswith("{"), open(sys.argv[1])))
     if e["type"] == "text"]
print(m[-1] if m else "")' "$1" 2>/dev/null; }
# tools FILE: the tool parts: name, status, input
tools() { "$PY" -c '
import json, sys
for e in map(json.loads, filter(lambda l: l.strip().startswith("{"), open(sys.argv[1]))):
    if e["type"] == "tool_use":
        p = e["part"]; s = p.get("state") or {}
        print(p.get("tool"), s.get("status"), json.dumps(s.get("input"))[:100])' "$1" 2>/dev/null | paste -sd';' -; }
# main_requests: the proxy's saved requests that offer tools (the agent's turns; opencode also
# sends a tool-less title request per session)
main_requests() { "$PY" -c '
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/[0-9][0-9][0-9].json")):
    if json.load(open(f)).get("tools"): print(f)' "$LOG"; }

# --- 1. one-shot: the default config (no `limit`) sends max_tokens 32000 -----------------
start hello "Hello from mlxhost."
D=$T/hello; rc=$(opencode "$D" "$D/work" out "Say hi")
ev=$(events "$D/out.jsonl"); msg=$(message "$D/out.jsonl")
req=$(main_requests | head -1)
mt=$([ -n "$req" ] && jget "$req" 'j.get("max_tokens")'); nt=$([ -n "$req" ] && jget "$req" 'len(j["tools"])')
[ "$rc" = 0 ] && [[ "$ev" == *step_finish* ]] && [[ "$ev" != *error* ]] && [ "$msg" = "Hello from mlxhost." ] && [ "$mt" = 32000 ]
check "one-shot" $? "rc=$rc events='$ev' message='$msg' max_tokens=$mt tools=$nt; requests: $(sizes)"
[ "$rc" = 0 ] || { echo "--- stdout"; cat "$D/out.jsonl"; echo "--- stderr"; tail -20 "$D/out.err"; }
stop

# --- 2. tool round trip: the scripted reply calls opencode's `write` tool; opencode writes the
# file and sends the result back as a `role: "tool"` message; the proxy scripts the reply to
# that request (AFTER_TOOL_TEXT) so the turn ends.
D=$T/tool; mkdir -p "$D/work"
CALL=$("$PY" -c 'import json,sys; print("<tool_call>\n" + json.dumps({"name": "write", "arguments": {"filePath": sys.argv[1] + "/hello.txt", "content": "hi"}}) + "\n</tool_call>")' "$D/work")
AFTER_TOOL_TEXT="Wrote hello.txt." start tool "$CALL"
rc=$(opencode "$D" "$D/work" out "Write hi to hello.txt")
ev=$(events "$D/out.jsonl"); msg=$(message "$D/out.jsonl"); tl=$(tools "$D/out.jsonl")
content=$(cat "$D/work/hello.txt" 2>/dev/null)
# the second agent request must answer the first reply's tool call with a `tool` message
tr=$("$PY" - $(main_requests) <<'EOF'
import json, sys
reqs = [json.load(open(f)) for f in sys.argv[1:]]
if len(reqs) < 2: print("only %d agent request(s)" % len(reqs)); sys.exit()
msgs = reqs[1]["messages"]
calls = [c for m in msgs if m["role"] == "assistant" for c in m.get("tool_calls") or []]
res = [m for m in msgs if m["role"] == "tool"]
ok = calls and res and res[0]["tool_call_id"] == calls[0]["id"]
print(("ok" if ok else "BAD") + ": tool_calls %s %s -> tool %s" % (
    calls[0]["function"]["name"] if calls else None, calls[0]["function"]["arguments"] if calls else "",
    json.dumps(res[0]["content"])[:120] if res else None))
EOF
)
[ "$rc" = 0 ] && [[ "$ev" == *tool_use* ]] && [[ "$ev" != *error* ]] && [ "$content" = hi ] && [[ "$tr" == ok* ]] && [ "$msg" = "Wrote hello.txt." ]
check "tool round trip" $? "rc=$rc events='$ev' tools='$tl' file='$content' message='$msg'; $tr; requests: $(sizes)"
[ "$rc" = 0 ] || { echo "--- stdout"; cat "$D/out.jsonl"; echo "--- stderr"; tail -20 "$D/out.err"; }
stop

# --- 3. a real model, two sessions against one server (REAL=1) ----------------------------
# Both sessions run in the same work dir with the same HOME (opencode's system prompt names
# the working directory, so only then can the second reuse the first's prompt KV); the file
# the first created is moved out of the way before the second.
if [ "$REAL" = 1 ]; then
  MODEL=${MODEL:-qwen2.5-coder-1.5b}
  TASK=${TASK:-"Create a file hello.py that prints hello"}
  # greedy (TEMP, default 0) unless told: opencode sends no temperature, and the server's
  # HTTP default is OpenAI's 1.0
  SAMPLER=standard START_TRIES=1200 start real "" --model "$MODEL" --temp "${TEMP:-0}" ${SERVE_ARGS:-}  # SERVE_ARGS: more serve flags, e.g. --memory-budget 1
  D=$T/real
  for s in 1 2; do
    mark
    rc=$(OC_TIMEOUT=${OC_REAL_TIMEOUT:-1800} opencode "$D" "$D/work" "session$s" "$TASK")
    echo "opencode session $s: events '$(events "$D/session$s.jsonl")'; tools '$(tools "$D/session$s.jsonl")'"
    session_report "opencode real session $s ($MODEL)" "$rc" "$D/work" hello.py
    [ -e "$D/work/hello.py" ] && mv "$D/work/hello.py" "$D/session$s-hello.py"
  done
  stop
fi

echo "opencode $VERSION against $("$MLXHOST" --version 2>/dev/null || echo mlxhost)"
summary
