#!/usr/bin/env bash
# Runs the real Claude Code CLI (@anthropic-ai/claude-code from npm) against mlxhost, with
# the test-only `scripted` sampler standing in for a model that could act as an agent.
# See tests/agents/README.md. Usage: tests/agents/claude_code.sh   (from anywhere)
# Env: MLXHOST_BIN (default target/debug/mlxhost; target/release/mlxhost with REAL=1),
# CLAUDE_CODE_VERSION (2.1.197, the version the results in the README were seen with),
# CLAUDE_CODE_PREFIX (install cache, default ~/.cache/mlxhost/agents/claude-code), CC_FULL=1
# also runs full (non --bare) mode (slow on a debug build: ~3k prompt tokens), CC_QWEN=1 also
# runs full mode with Qwen2.5-Coder-0.5B (~20k prompt tokens: use a release build), REAL=1 a
# real model doing a small task in full mode in two sessions against one server (MODEL, default
# qwen2.5-coder-1.5b; TASK; TEMP, default 0; CC_REAL_TIMEOUT per session, default 7200 s;
# CC_REAL_TURNS, default 4; STRICT=1 counts the model's own failures as failed checks), KEEP=1
# keeps the temp dir.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
REAL=${REAL:-0}
if [ "$REAL" = 1 ]; then MLXHOST=${MLXHOST_BIN:-$ROOT/target/release/mlxhost}; else MLXHOST=${MLXHOST_BIN:-$ROOT/target/debug/mlxhost}; fi
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

NAME=claude
# shellcheck source=tests/agents/common.sh
. "$ROOT/tests/agents/common.sh"


# claude DIR ARGS...: runs Claude Code in DIR/work with HOME DIR/home; stdout ->
# DIR/$CC_OUT.json (default out)
claude() {
  local dir=$1 out=${CC_OUT:-out}; shift
  mkdir -p "$dir/home" "$dir/work"
  (cd "$dir/work" && env HOME="$dir/home" ANTHROPIC_BASE_URL="http://127.0.0.1:$PORT" \
     ANTHROPIC_API_KEY=dummy ANTHROPIC_MODEL=m ANTHROPIC_DEFAULT_HAIKU_MODEL=m \
     CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_AUTOUPDATER=1 \
     timeout "${CC_TIMEOUT:-300}" "$CLAUDE" "$@" --output-format json \
     >"$dir/$out.json" 2>"$dir/$out.err")
  echo $?
}
# jget FILE EXPR: a Python expression over the JSON `j` in FILE
# --- 1. bare one-shot -----------------------------------------------------------------
start hello "Hello from mlxhost."
D=$T/hello; rc=$(claude "$D" -p "Say hi" --bare)
res=$(jget "$D/out.json" 'j["result"]'); err=$(jget "$D/out.json" 'j["is_error"]')
[ "$rc" = 0 ] && [ "$err" = False ] && [ "$res" = "Hello from mlxhost." ]
check "bare one-shot" $? "rc=$rc is_error=$err result='$res'; requests: $(sizes)"
[ "$rc" = 0 ] || { echo "--- stdout"; cat "$D/out.json"; echo "--- stderr"; tail -20 "$D/out.err"; }

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

# --- 5. full mode with a real tool-calling model (optional: CC_QWEN=1) --------------------
# Qwen2.5-Coder-0.5B-Instruct renders the 24 tools into its prompt (~20k tokens of its 32k
# context) and answers with its own tokens (the standard sampler, greedy): a real model
# behind the whole agent request. Slow on CPU: use a release build (MLXHOST_BIN).
if [ "${CC_QWEN:-0}" = 1 ]; then
  SAMPLER=standard START_TRIES=1200 start qwen "" --model qwen2.5-coder-0.5b
  # Claude Code abandons a stream after 5 min without content events (pings do not count)
  # and resends the request unstreamed; a ~19k-token CPU prefill takes ~15 min here.
  export CLAUDE_STREAM_IDLE_TIMEOUT_MS=${CLAUDE_STREAM_IDLE_TIMEOUT_MS:-3600000}
  D=$T/qwen; rc=$(CC_TIMEOUT=${CC_QWEN_TIMEOUT:-1800} claude "$D" -p "Reply with one short sentence: what is 2 + 2?" --max-turns 1)
  res=$(jget "$D/out.json" 'j["result"]'); err=$(jget "$D/out.json" 'j["is_error"]')
  sub=$(jget "$D/out.json" 'j["subtype"]')
  ntools=$(jget "$LOG/$(ls "$LOG" | grep -m1 '^[0-9]*\.json$')" 'len(j.get("tools") or [])')
  ptok=$(grep -o 'prompt_tokens=[0-9]*' "$T/qwen/server.log" | sort -t= -k2 -n | tail -1)
  # Success, or the turn limit after a tool call the model chose to make: both are a
  # well-formed agent turn served end to end (an API error would be is_error with rc 1).
  [ "$err" = False ] || [ "$sub" = error_max_turns ]
  check "full mode, Qwen2.5-Coder" $? "rc=$rc is_error=$err subtype=$sub result='${res:0:120}'; tools=$ntools $ptok; requests: $(sizes)"
  stop
fi

# --- 6. a real model doing a small task, two sessions against one server (REAL=1) ----------
# Full mode (no --bare: 24 tools, ~19k prompt tokens with Qwen's template), Write and Bash
# allowed. Same work dir and HOME for both sessions (the first user message names the cwd);
# the server drops the per-session billing block, so the second session can reuse the first's
# system prompt. The first's file is moved away before the second.
if [ "$REAL" = 1 ]; then
  MODEL=${MODEL:-qwen2.5-coder-1.5b}
  TASK=${TASK:-"Create a file hello.py that prints hello"}
  # greedy (TEMP, default 0) unless told: the server's HTTP default is OpenAI's 1.0
  SAMPLER=standard START_TRIES=1200 start real "" --model "$MODEL" --temp "${TEMP:-0}" ${SERVE_ARGS:-}  # SERVE_ARGS: more serve flags, e.g. --memory-budget 1
  # a cold ~19k-token CPU prefill takes many minutes: no content events until it ends
  export CLAUDE_STREAM_IDLE_TIMEOUT_MS=${CLAUDE_STREAM_IDLE_TIMEOUT_MS:-3600000}
  D=$T/real
  for s in 1 2; do
    mark
    rc=$(CC_OUT=session$s CC_TIMEOUT=${CC_REAL_TIMEOUT:-7200} claude "$D" -p "$TASK" \
           --allowedTools Write Bash --max-turns "${CC_REAL_TURNS:-4}")
    echo "claude session $s: subtype=$(jget "$D/session$s.json" 'j["subtype"]') is_error=$(jget "$D/session$s.json" 'j["is_error"]') turns=$(jget "$D/session$s.json" 'j["num_turns"]') result='$(jget "$D/session$s.json" 'j["result"][:120]')'"
    session_report "claude code real session $s ($MODEL)" "$rc" "$D/work" hello.py
    [ -e "$D/work/hello.py" ] && mv "$D/work/hello.py" "$D/session$s-hello.py"
  done
  stop
fi

echo "Claude Code $VERSION against $("$MLXHOST" --version 2>/dev/null || echo mlxhost)"
summary
