"""mlx-lm's side of benches/model_forward.sh: prefill tok/s and per-token
decode forward time for an MLX model directory, measured the way
`mlxhost bench` measures ours (same prompt ids, argmax fed back, each step
evaluated). Prints one JSON line.

Usage: python mlx_lm_forward.py MODEL_DIR PROMPT_TOKENS DECODE_TOKENS REPEATS [float32]
"""
import json
import statistics
import sys
import time

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache


def dequantize_to_float32(model):
    """mlx-lm's model with every quantized layer replaced by a float32 dense one."""
    import mlx.nn as nn

    def swap(module):
        for name, child in module.children().items():
            if isinstance(child, nn.QuantizedEmbedding):
                w = mx.dequantize(child.weight, child.scales, child.biases, child.group_size, child.bits)
                emb = nn.Embedding(w.shape[0], w.shape[1])
                emb.weight = w.astype(mx.float32)
                setattr(module, name, emb)
            elif isinstance(child, nn.QuantizedLinear):
                w = mx.dequantize(child.weight, child.scales, child.biases, child.group_size, child.bits)
                lin = nn.Linear(w.shape[1], w.shape[0], bias=False)
                lin.weight = w.astype(mx.float32)
                setattr(module, name, lin)
            elif isinstance(child, nn.Module):
                swap(child)
            elif isinstance(child, list):
                for c in child:
                    if isinstance(c, nn.Module):
                        swap(c)

    swap(model)
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    mx.eval(model.parameters())


def main():
    path, n_prompt, n_decode, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    float32 = len(sys.argv) > 5 and sys.argv[5] == "float32"
    model, _ = load(path)
    if float32:
        dequantize_to_float32(model)
    args = model.args
    # A multimodal wrapper (qwen3_5) keeps the decoder's fields in `text_config`.
    vocab = getattr(args, "vocab_size", None) or args.text_config["vocab_size"]
    prompt = mx.array([(i * 7919 + 13) % vocab for i in range(n_prompt)])[None]

    times = []
    for _ in range(max(repeats, 1)):
        cache = make_prompt_cache(model)
        t = time.perf_counter()
        logits = model(prompt, cache=cache)[:, -1, :]
        mx.eval(logits, [c.state for c in cache])
        times.append(time.perf_counter() - t)
    prefill_s = statistics.median(times)

    cache = make_prompt_cache(model)
    logits = model(prompt, cache=cache)[:, -1, :]
    nxt = mx.argmax(logits, axis=-1)
    mx.eval(nxt)
    steps = []
    for step in range(n_decode + 3):
        t = time.perf_counter()
        logits = model(nxt[:, None], cache=cache)[:, -1, :]
        nxt = mx.argmax(logits, axis=-1)
        mx.eval(nxt, [c.state for c in cache])
        if step >= 3:
            steps.append(time.perf_counter() - t)
    decode_ms = statistics.median(steps) * 1e3
    print(json.dumps({
        "engine": "mlx-lm",
        "compute": "float32" if float32 else "native",
        "mlx": mx.__version__,
        "model": path,
        "prompt_tokens": n_prompt,
        "prefill_tok_s": n_prompt / prefill_s,
        "decode_ms_per_token": decode_ms,
        "decode_tok_s": 1e3 / decode_ms,
    }))


if __name__ == "__main__":
    main()
