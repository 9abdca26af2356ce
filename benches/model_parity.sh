#!/usr/bin/env bash
# Parity of a GGUF model against mlx-lm 0.32.2 on the directory `mlxhost convert` writes from it:
# teacher-forced top-5 logprobs on the fixture's prompts and llama.cpp's greedy continuations
# (tests/fixtures/models/NAME.llama-cpp.json), mlxhost's `--dtype native` on the directory vs
# mlx-lm on the same directory. Prints the largest differences (chosen token, shared top-5).
#   benches/model_parity.sh [NAME]        # qwen2.5-coder-0.5b (default) or gemma3-270m;
#                                         # CASES=1 (fixture case indices, comma-separated)
# mlx-lm's CPU quantized matmul is slow here (~13 minutes for case 1's 33 tokens on 2 cores),
# hence one case by default.
set -euo pipefail
cd "$(dirname "$0")/.."
. benches/side_by_side.sh
NAME="${1:-qwen2.5-coder-0.5b}"
case "$NAME" in
  qwen2.5-coder-0.5b) FIXTURE=tests/fixtures/models/qwen2.5-coder-0.5b-instruct.llama-cpp.json ;;
  gemma3-270m) FIXTURE=tests/fixtures/models/gemma3-270m.llama-cpp.json ;;
  *) echo "model_parity: no llama.cpp fixture for $NAME" >&2; exit 2 ;;
esac
GGUF=$("$BIN" models pull "$NAME")
DIR="$CACHE/models/$NAME-mlx"
[ -f "$DIR/model.safetensors" ] || "$BIN" convert "$GGUF" "$DIR"
IN=$(mktemp); OURS=$(mktemp); THEIRS=$(mktemp)
python3 - "$FIXTURE" "${CASES:-1}" > "$IN" <<'PY'
import json, sys
wanted = {int(i) for i in sys.argv[2].split(",")}
for k, c in enumerate(json.load(open(sys.argv[1]))["cases"]):
    if k not in wanted:
        continue
    print(json.dumps({"prompt_ids": c["prompt_ids"], "continuation_ids": c["greedy_ids"]}))
PY
"$BIN" score --model "$DIR" --dtype native --input "$IN" > "$OURS"
"$VENV/bin/python" benches/mlx_lm_score.py "$DIR" < "$IN" > "$THEIRS"
python3 - "$OURS" "$THEIRS" <<'PY'
import json, sys
ours = [json.loads(l) for l in open(sys.argv[1])]
theirs = [json.loads(l) for l in open(sys.argv[2])]
chosen = shared = 0.0
for o, t in zip(ours, theirs):
    for so, st in zip(o["steps"], t["steps"]):
        chosen = max(chosen, abs(so["logprob"] - st["logprob"]))
        to = dict((i, v) for i, v in so["top"])
        for i, v in st["top"]:
            if i in to:
                shared = max(shared, abs(to[i] - v))
print(json.dumps({"native_vs_mlx_lm_max_chosen_nats": round(chosen, 4),
                  "native_vs_mlx_lm_max_shared_top5_nats": round(shared, 4)}))
PY
rm -f "$IN" "$OURS" "$THEIRS"
