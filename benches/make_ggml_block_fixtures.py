"""Makes tests/fixtures/ggml_blocks.json: reference dequantizations of random GGUF blocks of every
tensor type mlxhost reads, computed by gguf-py (ggml's own Python package, `gguf==0.19.0`, whose
`gguf.quants.dequantize` mirrors ggml-quants.c `dequantize_row_*`).

Each case: the ggml type name and id, the raw blocks as hex, and the expected float32 values as
the hex of their little-endian bytes (compared bit for bit). The float16 fields of each block (its
scales `d`, `dmin`, `m`) are set to finite values in [-1/8, 1/8] so every value is finite.

Run:
  python3 -m venv /tmp/gguf-venv && /tmp/gguf-venv/bin/pip install gguf==0.19.0
  /tmp/gguf-venv/bin/python benches/make_ggml_block_fixtures.py > tests/fixtures/ggml_blocks.json
"""
import json

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

rng = np.random.default_rng(20261202)

# Byte offsets of the float16 fields in one block (ggml-common.h block layouts).
F16_FIELDS = {
    T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2], T.Q8_0: [0],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}

cases = []
for qtype in [T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
              T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]:
    block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
    n_blocks = 3 if block_elems == 32 else 2
    if qtype == T.F32:
        raw = rng.standard_normal(64).astype("<f4").view(np.uint8)
    elif qtype == T.F16:
        raw = rng.standard_normal(64).astype("<f2").view(np.uint8)
    elif qtype == T.BF16:
        raw = (rng.standard_normal(64).astype("<f4").view("<u4") >> 16).astype("<u2").view(np.uint8)
    else:
        raw = rng.integers(0, 256, size=n_blocks * block_bytes, dtype=np.uint8)
        for b in range(n_blocks):
            for off in F16_FIELDS[qtype]:
                v = np.array([rng.uniform(-0.125, 0.125)], dtype="<f2").view(np.uint8)
                raw[b * block_bytes + off: b * block_bytes + off + 2] = v
    values = quants.dequantize(raw, qtype).astype("<f4").reshape(-1)
    cases.append({
        "type": qtype.name,
        "id": int(qtype),
        "blocks": raw.tobytes().hex(),
        "values": values.tobytes().hex(),
    })

print(json.dumps({"source": "gguf-py 0.19.0 gguf.quants.dequantize", "cases": cases}, indent=1))
