"""Structured output's cost per decode step over HTTP: B concurrent streamed chat requests under
a JSON Schema (`response_format`) against B without one, rounds interleaved (constrained,
free, constrained, ...) so machine noise hits both alike. Per request: decode time per token,
(last content chunk - first) / (completion_tokens - 1), from `stream_options.include_usage`; at
batch B every row of a round shares every step, so this is the step's time. Prints one JSON line
per (batch, kind) with the median, and the ratio constrained / free.

Usage: python benches/structured_output.py URL   (env: BATCHES="1 8", ROUNDS=3, MAX_TOKENS=160)
Standard library only; the server is any `mlxhost serve` with the `grammar` plugin loaded.
"""
import json
import os
import statistics
import sys
import threading

sys.path.insert(0, os.path.dirname(__file__))
from http_bench import stream_chat  # noqa: E402

BATCHES = [int(b) for b in os.environ.get("BATCHES", "1 8").split()]
ROUNDS = int(os.environ.get("ROUNDS", "3"))
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "160"))
SCHEMA = {
    "type": "array", "minItems": 12, "maxItems": 12,
    "items": {"type": "object", "additionalProperties": False, "required": ["name", "score"],
              "properties": {"name": {"type": "string", "maxLength": 12},
                             "score": {"type": "integer", "minimum": 0, "maximum": 100}}},
}


def body(i, constrained):
    b = {
        "messages": [{"role": "user", "content":
                      f"Request {i}. List twelve people with a name and a score, as a JSON array."}],
        "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if constrained:
        b["response_format"] = {"type": "json_schema",
                                "json_schema": {"name": "people", "schema": SCHEMA}}
    return b


def round_(url, batch, constrained, first_id):
    """One round of `batch` concurrent requests: per-token decode times, ms."""
    out = [None] * batch

    def one(k):
        ttft, last, usage, _ = stream_chat(url, body(first_id + k, constrained))
        n = usage["completion_tokens"] if usage else 0
        out[k] = (last - ttft) / (n - 1) * 1e3 if n > 1 else None

    threads = [threading.Thread(target=one, args=(k,)) for k in range(batch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [x for x in out if x is not None]


def main():
    url = sys.argv[1]
    n = 0
    round_(url, 1, True, 10**6)  # warm: builds the plugin's engine once
    for batch in BATCHES:
        times = {True: [], False: []}
        for _ in range(ROUNDS):
            for constrained in (True, False):
                times[constrained] += round_(url, batch, constrained, n)
                n += batch
        med = {k: statistics.median(v) for k, v in times.items()}
        for k in (True, False):
            print(json.dumps({"batch": batch, "constrained": k, "requests": len(times[k]),
                              "ms_per_token_median": round(med[k], 3)}))
        print(json.dumps({"batch": batch, "ratio_constrained_over_free": round(med[True] / med[False], 3)}))


if __name__ == "__main__":
    main()
