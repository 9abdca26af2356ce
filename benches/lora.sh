#!/usr/bin/env bash
# LoRA decode cost (issue 42): `mlxhost bench`'s decode step with rank-R adapters over every
# projection of every layer (benches/make_lora.py --bench: random, mlx-lm's format) against the
# base model, interleaved round by round so the machine's drift falls on every configuration:
#   batch 1: base | one adapter unmerged (--lora) | the same adapter merged (--lora-merge)
#   batch 8: 8 base rows | 8 rows over 4 adapters (row i runs adapter i % 4) | 8 rows of one adapter
# Prints one JSON line per run and a table (ms per decode step: the median of the runs' medians, and
# the fastest run's fastest tenth of steps, p10; each against its base: the unmerged adapter's cost
# as a share of the base step). Env: MLXHOST_BIN (target/release/mlxhost), MODEL
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
med, fast = {}, {}
for r in runs:
    med.setdefault(r["config"], []).append(r["result"]["decode_ms_per_step"])
    fast.setdefault(r["config"], []).append(r["result"].get("decode_p10_ms_per_step", float("nan")))
first = runs[0]["result"]
print(f"\nbackend {first['backend']}, compute {first['compute']}, rank {sys.argv[2]}, "
      f"{len(med['b1_base'])} rounds; ms per decode step: median of the runs' medians, "
      f"and the fastest run's fastest tenth of steps (p10: the steps other work on the "
      f"machine did not slow)")
for k in ["b1_base", "b1_lora", "b1_merged", "b8_base", "b8_4loras", "b8_1lora"]:
    b = "b1_base" if k.startswith("b1") else "b8_base"
    m, bm = statistics.median(med[k]), statistics.median(med[b])
    f, bf = min(fast[k]), min(fast[b])
    print(f"  {k:10s} median {m:8.2f} {100 * (m / bm - 1):+6.1f}%   p10 {f:8.2f} {100 * (f / bf - 1):+6.1f}%")
PY
