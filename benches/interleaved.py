"""Batch-1 decode over HTTP, two servers side by side: C=1 streamed requests alternating between
them (A, B, A, B, ...), so a machine whose speed drifts over seconds to minutes (the one-row step
of a small model on a GPU is bound by the host CPU; docs/benchmarks.md, "Run 11") moves both
alike. Per request: decode tok/s ((content chunks - 1) / (last chunk - first chunk), as
benches/stream_gaps.py), TTFT; per pair the ratio A/B of decode tok/s. The order inside a pair
flips every pair. Every prompt starts with a unique number (no cached prefix).

Usage: python3 interleaved.py NAME_A=URL_A NAME_B=URL_B [PAIRS]   (env: MAX_TOKENS, default 128;
WARMUP, default 2 requests each)
Prints one JSON line per request, then a summary: medians per server and the median pair ratio.
Standard library only.
"""
import json
import os
import statistics
import sys

from stream_gaps import one


def main():
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    (a, url_a), (b, url_b) = (arg.split("=", 1) for arg in sys.argv[1:3])
    pairs = int(sys.argv[3]) if len(sys.argv) > 3 else 12
    warmup = int(os.environ.get("WARMUP", "2"))
    counter = 3000
    for _ in range(warmup):
        for url in (url_a, url_b):
            one(url.rstrip("/"), counter)
            counter += 1
    rates = {a: [], b: []}
    ratios = []
    for p in range(pairs):
        order = [(a, url_a), (b, url_b)] if p % 2 == 0 else [(b, url_b), (a, url_a)]
        pair = {}
        for name, url in order:
            row = one(url.rstrip("/"), counter)
            counter += 1
            row.update(server=name, pair=p)
            print(json.dumps(row), flush=True)
            pair[name] = row["decode_tok_s"]
            rates[name].append(row["decode_tok_s"])
        ratios.append(pair[a] / pair[b])
    print(json.dumps({
        "pairs": pairs,
        f"{a}_decode_tok_s_median": statistics.median(rates[a]),
        f"{b}_decode_tok_s_median": statistics.median(rates[b]),
        "pair_ratio_median": round(statistics.median(ratios), 3),
        "pair_ratio_min": round(min(ratios), 3), "pair_ratio_max": round(max(ratios), 3),
        "pair_ratios": [round(r, 2) for r in ratios]}), flush=True)


if __name__ == "__main__":
    main()
