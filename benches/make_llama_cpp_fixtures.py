"""Makes tests/fixtures/llama_cpp_goldens.json: golden values for the first-party `dry` and
`mirostat` plugins from llama.cpp itself (llama-cpp-python 0.3.16, which vendors llama.cpp's
src/llama-sampling.cpp), on SmolLM2's vocabulary (the GGUF installed by scripts/setup.sh, loaded
vocab-only).

* DRY: `llama_sampler_init_dry(vocab, n_ctx_train, multiplier, base, allowed_length,
  penalty_last_n, breakers)`; the history is fed with `llama_sampler_accept`, then the sampler is
  applied to all-zero logits over the whole vocabulary, so each changed logit is minus its
  penalty.
* Mirostat v2: a chain of `llama_sampler_init_temp(t)` and `llama_sampler_init_mirostat_v2(seed,
  tau, eta)` applied step by step to fixed logits; recorded per step: the tokens kept after the
  truncation, the token llama.cpp drew, and its probability.

Run (llama-cpp-python builds llama.cpp from source, ~10 minutes on 2 cores):
  python3 -m venv /tmp/llamacpp-venv
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BLAS=OFF -DLLAMA_CURL=OFF" /tmp/llamacpp-venv/bin/pip install llama-cpp-python==0.3.16
  /tmp/llamacpp-venv/bin/python benches/make_llama_cpp_fixtures.py GGUF > tests/fixtures/llama_cpp_goldens.json
"""
import ctypes
import json
import sys

import llama_cpp as L

path = sys.argv[1]
L.llama_backend_init()
mp = L.llama_model_default_params()
mp.vocab_only = True
model = L.llama_model_load_from_file(path.encode(), mp)
vocab = L.llama_model_get_vocab(model)
n_vocab = L.llama_vocab_n_tokens(vocab)
# vocab-only loads report no training context; SmolLM2-135M-Instruct has 8192.
n_ctx_train = L.llama_model_n_ctx_train(model) or 8192


def tokenize(text):
    buf = (L.llama_token * 4096)()
    n = L.llama_tokenize(vocab, text.encode(), len(text.encode()), buf, 4096, False, False)
    return list(buf[:n])


def apply(smpl, logits, ids=None):
    ids = ids if ids is not None else range(len(logits))
    data = (L.llama_token_data * len(logits))()
    for i, (tid, x) in enumerate(zip(ids, logits)):
        data[i].id, data[i].logit, data[i].p = tid, x, 0.0
    arr = L.llama_token_data_array(data=data, size=len(logits), selected=-1, sorted=False)
    L.llama_sampler_apply(smpl, ctypes.byref(arr))
    return arr, data


dry_cases = []
texts = [
    "The cat sat on the mat. The cat sat on the mat. The cat sat on",
    "one two three four one two three four one two three",
    "alpha beta gamma delta\nalpha beta gamma delta alpha beta",
    "x: a b c d e f g a b c d e f g a b c",
    "red green blue red green blue \"red green blue red green",
]
params = [
    dict(multiplier=0.8, base=1.75, allowed_length=2, penalty_last_n=-1, breakers=["\n", ":", "\"", "*"]),
    dict(multiplier=1.5, base=2.0, allowed_length=3, penalty_last_n=16, breakers=["\n", ":", "\"", "*"]),
    dict(multiplier=0.5, base=1.1, allowed_length=1, penalty_last_n=-1, breakers=[]),
]
for text in texts:
    history = tokenize(text)
    for p in params:
        brk = (ctypes.c_char_p * max(1, len(p["breakers"])))(*[b.encode() for b in p["breakers"]])
        smpl = L.llama_sampler_init_dry(vocab, n_ctx_train, p["multiplier"], p["base"], p["allowed_length"],
                                        p["penalty_last_n"], brk, len(p["breakers"]))
        for t in history:
            L.llama_sampler_accept(smpl, t)
        arr, data = apply(smpl, [0.0] * n_vocab)
        penalties = {int(data[i].id): -float(data[i].logit) for i in range(arr.size) if data[i].logit != 0.0}
        dry_cases.append({"text": text, "history": history, "params": p,
                          "penalties": sorted([k, v] for k, v in penalties.items())})
        L.llama_sampler_free(smpl)

logits = [2.0, -1.5, 1.4, 0.3, -0.2, -1.0, -3.0, 0.9, 1.45, -0.5, 0.0, 2.1, 0.7, -2.2, 1.1, 0.05]
mirostat = []
for tau, eta, temp, seed in [(5.0, 0.1, 1.0, 1), (2.0, 0.5, 0.7, 2), (3.0, 1.0, 1.0, 3), (1.0, 0.3, 1.2, 4)]:
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(temp))
    L.llama_sampler_chain_add(chain, L.llama_sampler_init_mirostat_v2(seed, tau, eta))
    steps = []
    for _ in range(12):
        arr, data = apply(chain, logits)
        kept = sorted(int(data[i].id) for i in range(arr.size))
        sel = int(data[arr.selected].id)
        steps.append({"kept": kept, "token": sel, "p_chosen": float(data[arr.selected].p)})
        L.llama_sampler_accept(chain, sel)
    mirostat.append({"tau": tau, "eta": eta, "temperature": temp, "steps": steps})
    L.llama_sampler_free(chain)

print(json.dumps({
    "how": "llama-cpp-python 0.3.16 (vendored llama.cpp) on %s, vocab-only; see benches/make_llama_cpp_fixtures.py" % path.rsplit("/", 1)[-1],
    "n_vocab": n_vocab,
    "dry": dry_cases,
    "mirostat_logits": logits,
    "mirostat": mirostat,
}, indent=1))
