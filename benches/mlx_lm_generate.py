"""mlx-lm's side of benches/generate.sh: greedy generation tok/s through
mlx-lm's own `stream_generate` (its sampler, its detokenizer) on an MLX model
directory, with the same chat prompt. Prints one JSON line.

Usage: python mlx_lm_generate.py MODEL_DIR MAX_TOKENS [float32]
"""
import json
import sys

from mlx_lm import load, stream_generate
from mlx_lm.sample_utils import make_sampler

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from mlx_lm_forward import dequantize_to_float32  # noqa: E402


def main():
    path, max_tokens = sys.argv[1], int(sys.argv[2])
    float32 = len(sys.argv) > 3 and sys.argv[3] == "float32"
    model, tok = load(path)
    if float32:
        dequantize_to_float32(model)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
        add_generation_prompt=True,
    )
    last = None
    for last in stream_generate(model, tok, prompt, max_tokens=max_tokens, sampler=make_sampler(0.0)):
        pass
    print(json.dumps({
        "engine": "mlx-lm",
        "compute": "float32" if float32 else "native",
        "prompt_tokens": last.prompt_tokens,
        "prompt_tok_s": last.prompt_tps,
        "generation_tokens": last.generation_tokens,
        "generation_tok_s": last.generation_tps,
    }))


if __name__ == "__main__":
    main()
