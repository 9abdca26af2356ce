"""llama.cpp (llama-cpp-python 0.3.16) measured the way `mlxhost bench` measures: prefill of a
PROMPT_TOKENS-token prompt (median of REPEATS) and the median time of one decode step after 3
warm-up steps, on the same GGUF, with the same deterministic prompt ids
((i * 7919 + 13) % vocab). Threads: every core (as mlxhost's kernel pool). Prints one JSON line
with peak RSS.

  python benches/llama_cpp_bench.py GGUF [PROMPT_TOKENS=256] [DECODE_TOKENS=64] [REPEATS=3]
"""
import json
import os
import resource
import statistics
import sys
import time

import llama_cpp as L

path = sys.argv[1]
prompt_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 256
decode_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
repeats = int(sys.argv[4]) if len(sys.argv) > 4 else 3
threads = os.cpu_count() or 1

# LLAMA_KV_TYPE=q8_0: llama.cpp's quantized KV cache (-ctk q8_0 -ctv q8_0; a quantized V cache
# needs flash attention). Unset: its default f16 cache.
kv_type = os.environ.get("LLAMA_KV_TYPE", "f16")
kv_args = {"type_k": 8, "type_v": 8, "flash_attn": True} if kv_type == "q8_0" else {}
llm = L.Llama(
    **kv_args,
    model_path=path,
    n_ctx=prompt_tokens + decode_tokens + 16,
    n_batch=512,
    n_threads=threads,
    n_threads_batch=threads,
    logits_all=False,
    verbose=False,
)
vocab = llm.n_vocab()
prompt = [(i * 7919 + 13) % vocab for i in range(prompt_tokens)]

prefill = []
for _ in range(max(1, repeats)):
    llm.reset()
    llm._ctx.kv_cache_clear()
    started = time.perf_counter()
    llm.eval(prompt)
    prefill.append(time.perf_counter() - started)

# Decode steps feed the same kind of ids as the prompt (choosing them greedily in Python would
# time Python's argmax over the vocabulary, not llama.cpp); each step is one llama_decode.
steps = []
for step in range(decode_tokens + 3):
    token = ((prompt_tokens + step) * 7919 + 13) % vocab
    started = time.perf_counter()
    llm.eval([token])
    elapsed = time.perf_counter() - started
    if step >= 3:
        steps.append(elapsed)

decode_ms = statistics.median(steps) * 1e3
print(json.dumps({
    "engine": "llama.cpp",
    "compute": "gguf",
    "kv": kv_type,
    "model": path,
    "threads": threads,
    "prompt_tokens": prompt_tokens,
    "prefill_tok_s": prompt_tokens / statistics.median(prefill),
    "decode_ms_per_token": decode_ms,
    "decode_tok_s": 1e3 / decode_ms,
    "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
}))
