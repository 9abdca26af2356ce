"""Teacher-forced scores from mlx-lm 0.32.2 for an MLX model directory, in `mlxhost score`'s
output format, to compare the two on the same files (benches/model_parity.sh).

Input: JSON lines `{"prompt_ids": [...], "continuation_ids": [...]}` on stdin. Output: one line
per input, `{"steps": [{"token": id, "logprob": x, "top": [[id, x], ...5]}]}`: natural log,
log-softmax of the logits at the position before each token, the model run as mlx-lm loads it
(its native numerics: quantized weights, activations in the checkpoint's float dtype).

Usage: python mlx_lm_score.py MODEL_DIR < in.jsonl > out.jsonl
"""
import json
import sys

import mlx.core as mx
from mlx_lm import load

model, _ = load(sys.argv[1])
for line in sys.stdin:
    if not line.strip():
        continue
    row = json.loads(line)
    prompt, cont = row["prompt_ids"], row["continuation_ids"]
    ids = mx.array([prompt + cont])
    logits = model(ids)[0].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    steps = []
    for i, tok in enumerate(cont):
        lp = logprobs[len(prompt) - 1 + i]
        top = mx.argsort(-lp)[:5].tolist()
        steps.append({"token": tok, "logprob": lp[tok].item(),
                      "top": [[t, lp[t].item()] for t in top]})
    print(json.dumps({"steps": steps}), flush=True)
