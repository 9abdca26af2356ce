"""Batch-1 decode over HTTP, servers side by side: C=1 streamed requests going round the servers
(A, B, C, ... then the order rotated by one each round), so a machine whose speed drifts over
seconds to minutes (the one-row step of a small model on a GPU is bound by the host CPU;
docs/benchmarks.md, "Run 11") moves all of them alike. Per request: decode tok/s ((tokens - 1)
/ (last chunk - first chunk), as benches/stream_gaps.py), TTFT; per round the ratio of every
server's decode tok/s to every later server's. Every prompt starts with a unique number (no
cached prefix).

Usage: python3 interleaved.py NAME=URL NAME=URL [NAME=URL ...] [ROUNDS]
       (env: MAX_TOKENS, default 128; WARMUP, default 2 requests each)
Prints one JSON line per request, then a summary: medians per server, and per pair A/B (A
listed before B) the median, min and max of the round ratios and how many rounds A was faster.
Standard library only.
"""
import json
import os
import statistics
import sys

from stream_gaps import one


def main():
    args = sys.argv[1:]
    rounds = int(args.pop()) if args and args[-1].isdigit() else 12
    servers = [tuple(a.split("=", 1)) for a in args]
    if len(servers) < 2 or any(len(s) != 2 for s in servers):
        raise SystemExit(__doc__)
    warmup = int(os.environ.get("WARMUP", "2"))
    counter = 3000
    for _ in range(warmup):
        for _, url in servers:
            one(url.rstrip("/"), counter)
            counter += 1
    names = [name for name, _ in servers]
    rates = {name: [] for name in names}
    # Per round, every server's rate over every later one's.
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1:]]
    ratios = {pair: [] for pair in pairs}
    for r in range(rounds):
        shift = r % len(servers)
        got = {}
        for name, url in servers[shift:] + servers[:shift]:
            row = one(url.rstrip("/"), counter)
            counter += 1
            row.update(server=name, round=r)
            print(json.dumps(row), flush=True)
            got[name] = row["decode_tok_s"]
            rates[name].append(row["decode_tok_s"])
        for a, b in pairs:
            ratios[(a, b)].append(got[a] / got[b])
    print(json.dumps({
        "rounds": rounds,
        "decode_tok_s_median": {n: statistics.median(v) for n, v in rates.items()},
        "decode_tok_s_range": {n: [min(v), max(v)] for n, v in rates.items()},
        "round_ratios": {f"{a}/{b}": {"median": round(statistics.median(v), 3),
                                      "min": round(min(v), 3), "max": round(max(v), 3),
                                      "rounds_above_1": sum(x > 1 for x in v)}
                         for (a, b), v in ratios.items()},
    }), flush=True)


if __name__ == "__main__":
    main()
