"""HTTP benchmark client for benches/serve.sh: streamed OpenAI Chat Completions against one or
more servers, requests interleaved across servers (A, B, A, B, ...) so machine noise hits all
alike. Per request: TTFT (send -> first content chunk) and decode tok/s
((completion_tokens - 1) / (last chunk - first content chunk)), from `usage` with
`stream_options.include_usage`. Every prompt starts with a unique request number, so no
server can reuse a cached prefix of an earlier request. Standard library only.

Usage: python http_bench.py NAME=URL [NAME=URL ...]   (env: REPEATS, MAX_TOKENS, LONG_WORDS)
Prints one JSON line per (server, prompt) with medians, then a table.
"""
import http.client
import json
import os
import statistics
import sys
import time
from urllib.parse import urlparse

REPEATS = int(os.environ.get("REPEATS", "3"))
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "64"))
LONG_WORDS = int(os.environ.get("LONG_WORDS", "700"))
STORY = "Write a short story about a lighthouse keeper."
FILLER = ("The keeper climbed the stairs each evening, trimmed the wick, and wrote the weather in his log. "
          * (LONG_WORDS // 19 + 1)).split()[:LONG_WORDS]
PROMPTS = {
    "short": STORY,
    "long": "Here are notes from a logbook:\n" + " ".join(FILLER) + "\n\n" + STORY,
}


def stream_chat(url, body, chunk_times=None, timeout=3600):
    """POSTs a streamed chat completion; returns (TTFT s, time of the last content chunk from the
    start s, usage or None, content chunks). With `chunk_times` (a list), appends every content
    chunk's time from the start, s; `timeout` bounds each socket wait, s. Raises on a non-200
    answer."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"{url}: HTTP {resp.status}: {resp.read()[:500]!r}")
    first = last = None
    usage = None
    chunks = 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for c in chunk.get("choices") or []:
            if (c.get("delta") or {}).get("content"):
                now = time.perf_counter() - t0
                first = first if first is not None else now
                last = now
                chunks += 1
                if chunk_times is not None:
                    chunk_times.append(now)
    conn.close()
    return first, last, usage, chunks


def one(url, prompt):
    first, last, usage, chunks = stream_chat(url, {
        "model": "default_model",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    })
    tokens = usage["completion_tokens"] if usage else chunks
    decode_s = (last - first) if first is not None and last is not None else 0.0
    return {
        "ttft_s": first if first is not None else float("nan"),
        "decode_tok_s": (tokens - 1) / decode_s if decode_s > 0 else float("nan"),
        "completion_tokens": tokens,
        "prompt_tokens": usage["prompt_tokens"] if usage else None,
    }


def main():
    servers = [a.split("=", 1) for a in sys.argv[1:]]
    results = {(n, p): [] for n, _ in servers for p in PROMPTS}
    counter = 0
    for rep in range(REPEATS):
        for pname, prompt in PROMPTS.items():
            for name, url in servers:
                counter += 1
                r = one(url, f"Request {counter}. {prompt}")
                results[(name, pname)].append(r)
                print(f"# {name:14} {pname:5} rep {rep}: ttft {r['ttft_s']:.3f} s, "
                      f"{r['decode_tok_s']:.2f} tok/s ({r['completion_tokens']} tokens)", file=sys.stderr)
    rows = []
    for (name, pname), rs in results.items():
        row = {
            "server": name,
            "prompt": pname,
            "prompt_tokens": rs[0]["prompt_tokens"],
            "ttft_s_median": statistics.median(r["ttft_s"] for r in rs),
            "decode_tok_s_median": statistics.median(r["decode_tok_s"] for r in rs),
            "decode_tok_s_min": min(r["decode_tok_s"] for r in rs),
            "decode_tok_s_max": max(r["decode_tok_s"] for r in rs),
            "runs": len(rs),
        }
        rows.append(row)
        print(json.dumps(row))
    print(f"\n{'server':16} {'prompt':6} {'prompt tok':>10} {'TTFT s':>8} {'decode tok/s (min-max)':>26}")
    for r in rows:
        print(f"{r['server']:16} {r['prompt']:6} {r['prompt_tokens'] or '-':>10} {r['ttft_s_median']:>8.3f} "
              f"{r['decode_tok_s_median']:>10.2f} ({r['decode_tok_s_min']:.2f}-{r['decode_tok_s_max']:.2f})")
    base = servers[0][0]
    for name, _ in servers[1:]:
        for p in PROMPTS:
            a, b = results[(base, p)], results[(name, p)]
            ttft = statistics.median(x["ttft_s"] for x in b) / statistics.median(x["ttft_s"] for x in a)
            dec = statistics.median(x["decode_tok_s"] for x in a) / statistics.median(x["decode_tok_s"] for x in b)
            print(f"{base} vs {name}, {p} prompt: TTFT {ttft:.2f}x lower, decode {dec:.2f}x faster")


if __name__ == "__main__":
    main()
