"""Per-token timing of streamed requests, one after another (C=1), against one server: for each
request the decode rate ((tokens - 1) / (last chunk - first chunk), tokens from the stream's
`usage` where the server sends it, else the content chunks) and the gaps between
consecutive content chunks (median, p90, the two largest), so a step whose cost changes between
requests shows as a moving median while a rare slow step shows as a large maximum
(docs/benchmarks.md, "Run 10"). Every prompt starts with a unique number (no cached prefix).
Standard library only.

Usage: python stream_gaps.py URL [N]     (env: MAX_TOKENS, default 128)
Prints one JSON line per request, then the median over requests of the per-request medians.
"""
import json
import os
import statistics
import sys

from http_bench import STORY, stream_chat

MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "128"))


def one(url, i):
    body = {"model": "default_model", "messages": [{"role": "user", "content": f"g{i}: {STORY}"}],
            "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    times = []
    _, _, usage, _ = stream_chat(url, body, times, timeout=300)
    if len(times) < 3:
        raise SystemExit(f"request {i}: only {len(times)} content chunks")
    gaps = sorted((b - a) * 1e3 for a, b in zip(times, times[1:]))
    # A server may put two tokens in one chunk (mlx_lm.server sent 126 chunks for 128 tokens):
    # the token count comes from `usage` where the server reports it.
    tokens = (usage or {}).get("completion_tokens") or len(times)
    return {"request": i, "chunks": len(times), "tokens": tokens, "ttft_s": round(times[0], 3),
            "decode_tok_s": round((tokens - 1) / (times[-1] - times[0]), 1),
            "gap_median_ms": round(statistics.median(gaps), 2),
            "gap_p90_ms": round(gaps[int(len(gaps) * 0.9)], 2),
            "gap_max_ms": [round(g, 1) for g in gaps[-2:]]}


def main():
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    url = sys.argv[1].rstrip("/")
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    medians = []
    for i in range(n):
        row = one(url, i)
        medians.append(row["gap_median_ms"])
        print(json.dumps(row), flush=True)
    print(json.dumps({"requests": n, "median_of_gap_medians_ms": statistics.median(medians),
                      "gap_medians_ms": medians}))


if __name__ == "__main__":
    main()
