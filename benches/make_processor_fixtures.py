"""Makes tests/fixtures/processor_goldens.json: golden values for the first-party logits
processors and the mirostat sampler on fixed logits, from implementations other than ours:

* logit_bias, repetition_penalty: mlx-lm 0.32.2's own `make_logits_processors` /
  `make_repetition_penalty` (mlx_lm/sample_utils.py), run here.
* presence/frequency penalties: not here; the test computes OpenAI's published formula itself.
* mirostat v2: a line-by-line transcription of llama.cpp's `llama_sampler_mirostat_v2_apply`
  (src/llama-sampling.cpp, b4000-era): softmax, truncate where -log2(p) > mu (keep >= 1),
  renormalize, then mu -= eta * (-log2(p_chosen) - tau), for a fixed sequence of chosen tokens.
  (llama.cpp itself is not installable here without a C++ build; this transcription is the
  reference until a fixture made with llama.cpp replaces it.)

Run: $MLXHOST_CACHE/venv-mlx-lm-0.32.2/bin/python benches/make_processor_fixtures.py > tests/fixtures/processor_goldens.json
"""
import json
import math

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


def mirostat_v2(logits, chosen, tau, eta, temperature):
    """llama.cpp llama_sampler_mirostat_v2_apply, per step, with the temperature sampler before it."""
    mu = 2.0 * tau
    steps = []
    for token in chosen:
        scaled = [x / temperature for x in logits]
        m = max(scaled)
        z = sum(math.exp(x - m) for x in scaled)
        p = [math.exp(x - m) / z for x in scaled]
        order = sorted(range(len(p)), key=lambda i: -p[i])
        kept = [i for i in order if not (-math.log2(p[i]) > mu)]
        # llama.cpp: find_if over the sorted list stops at the first token over mu.
        cut = next((n for n, i in enumerate(order) if -math.log2(p[i]) > mu), len(order))
        kept = order[:max(cut, 1)]
        mass = sum(p[i] for i in kept)
        assert token in kept, (token, kept)
        p_chosen = p[token] / mass
        steps.append({"mu_before": mu, "kept": sorted(kept), "token": token, "p_chosen": p_chosen})
        mu = mu - eta * (-math.log2(p_chosen) - tau)
    return steps


mirostat = []
for tau, eta, temp, chosen in [(5.0, 0.1, 1.0, [11, 0, 8, 2, 11, 14, 7]), (2.0, 0.5, 0.7, [11, 0, 11, 11, 0, 2]),
                               (3.0, 1.0, 1.0, [0, 11, 2, 11, 0, 11])]:
    mirostat.append({"tau": tau, "eta": eta, "temperature": temp, "steps": mirostat_v2(logits, chosen, tau, eta, temp)})

print(json.dumps({
    "how": "mlx-lm %s make_logits_processors / make_repetition_penalty on the logits below; mirostat: transcription of llama.cpp's llama_sampler_mirostat_v2_apply (see benches/make_processor_fixtures.py)" % mlx_lm.__version__,
    "logits": logits,
    "prompt": prompt,
    "generated": generated,
    "cases": cases,
    "mirostat": mirostat,
}, indent=1))
