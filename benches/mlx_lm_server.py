"""Runs mlx-lm's own HTTP server (`mlx_lm.server`, unchanged) for benches/serve.sh.

With `--float32` first, the model is dequantized to float32 right after mlx-lm loads it (the
same transformation benches/mlx_lm_forward.py uses), because MLX's float16 quantized matmul is
~50x slower than float32 on x86 CPUs; everything else is mlx_lm.server as shipped.

Usage: python mlx_lm_server.py [--float32] --model DIR --port N [mlx_lm.server flags]
"""
import sys

import mlx_lm.server as server

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from mlx_lm_forward import dequantize_to_float32  # noqa: E402

if len(sys.argv) > 1 and sys.argv[1] == "--float32":
    del sys.argv[1]
    original_load = server.load

    def load_float32(*args, **kwargs):
        out = original_load(*args, **kwargs)
        dequantize_to_float32(out[0])
        return out

    server.load = load_float32

server.main()
