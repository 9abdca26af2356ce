#!/usr/bin/env python3
"""Runs an mlx-lm 0.32.2 command-line module (`benchmark`, `server`, `generate`, ...) with the
`gather_qmm` shim applied first (benches/tiny_fixture.py `patch_gather_qmm`): mlx-lm 0.32.2's
quantized mixture-of-experts layers pass a keyword MLX 0.32.2 lacks, so without the shim
`mlx_lm.benchmark` on a Qwen3-MoE or gpt-oss checkpoint stops with a TypeError. Dense models run
exactly as `python3 -m mlx_lm.NAME` would.

    python3 benches/mlx_lm_run.py benchmark --model DIR --batch-size 1 ...
"""
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_fixture import patch_gather_qmm  # noqa: E402

if len(sys.argv) < 2:
    sys.exit("usage: mlx_lm_run.py MODULE [ARGS...] (MODULE: benchmark, server, generate, ...)")
patch_gather_qmm()
module = sys.argv[1]
sys.argv = [f"mlx_lm.{module}"] + sys.argv[2:]
runpy.run_module(f"mlx_lm.{module}", run_name="__main__", alter_sys=True)
