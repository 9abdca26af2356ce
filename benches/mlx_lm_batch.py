"""mlx-lm's batched generation (`BatchGenerator`, the engine behind `batch_generate` and
mlx_lm.server's continuous batching) on an MLX model directory: C prompts of P tokens generated
together for N tokens each, greedy, no stop tokens (random weights would stop anywhere). Prints
one JSON line with mlx-lm's own prompt and generation tok/s, to compare with `mlxhost bench
--batch C` on the same files.

Usage: python mlx_lm_batch.py MODEL_DIR CONCURRENCY PROMPT_TOKENS MAX_TOKENS
"""
import json
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import BatchGenerator


def main():
    path, c, n_prompt, n_gen = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    model, _ = load(path)
    args = model.args
    vocab = getattr(args, "vocab_size", None) or args.text_config["vocab_size"]
    prompts = [[(i * 7919 + 13 + 31 * r) % vocab for i in range(n_prompt)] for r in range(c)]
    gen = BatchGenerator(model, stop_tokens=[])
    gen.insert(prompts, [n_gen] * c)
    with gen.stats() as stats:
        while gen.next_generated():
            pass
    gen.close()
    print(json.dumps({
        "engine": "mlx-lm", "mlx": mx.__version__, "model": path, "concurrency": c,
        "prompt_tokens": n_prompt, "max_tokens": n_gen,
        "prompt_tok_s": stats.prompt_tps, "generation_tok_s": stats.generation_tps,
    }))


if __name__ == "__main__":
    main()
