#!/usr/bin/env bash
# CPU decode from quantized weights, side by side in one run on the same GGUF: `mlxhost bench` on
# the quantized path (the CPU default: 4/8-bit weights in memory, mlxhost's kernel and fused
# decode layer) and on the float32 path, vs llama.cpp (llama-cpp-python 0.3.16 built for this
# CPU) measured the same way (benches/llama_cpp_bench.py). Prefill tok/s, decode ms per token
# and tok/s, peak RSS; mlxhost also at batch sizes 8 and 16 (aggregate tok/s).
#   benches/cpu_decode.sh [GGUF]      # PROMPT_TOKENS=256 DECODE_TOKENS=64 ROUNDS=2
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/side_by_side.sh
. benches/llama_cpp_env.sh
GGUF="${1:-$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
PROMPT_TOKENS="${PROMPT_TOKENS:-256}"; DECODE_TOKENS="${DECODE_TOKENS:-64}"; ROUNDS="${ROUNDS:-2}"
OUT=$(mktemp)
ours() {  # $1 = dtype, $2 = batch
  "$BIN" bench --model "$GGUF" --dtype "$1" --batch "$2" --prompt-tokens "$PROMPT_TOKENS" \
    --decode-tokens "$DECODE_TOKENS" 2>/dev/null
}
# Alternate the engines each round so drift on this shared machine hits both.
for _ in $(seq "$ROUNDS"); do
  ours quantized 1
  "$LLAMA_VENV/bin/python" benches/llama_cpp_bench.py "$GGUF" "$PROMPT_TOKENS" "$DECODE_TOKENS" 2>/dev/null
  ours float32 1
done | tee -a "$OUT"
{ ours quantized 8; ours quantized 16; } | tee -a "$OUT"
python3 - "$OUT" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip().startswith("{")]
def key(r): return (r["engine"], r["compute"], r.get("batch", 1))
groups = {}
for r in rows: groups.setdefault(key(r), []).append(r)
print(f"\n{'engine':10} {'path':10} {'batch':>5} {'prefill tok/s':>13} {'decode ms/step':>14} {'decode tok/s':>12} {'aggregate':>10} {'peak RSS MiB':>12}")
med = {}
for k, rs in groups.items():
    m = {f: statistics.median(r[f] for r in rs) for f in ("prefill_tok_s", "decode_ms_per_token", "peak_rss_mib")}
    m["decode_tok_s"] = 1e3 / m["decode_ms_per_token"]
    med[k] = m
    print(f"{k[0]:10} {k[1]:10} {k[2]:>5} {m['prefill_tok_s']:>13.1f} {m['decode_ms_per_token']:>14.2f} {m['decode_tok_s']:>12.1f} {k[2]*m['decode_tok_s']:>10.1f} {m['peak_rss_mib']:>12.0f}")
q, l, f = med[("mlxhost", "quantized", 1)], med[("llama.cpp", "gguf", 1)], med[("mlxhost", "float32", 1)]
print(f"\nquantized vs llama.cpp: decode {q['decode_tok_s']/l['decode_tok_s']:.2f}x, prefill {q['prefill_tok_s']/l['prefill_tok_s']:.2f}x")
print(f"quantized vs float32:   decode {q['decode_tok_s']/f['decode_tok_s']:.2f}x, prefill {q['prefill_tok_s']/f['prefill_tok_s']:.2f}x, peak RSS {q['peak_rss_mib']/f['peak_rss_mib']:.2f}x")
PY
rm -f "$OUT"
