"""Structured output's cost per decode step over HTTP: B concurrent streamed chat requests under
a JSON Schema (`response_format`) against B without one, rounds interleaved (constrained,
free, constrained, ...) so machine noise hits both alike. Per request: decode time per token,
(last content chunk - first) / (completion_tokens - 1), from `stream_options.include_usage`; at
batch B every row of a round shares every step, so this is the step's time. Prints one JSON line
per (batch, kind) with the median, and the ratio constrained / free. Beside it, the engine's own
step timing from `/stats` (`batch.by_batch_size`, differenced around each round): mean step time
and the plugin share of it (the constrained rows' mask calls and their application count there),
which a busy machine disturbs less than end-to-end times, with the step's forward graph (building
and launching) and its evaluation (waiting for the device, reading back) beside it.

Usage: python benches/structured_output.py URL   (env: BATCHES="1 8", ROUNDS=3, MAX_TOKENS=160)
Standard library only; the server is any `mlxhost serve` with the `grammar` plugin loaded.
"""
import json
import os
import urllib.request
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


def step_stats(url, batch):
    """(steps, total step ms, total plugin ms, steps with decode lookahead, total forward graph
    ms, total eval ms) the engine ran at `batch` rows so far."""
    with urllib.request.urlopen(url + "/stats") as r:
        sizes = json.load(r)["batch"]["by_batch_size"]
    for s in sizes:
        if s["rows"] == batch:
            n = s["steps"]
            return (n, s["step_ms"] * n, s["plugin_ms"] * n, s.get("lookahead_steps", 0),
                    s.get("forward_graph_ms", 0.0) * n, s.get("eval_ms", 0.0) * n)
    return 0, 0.0, 0.0, 0, 0.0, 0.0


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
        engine = {True: [0, 0.0, 0.0, 0, 0.0, 0.0], False: [0, 0.0, 0.0, 0, 0.0, 0.0]}
        for _ in range(ROUNDS):
            for constrained in (True, False):
                before = step_stats(url, batch)
                times[constrained] += round_(url, batch, constrained, n)
                after = step_stats(url, batch)
                for i in range(6):
                    engine[constrained][i] += after[i] - before[i]
                n += batch
        med = {k: statistics.median(v) for k, v in times.items()}
        step = {k: e[1] / max(e[0], 1) for k, e in engine.items()}
        for k in (True, False):
            steps, total, plugin, ahead, forward, evaluate = engine[k]
            print(json.dumps({"batch": batch, "constrained": k, "requests": len(times[k]),
                              "ms_per_token_median": round(med[k], 3),
                              "engine_steps": steps, "engine_step_ms_mean": round(step[k], 3),
                              "engine_plugin_ms_mean": round(plugin / max(steps, 1), 3),
                              "engine_forward_graph_ms_mean": round(forward / max(steps, 1), 3),
                              "engine_eval_ms_mean": round(evaluate / max(steps, 1), 3),
                              "engine_lookahead_steps": ahead}))
        print(json.dumps({"batch": batch,
                          "ratio_constrained_over_free": round(med[True] / med[False], 3),
                          "engine_step_ratio": round(step[True] / step[False], 3)}))


if __name__ == "__main__":
    main()
