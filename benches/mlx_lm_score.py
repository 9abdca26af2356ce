"""Teacher-forced scores from mlx-lm 0.32.2 for an MLX model directory, in `mlxhost score`'s
output format, to compare the two on the same files (benches/model_parity.sh).

Input: JSON lines `{"prompt_ids": [...], "continuation_ids": [...]}` on stdin. Output: one line
per input, `{"steps": [{"token": id, "logprob": x, "top": [[id, x], ...5]}]}`: natural log,
log-softmax of the logits at the position before each token, the model run as mlx-lm loads it
(its native numerics: quantized weights, activations in the checkpoint's float dtype).

With `--decode`, the prompt is prefilled and the continuation fed one token per step through
mlx-lm's own KV cache (`make_prompt_cache`), as its generate loop runs: the reference for
`mlxhost score --decode` on the same device.

Usage: python mlx_lm_score.py MODEL_DIR [--decode] < in.jsonl > out.jsonl
"""
import json
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

model, _ = load(sys.argv[1])
DECODE = "--decode" in sys.argv[2:]


def decode_logits(prompt, cont):
    """Logits before each continuation token: one prefill of the prompt, then one token a step."""
    cache = make_prompt_cache(model)
    out = [model(mx.array([prompt]), cache=cache)[0, -1]]
    for tok in cont[:-1]:
        out.append(model(mx.array([[tok]]), cache=cache)[0, -1])
    return mx.stack(out)

for line in sys.stdin:
    if not line.strip():
        continue
    row = json.loads(line)
    prompt, cont = row["prompt_ids"], row["continuation_ids"]
    if DECODE:
        logits = decode_logits(prompt, cont).astype(mx.float32)
        first = 0
    else:
        logits = model(mx.array([prompt + cont]))[0].astype(mx.float32)
        first = len(prompt) - 1
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    steps = []
    for i, tok in enumerate(cont):
        lp = logprobs[first + i]
        top = mx.argsort(-lp)[:5].tolist()
        steps.append({"token": tok, "logprob": lp[tok].item(),
                      "top": [[t, lp[t].item()] for t in top]})
    print(json.dumps({"steps": steps}), flush=True)
