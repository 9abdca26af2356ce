#!/usr/bin/env bash
# Runs the real Codex CLI (@openai/codex from npm) against mlxhost through the OpenAI Responses
# adapter (a custom provider with wire_api="responses"), with the test-only `scripted` sampler
# standing in for a model that could act as an agent. See tests/agents/README.md.
# Usage: tests/agents/codex.sh   (from anywhere)
# Env: MLXHOST_BIN (default target/debug/mlxhost; target/release/mlxhost with REAL=1),
# CODEX_VERSION (0.171.0, the version the results in the README were seen with), CODEX_PREFIX
# (install cache, default ~/.cache/mlxhost/agents/codex), REAL=1 (a real model in two sessions
# against one server; MODEL, default qwen2.5-coder-1.5b; TASK; TEMP, default 0;
# CODEX_REAL_TIMEOUT per session, default 1800 s; STRICT=1 counts the model's own failures as
# failed checks), KEEP=1 keeps the temp dir.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
REAL=${REAL:-0}
if [ "$REAL" = 1 ]; then MLXHOST=${MLXHOST_BIN:-$ROOT/target/release/mlxhost}; else MLXHOST=${MLXHOST_BIN:-$ROOT/target/debug/mlxhost}; fi
PREFIX=${CODEX_PREFIX:-$HOME/.cache/mlxhost/agents/codex}
CODEX=$PREFIX/bin/codex
PY=${PYTHON:-python3}

# --- install (cached) -------------------------------------------------------------------
if ! "$CODEX" --version >/dev/null 2>&1; then
  echo "installing @openai/codex under $PREFIX" >&2
  npm i -g --prefix "$PREFIX" "@openai/codex@${CODEX_VERSION:-0.171.0}" >&2 || { echo "npm install failed" >&2; exit 2; }
fi
VERSION=$("$CODEX" --version 2>/dev/null)
[ -x "$MLXHOST" ] || { echo "no mlxhost binary at $MLXHOST (cargo build first)" >&2; exit 2; }

NAME=codex
# shellcheck source=tests/agents/common.sh
. "$ROOT/tests/agents/common.sh"

