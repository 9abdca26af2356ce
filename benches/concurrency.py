"""Concurrency benchmark client for benches/batching.sh: at each concurrency level C, C streamed
OpenAI Chat Completions are sent at once to one server, then the same to the next server (levels
and servers interleaved: C=1 on A, C=1 on B, C=2 on A, ...), so machine noise hits all alike.
Every prompt starts with a unique request number, so no server reuses a cached prefix.

Per level and server: aggregate completion tok/s (all completion tokens / wall time from the first
send to the last byte), per-request decode tok/s ((completion_tokens - 1) / (last content chunk -
first content chunk)), TTFT (send -> first content chunk) median and p95, and, for mlxhost, the
plugin share of a step at each batch size from its /stats. Standard library only.

Usage: python concurrency.py NAME=URL [NAME=URL ...]
Env: LEVELS (default "1 2 4 8 16"), MAX_TOKENS (64), ROUNDS (rounds per level, 1), TEMPERATURE
(0: greedy), TOP_P (1.0), SEED (per-request seed base, sent only when TEMPERATURE > 0), WARMUP
(1: one unmeasured round of every level on every server first; on a GPU a server that meets a
batch size for the first time compiles kernels for it, which mlx_lm.server does not do before it
is ready: its first round at C=4 or C=8 stalled for 6-9 s in some H200 runs and not in others).
Prints one JSON line per (server, level), then a table and the ratios of the first server.
"""
import json
import os
import statistics
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
from http_bench import STORY, stream_chat  # noqa: E402

LEVELS = [int(x) for x in os.environ.get("LEVELS", "1 2 4 8 16").split()]
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "64"))
ROUNDS = int(os.environ.get("ROUNDS", "1"))
TEMPERATURE = float(os.environ.get("TEMPERATURE", "0"))
TOP_P = float(os.environ.get("TOP_P", "1.0"))
SEED = int(os.environ.get("SEED", "1"))
WARMUP = os.environ.get("WARMUP", "0") == "1"
TOPICS = ["a lighthouse keeper", "a baker", "a sailor", "a clockmaker", "a gardener", "a pilot",
          "a librarian", "a blacksmith"]
counter = [0]


def body(i):
    counter[0] += 1
    b = {
        "model": "default_model",
        "messages": [{"role": "user", "content": f"Request {counter[0]}. Write a short story about "
                      f"{TOPICS[i % len(TOPICS)]}."}],
        "max_tokens": MAX_TOKENS,
        "temperature": TEMPERATURE,
        "top_p": TOP_P,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # Seeds only for sampled runs: mlx_lm.server batches only requests whose sampling settings
    # agree, and a per-request seed made it serve them one at a time (measured).
    if TEMPERATURE > 0:
        b["seed"] = SEED + counter[0]
    return b


def p95(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def level(url, c):
    bodies = [body(i) for i in range(c)]
    out = [None] * c
    t0 = time.perf_counter()

    errors = []

    def run(i):
        s = time.perf_counter()
        try:
            first, last, usage, chunks = stream_chat(url, bodies[i])
        except Exception as e:  # a peer that drops connections under load: counted, not fatal
            errors.append(repr(e))
            return
        out[i] = (s - t0, first, last, usage["completion_tokens"] if usage else chunks)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        print(f"# {url}: {len(errors)} of {c} requests failed at concurrency {c}: {errors[0]}",
              file=sys.stderr)
    out = [o for o in out if o is not None]
    tokens = sum(o[3] for o in out)
    ttfts = [o[1] for o in out if o[1] is not None]
    decodes = [(o[3] - 1) / (o[2] - o[1]) for o in out if o[1] is not None and o[2] > o[1]]
    return {"tokens": tokens, "wall_s": wall, "ttfts": ttfts, "decodes": decodes, "failed": len(errors)}


def plugin_share(url):
    try:
        with urllib.request.urlopen(url + "/stats", timeout=10) as r:
            return json.load(r).get("batch", {}).get("by_batch_size")
    except Exception:
        return None


def main():
    servers = [a.split("=", 1) for a in sys.argv[1:]]
    for _, url in servers:  # one warm-up request each (first-use costs)
        stream_chat(url, body(0))
    if WARMUP:
        for c in LEVELS:
            for _, url in servers:
                level(url, c)
    rows = []
    for c in LEVELS:
        for name, url in servers:
            runs = [level(url, c) for _ in range(ROUNDS)]
            tokens = sum(r["tokens"] for r in runs)
            wall = sum(r["wall_s"] for r in runs)
            ttfts = [x for r in runs for x in r["ttfts"]]
            decodes = [x for r in runs for x in r["decodes"]]
            row = {
                "server": name, "concurrency": c, "aggregate_tok_s": tokens / wall,
                "decode_tok_s_median": statistics.median(decodes) if decodes else float("nan"),
                "ttft_s_median": statistics.median(ttfts), "ttft_s_p95": p95(ttfts),
                "completion_tokens": tokens, "failed_requests": sum(r["failed"] for r in runs),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            print(f"# {name:16} C={c:<3} aggregate {row['aggregate_tok_s']:7.2f} tok/s, per request "
                  f"{row['decode_tok_s_median']:6.2f} tok/s, TTFT {row['ttft_s_median']:.2f} s "
                  f"(p95 {row['ttft_s_p95']:.2f})", file=sys.stderr, flush=True)
    print(f"\n{'server':16} {'C':>3} {'aggregate tok/s':>16} {'per-request tok/s':>18} {'TTFT med s':>11} {'TTFT p95 s':>11}")
    for r in rows:
        print(f"{r['server']:16} {r['concurrency']:>3} {r['aggregate_tok_s']:>16.2f} "
              f"{r['decode_tok_s_median']:>18.2f} {r['ttft_s_median']:>11.2f} {r['ttft_s_p95']:>11.2f}")
    base = servers[0][0]
    by = {(r["server"], r["concurrency"]): r for r in rows}
    for c in LEVELS:
        for name, _ in servers[1:]:
            a, b = by[(base, c)], by[(name, c)]
            print(f"C={c}: {base} aggregate {a['aggregate_tok_s'] / b['aggregate_tok_s']:.2f}x {name}'s")
        if LEVELS[0] == 1:
            print(f"C={c}: {base} aggregate {by[(base, c)]['aggregate_tok_s'] / by[(base, 1)]['aggregate_tok_s']:.2f}x "
                  f"its own C=1")
    share = plugin_share(servers[0][1])
    if share:
        print(f"\n{base} step time by rows in the step (from /stats):")
        for b in share:
            print(f"  rows {b['rows']:>3}: {b['steps']:>6} steps, {b['step_ms']:8.2f} ms/step, plugins "
                  f"{b['plugin_ms']:6.2f} ms ({100 * b['plugin_share']:.1f}%), forward graph "
                  f"{b.get('forward_graph_ms', float('nan')):6.2f} ms, eval {b.get('eval_ms', float('nan')):6.2f} ms")


if __name__ == "__main__":
    main()
