#!/usr/bin/env bash
# LoRA decode cost (issue 42): `mlxhost bench`'s decode step with rank-R adapters over every
# projection of every layer (benches/make_lora.py --bench: random, mlx-lm's format) against the
# base model, interleaved round by round so the machine's drift falls on every configuration:
#   batch 1: base | one adapter unmerged (--lora) | the same adapter merged (--lora-merge)
#   batch 8: 8 base rows | 8 rows over 4 adapters (row i runs adapter i % 4) | 8 rows of one adapter
# Prints one JSON line per run and a table of medians (ms per decode step, and the unmerged
# adapter's cost as a share of the base step). Env: MLXHOST_BIN (target/release/mlxhost), MODEL
# (the default model), PY (python with mlx-lm: /tmp/mlxvenv/bin/python, else python3), RANK (16),
# ROUNDS (3), DECODE (64 steps per run), ADAPTERS (a folder of bench0..bench3; made when absent).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${MLXHOST_BIN:-target/release/mlxhost}"
PY="${PY:-$([ -x /tmp/mlxvenv/bin/python ] && echo /tmp/mlxvenv/bin/python || echo python3)}"
RANK="${RANK:-16}" ROUNDS="${ROUNDS:-3}" DECODE="${DECODE:-64}"
ADAPTERS="${ADAPTERS:-/tmp/mlxhost-lora-bench-r$RANK}"
MODEL_ARGS=()
[ -n "${MODEL:-}" ] && MODEL_ARGS=(--model "$MODEL")
[ -d "$ADAPTERS/bench3" ] || "$PY" benches/make_lora.py --bench "$ADAPTERS" --rank "$RANK" --count 4
A=("$ADAPTERS"/bench0 "$ADAPTERS"/bench1 "$ADAPTERS"/bench2 "$ADAPTERS"/bench3)
declare -A CONFIGS=(
  [b1_base]="--batch 1"
  [b1_lora]="--batch 1 --lora ${A[0]}"
  [b1_merged]="--batch 1 --lora-merge ${A[0]}"
  [b8_base]="--batch 8"
  [b8_4loras]="--batch 8 --lora ${A[0]} --lora ${A[1]} --lora ${A[2]} --lora ${A[3]}"
  [b8_1lora]="--batch 8 --lora ${A[0]}"
)
ORDER=(b1_base b1_lora b1_merged b8_base b8_4loras b8_1lora)
RESULTS=$(mktemp)
for round in $(seq "$ROUNDS"); do
  for name in "${ORDER[@]}"; do
    # shellcheck disable=SC2086
    line=$("$BIN" bench "${MODEL_ARGS[@]}" --prompt-tokens 64 --repeats 1 --decode-tokens "$DECODE" \
      ${CONFIGS[$name]} 2>/dev/null)
    echo "{\"config\": \"$name\", \"round\": $round, \"result\": $line}" | tee -a "$RESULTS"
  done
done
python3 - "$RESULTS" "$RANK" <<'PY'
import json, statistics, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in runs:
    by.setdefault(r["config"], []).append(r["result"]["decode_ms_per_step"])
med = {k: statistics.median(v) for k, v in by.items()}
first = runs[0]["result"]
print(f"\nbackend {first['backend']}, compute {first['compute']}, rank {sys.argv[2]}, "
      f"{len(by['b1_base'])} rounds; ms per decode step (median)")
for k in ["b1_base", "b1_lora", "b1_merged", "b8_base", "b8_4loras", "b8_1lora"]:
    base = med["b1_base" if k.startswith("b1") else "b8_base"]
    print(f"  {k:10s} {med[k]:8.2f}  {100 * (med[k] / base - 1):+6.1f}% vs base")
PY