# codex DIR ARGS...: `codex exec` in DIR/work with CODEX_HOME DIR/home and the server as a
# custom Responses provider; JSON events -> DIR/$CODEX_OUT.jsonl (default out), rc echoed.
codex() {
  local dir=$1 out=${CODEX_OUT:-out}; shift
  mkdir -p "$dir/home" "$dir/work"
  (cd "$dir/work" && env CODEX_HOME="$dir/home" LOCAL_API_KEY=dummy \
     timeout "${CODEX_TIMEOUT:-300}" "$CODEX" exec --skip-git-repo-check --ephemeral --json \
       -c model=m -c model_provider=loc \
       -c "model_providers.loc={name=\"mlxhost\",base_url=\"http://127.0.0.1:$PORT/v1\",env_key=\"LOCAL_API_KEY\",wire_api=\"responses\"}" \
       "$@" </dev/null >"$dir/$out.jsonl" 2>"$dir/$out.err")
  echo $?
}
# events DIR [OUT]: the JSON event types Codex printed, space-separated
events() { "$PY" -c 'import json,sys; print(" ".join(json.loads(l)["type"] for l in open(sys.argv[1]) if l.strip()))' "$1/${2:-out}.jsonl" 2>/dev/null; }
# commands DIR OUT: the commands Codex ran (command_execution items), with their exit codes
commands() { "$PY" -c '
import json, sys
for e in map(json.loads, filter(str.strip, open(sys.argv[1]))):
    i = e.get("item") or {}
    if e["type"] == "item.completed" and i.get("type") == "command_execution":
        print(repr(i.get("command"))[:100], "exit", i.get("exit_code"))' "$1/$2.jsonl" 2>/dev/null | paste -sd';' -; }
# message DIR: the last agent_message text
message() { "$PY" -c '
import json, sys
m = [e["item"]["text"] for e in map(json.loads, filter(str.strip, open(sys.argv[1])))
     if e["type"] == "item.completed" and e["item"]["type"] == "agent_message"]
print(m[-1] if m else "")' "$1/out.jsonl" 2>/dev/null; }

# --- 1. one-shot --------------------------------------------------------------------------
start hello "Hello from mlxhost."
D=$T/hello; rc=$(codex "$D" "Say hi")
ev=$(events "$D"); msg=$(message "$D")
[ "$rc" = 0 ] && [[ "$ev" == *turn.completed* ]] && [[ "$ev" != *turn.failed* ]] && [ "$msg" = "Hello from mlxhost." ]
check "one-shot" $? "rc=$rc events='$ev' message='$msg'; requests: $(sizes)"
[ "$rc" = 0 ] || { echo "--- stdout"; cat "$D/out.jsonl"; echo "--- stderr"; tail -20 "$D/out.err"; }
stop

# --- 2. tool round trip: the scripted reply calls Codex's `exec_command`; Codex runs it and
# sends the output back as a function_call_output item; the proxy scripts the reply to that
# request (AFTER_TOOL_TEXT) so the turn ends.
D=$T/tool
CALL=$("$PY" -c 'import json; print("<tool_call>\n" + json.dumps({"name": "exec_command", "arguments": {"cmd": "echo hi > hello.txt"}}) + "\n</tool_call>")')
AFTER_TOOL_TEXT="Wrote hello.txt." start tool "$CALL"
rc=$(codex "$D" --dangerously-bypass-approvals-and-sandbox "Write hi to hello.txt")
ev=$(events "$D"); msg=$(message "$D"); content=$(cat "$D/work/hello.txt" 2>/dev/null)
# the second request must answer the first reply's call with a function_call_output
tr=$("$PY" - "$LOG" <<'EOF'
import glob, json, sys
reqs = [json.load(open(f)) for f in sorted(glob.glob(sys.argv[1] + "/*.json"))]
if len(reqs) < 2: print("only %d request(s)" % len(reqs)); sys.exit()
items = reqs[1]["input"]
calls = [i for i in items if i.get("type") == "function_call"]
outs = [i for i in items if i.get("type") == "function_call_output"]
ok = calls and outs and outs[0]["call_id"] == calls[0]["call_id"]
out = outs[0]["output"] if outs else None
print(("ok" if ok else "BAD") + ": function_call %s %s -> function_call_output %s" % (
    calls[0]["name"] if calls else None, calls[0]["arguments"] if calls else "", json.dumps(out)[:120]))
EOF
)
[ "$rc" = 0 ] && [[ "$ev" == *turn.completed* ]] && [[ "$ev" != *turn.failed* ]] && [ "$content" = hi ] && [[ "$tr" == ok* ]] && [ "$msg" = "Wrote hello.txt." ]
check "tool round trip" $? "rc=$rc events='$ev' file='$content' message='$msg'; $tr; requests: $(sizes)"
[ "$rc" = 0 ] || { echo "--- stdout"; cat "$D/out.jsonl"; echo "--- stderr"; tail -20 "$D/out.err"; }
stop

# --- 3. a real model, two sessions against one server (REAL=1) ----------------------------
# Same work dir and CODEX_HOME for both (Codex's environment context names the cwd, so only
# then can the second session reuse the first's prompt KV); the first's file is moved away.
if [ "$REAL" = 1 ]; then
  MODEL=${MODEL:-qwen2.5-coder-1.5b}
  TASK=${TASK:-"Create a file hello.py that prints hello"}
  # greedy (TEMP, default 0) unless told: the server's HTTP default is OpenAI's 1.0
  SAMPLER=standard START_TRIES=1200 start real "" --model "$MODEL" --temp "${TEMP:-0}" ${SERVE_ARGS:-}  # SERVE_ARGS: more serve flags, e.g. --memory-budget 1
  D=$T/real
  for s in 1 2; do
    mark
    rc=$(CODEX_OUT=session$s CODEX_TIMEOUT=${CODEX_REAL_TIMEOUT:-1800} codex "$D" --dangerously-bypass-approvals-and-sandbox "$TASK")
    echo "codex session $s: events '$(events "$D" "session$s")'; commands '$(commands "$D" "session$s")'"
    session_report "codex real session $s ($MODEL)" "$rc" "$D/work" hello.py
    [ -e "$D/work/hello.py" ] && mv "$D/work/hello.py" "$D/session$s-hello.py"
  done
  stop
fi

echo "$VERSION against $("$MLXHOST" --version 2>/dev/null || echo mlxhost)"
summary
