"""Makes tests/fixtures/processor_goldens.json: golden values for the first-party logits
processors on fixed logits, from implementations other than ours:

* logit_bias, repetition_penalty: mlx-lm 0.32.2's own `make_logits_processors` /
  `make_repetition_penalty` (mlx_lm/sample_utils.py), run here.
* presence/frequency penalties: not here; the test computes OpenAI's published formula itself.
* DRY and mirostat: from llama.cpp itself, benches/make_llama_cpp_fixtures.py.

Run: $MLXHOST_CACHE/venv-mlx-lm-0.32.2/bin/python benches/make_processor_fixtures.py > tests/fixtures/processor_goldens.json
"""
import json
import mlx.core as mx
import mlx_lm
from mlx_lm.sample_utils import make_logits_processors, make_repetition_penalty

logits = [2.0, -1.5, 1.4, 0.3, -0.2, -1.0, -3.0, 0.9, 1.45, -0.5, 0.0, 2.1, 0.7, -2.2, 1.1, 0.05]
prompt = [3, 5, 5, 9, 1]
generated = [1, 7, 7, 7, 12]
history = prompt + generated

cases = []
for penalty, ctx in [(1.3, 20), (1.3, 4), (0.8, 3), (2.0, 1)]:
    proc = make_repetition_penalty(penalty, ctx)
    out = proc(mx.array(history), mx.array(logits)[None])[0]
    cases.append({"plugin": "repetition-penalty", "params": {"repetition_penalty": penalty, "repetition_context_size": ctx},
                  "logits_out": out.tolist()})
bias = {2: 5.0, 6: -100.0, 15: 0.5}
procs = make_logits_processors(logit_bias=bias)
out = mx.array(logits)[None]
for p in procs:
    out = p(mx.array(history), out)
cases.append({"plugin": "logit-bias", "params": {"logit_bias": [[k, v] for k, v in bias.items()]}, "logits_out": out[0].tolist()})


print(json.dumps({
    "how": "mlx-lm %s make_logits_processors / make_repetition_penalty on the logits below" % mlx_lm.__version__,
    "logits": logits,
    "prompt": prompt,
    "generated": generated,
    "cases": cases,
}, indent=1))
