"""Teacher-forced scores from mlx-lm 0.32.2 run entirely in float32, in `mlxhost score`'s output
format, to compare against `mlxhost score --dtype float32` on the same MLX model directory.

mlx-lm loads the directory as usual (its own model code, e.g. mlx_lm/models/gemma3_text.py); then
every nn.QuantizedLinear / nn.QuantizedEmbedding is replaced by a dense nn.Linear / nn.Embedding
whose weight is mx.dequantize(...) in float32, and every other parameter is cast to float32, so
the whole forward pass (activations included) runs in float32 and differences against mlxhost's
float32 path come from the model code, not from quantized kernels or float16 rounding.

Each row is teacher-forced in ONE forward pass over prompt + continuation, with a fresh cache from
mlx_lm.models.cache.make_prompt_cache(model) (so the model builds its own masks, e.g. Gemma 3's
sliding-window mask). log_softmax in float32 at positions len(prompt)-1 .. len-2 scores each
continuation token; only those rows go through the LM head (ScoredRows), which is what makes a
long prompt affordable on the CPU backend.

Only the weights and config are loaded (mlx_lm.utils.load_model): no tokenizer is needed, and
mlx_lm.load's tokenizer step (transformers' AutoConfig validation) is not exercised here.

Input: JSON lines `{"prompt_ids": [...], "continuation_ids": [...]}` on stdin. Output: one line
per input, `{"steps": [{"token": id, "logprob": x, "top": [[id, x], ...5]}]}` (natural log).

Usage (venv with mlx-lm==0.32.2 and mlx[cpu]==0.32.2, e.g. ~/.cache/mlxhost/venv-mlx-lm-0.32.2):
    $VENV/bin/python benches/mlx_lm_score_f32.py MODEL_DIR < in.jsonl > out.jsonl
"""
import json
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model


def dequantized(q):
    """The float32 dense weight of a quantized layer: scales and biases are cast to float32 first,
    since mx.dequantize returns the scales' dtype (float16 scales would round every weight)."""
    biases = q.get("biases")
    if biases is not None:
        biases = biases.astype(mx.float32)
    return mx.dequantize(q.weight, q.scales.astype(mx.float32), biases,
                         group_size=q.group_size, bits=q.bits, mode=q.mode)


def to_float32(model):
    """Replace quantized layers by dense float32 ones, cast all other parameters to float32."""
    swaps = []
    for name, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            w = dequantized(m)
            dense = nn.Linear(w.shape[1], w.shape[0], bias="bias" in m)
            dense.weight = w
            if "bias" in m:
                dense.bias = m.bias.astype(mx.float32)
            swaps.append((name, dense))
        elif isinstance(m, nn.QuantizedEmbedding):
            w = dequantized(m)
            dense = nn.Embedding(w.shape[0], w.shape[1])
            dense.weight = w
            swaps.append((name, dense))
    model.update_modules(tree_unflatten(swaps))
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    left = [k for k, v in tree_flatten(model.parameters()) if v.dtype != mx.float32]
    assert not left, f"non-float32 parameters left: {left[:5]}"
    mx.eval(model.parameters())
    return model


class ScoredRows(nn.Module):
    """Wraps the backbone's final norm so that only the rows being scored go on to the LM head
    (the head is a 262144-wide float32 matmul, by far the slowest op on mlx's CPU backend). The
    rows are computed exactly as before; the head and anything after it just see fewer of them."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm
        self.rows = slice(None)

    def __call__(self, x):
        return self.norm(x)[:, self.rows]


def main():
    model, _ = load_model(Path(sys.argv[1]))
    to_float32(model)
    rows = ScoredRows(model.model.norm)
    model.model.norm = rows
    for line in sys.stdin:
        if not line.strip():
            continue
        row = json.loads(line)
        prompt, cont = row["prompt_ids"], row["continuation_ids"]
        ids = mx.array([prompt + cont])
        rows.rows = slice(len(prompt) - 1, len(prompt) + len(cont) - 1)
        logits = model(ids, cache=make_prompt_cache(model))[0]
        assert logits.dtype == mx.float32, logits.dtype
        assert logits.shape[0] == len(cont), logits.shape
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(logprobs)
        steps = []
        for i, tok in enumerate(cont):
            lp = logprobs[i]
            top = mx.argsort(-lp)[:5].tolist()
            steps.append({"token": tok, "logprob": lp[tok].item(),
                          "top": [[t, lp[t].item()] for t in top]})
        print(json.dumps({"steps": steps}), flush=True)


if __name__ == "__main__":
    main()
