"""Makes host/tests/fixtures/mlx_lm_filters.json: mlx-lm 0.32.2's own
sample_utils filters (apply_top_p, apply_min_p, apply_top_k) applied to fixed
log-probabilities, as golden values for the host's device ops.

Run: $MLXHOST_CACHE/venv-mlx-lm-0.32.2/bin/python benches/make_sampling_fixtures.py > host/tests/fixtures/mlx_lm_filters.json
"""
import json
import math

import mlx.core as mx
import mlx_lm
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

logits = [2.0, 1.5, 1.4, 0.3, -0.2, -1.0, -3.0, 0.9, 1.45, -0.5, 0.0, 2.1]
x = mx.array(logits)
lp = x - mx.logsumexp(x)
cases = []
def finite(a):
    return [v if math.isfinite(v) else None for v in a.tolist()]
for p in [0.3, 0.5, 0.9, 0.95]:
    cases.append({"op": "top_p", "arg": p, "kept": finite(apply_top_p(lp[None], p)[0])})
for p in [0.05, 0.2, 0.5]:
    cases.append({"op": "min_p", "arg": p, "kept": finite(apply_min_p(lp[None], p)[0])})
for k in [1, 3, 5]:
    cases.append({"op": "top_k", "arg": k, "kept": finite(apply_top_k(lp[None], k)[0])})
print(json.dumps({
    "how": "mlx-lm %s sample_utils applied to log_softmax(logits); null = removed (-inf)" % mlx_lm.__version__,
    "logits": logits,
    "logprobs": lp.tolist(),
    "cases": cases,
}, indent=1))
