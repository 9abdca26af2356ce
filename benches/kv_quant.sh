#!/usr/bin/env bash
# Quantized KV cache on this CPU (issue 41): decode at a long context (CONTEXT positions of random
# keys and values written into each row's cache, `bench --context`) with the float cache and
# with --kv-bits 8 and 4 (group size 64), same binary and GGUF, the three interleaved each round
# so drift on a shared machine hits all of them; with LLAMA_CPP=1 also llama.cpp (llama-cpp-python
# 0.3.16, benches/llama_cpp_env.sh) with its f16 cache and with -ctk q8_0 -ctv q8_0 (flash
# attention on, which a quantized V cache needs). Prints each run's JSON line (`mlxhost bench`:
# decode_ms_per_token, kv, kv_bytes_per_token, peak_rss_mib), then a summary line per cache with
# the median decode ms and the speedup over float.
#   benches/kv_quant.sh [GGUF]      # CONTEXT=16384 DECODE_TOKENS=32 ROUNDS=1 BATCH=1 LLAMA_CPP=0
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${MLXHOST_BIN:-target/release/mlxhost}"
CACHE="${MLXHOST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/mlxhost}"
GGUF="${1:-$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
CONTEXT="${CONTEXT:-16384}"; DECODE_TOKENS="${DECODE_TOKENS:-32}"; ROUNDS="${ROUNDS:-1}"
BATCH="${BATCH:-1}"; LLAMA_CPP="${LLAMA_CPP:-0}"
if [ "$LLAMA_CPP" = 1 ]; then . benches/llama_cpp_env.sh; fi
OUT=$(mktemp)
ours() {  # $@ = extra flags
  # --context: the rows' caches hold CONTEXT positions of random keys and values (no 16k
  # prefill, which takes minutes per run on 2 cores); a decode step reads the same bytes.
  "$BIN" bench --model "$GGUF" --prompt-tokens 16 --context "$CONTEXT" \
    --decode-tokens "$DECODE_TOKENS" --repeats 1 --batch "$BATCH" "$@" 2>/dev/null
}
for _ in $(seq "$ROUNDS"); do
  ours
  ours --kv-bits 8
  ours --kv-bits 4
  if [ "$LLAMA_CPP" = 1 ]; then
    "$LLAMA_VENV/bin/python" benches/llama_cpp_bench.py "$GGUF" "$CONTEXT" "$DECODE_TOKENS" 1 2>/dev/null
    LLAMA_KV_TYPE=q8_0 "$LLAMA_VENV/bin/python" benches/llama_cpp_bench.py "$GGUF" "$CONTEXT" "$DECODE_TOKENS" 1 2>/dev/null
  fi
done | tee -a "$OUT"
python3 - "$OUT" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
groups = {}
for r in rows:
    groups.setdefault((r["engine"], r.get("kv", "float")), []).append(r)
base = {}
for (engine, kv), rs in groups.items():
    if kv in ("float", "f16"):
        base[engine] = statistics.median(r["decode_ms_per_token"] for r in rs)
for (engine, kv), rs in groups.items():
    ms = statistics.median(r["decode_ms_per_token"] for r in rs)
    print(json.dumps({
        "summary": engine, "kv": kv, "context": rs[0].get("decode_context", rs[0].get("prompt_tokens")), "runs": len(rs),
        "decode_ms_per_token": round(ms, 2),
        "speedup_vs_float": round(base[engine] / ms, 3) if engine in base else None,
        "kv_bytes_per_token": rs[0].get("kv_bytes_per_token"),
        "peak_rss_mib": rs[0].get("peak_rss_mib"),
    }))
PY
rm -f "$OUT"
