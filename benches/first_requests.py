"""The first requests after a server reports ready, against the same requests once warm (issue 35:
"the first 50 requests after ready, of mixed kinds, have p99 TTFT within 3x of the warm p99").
Standard library only (it runs under the GPU machine's python3).

50 requests in waves of 5 concurrent ones, the kinds cycling: greedy chat, sampled chat (top_p,
top_k, min_p), chat with top_logprobs, a long (~800-token) completion prompt, a repeat of an
earlier prompt (a prompt-cache hit), an extension of an earlier prompt (hit, trim or continue),
and an Anthropic /v1/messages request. Each asks for one token (max_tokens 1), so its time is
the prefill and the first token: TTFT. Then the same 50 again with another first line (warm kernels, the same share of cache hits). Prints one JSON line:
p50/p99/max of both passes, the ratio of the p99s, and the slowest first-pass requests.

  python3 benches/first_requests.py URL [--n 50] [--wave 5]
"""
import argparse
import json
import threading
import time
import urllib.request

KINDS = ["greedy", "sampled", "top_logprobs", "long", "repeat", "extend", "anthropic"]
STORY = ("The keeper climbed the stairs each evening, trimmed the wick, and wrote the weather in "
         "his log. ")


def request(url, kind, i, salt):
    """(path, body) of request i of `kind`; `salt` starts every prompt (one per pass, so the warm
    pass reuses nothing of the first and measures warm kernels, not cache hits)."""
    base = f"{salt} question {i % 7}: tell me about lighthouses and the sea."
    chat = {"messages": [{"role": "user", "content": f"{base} (request {i})"}], "max_tokens": 1,
            "temperature": 0}
    if kind == "greedy":
        return "/v1/chat/completions", chat
    if kind == "sampled":
        return "/v1/chat/completions", {**chat, "temperature": 0.8, "top_p": 0.9, "top_k": 40,
                                         "min_p": 0.05, "seed": i}
    if kind == "top_logprobs":
        return "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 5}
    if kind == "long":
        return "/v1/completions", {"prompt": f"{salt} log {i}. " + STORY * 40, "max_tokens": 1}
    if kind == "repeat":
        # The same prompt as request i - 7's greedy twin: the RAM cache holds it.
        return "/v1/completions", {"prompt": f"{base} Repeat.", "max_tokens": 1}
    if kind == "extend":
        return "/v1/completions", {"prompt": f"{base} Repeat. And then {i}", "max_tokens": 1}
    return "/v1/messages", {"model": "m", "max_tokens": 1,
                            "messages": [{"role": "user", "content": f"{base} ({i})"}]}


def timed(url, path, body, out, key):
    data = json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"content-type": "application/json",
                                                                 "anthropic-version": "2023-06-01"})
    t = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        status = e.code
    out[key] = (time.perf_counter() - t, status)


def one_pass(url, n, wave, salt):
    times = {}
    for start in range(0, n, wave):
        threads = []
        for i in range(start, min(n, start + wave)):
            kind = KINDS[i % len(KINDS)]
            path, body = request(url, kind, i, salt)
            th = threading.Thread(target=timed, args=(url, path, body, times, (i, kind)))
            th.start()
            threads.append(th)
        for th in threads:
            th.join()
    return times


def summary(times):
    s = sorted(t for t, _ in times.values())

    def pct(p):
        return s[min(len(s) - 1, int(round(p / 100 * (len(s) - 1))))]

    return {"p50_s": round(pct(50), 4), "p99_s": round(pct(99), 4), "max_s": round(s[-1], 4),
            "errors": sum(1 for _, st in times.values() if st != 200)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--wave", type=int, default=5)
    a = ap.parse_args()
    url = a.url.rstrip("/")
    first = one_pass(url, a.n, a.wave, "First pass,")
    warm = one_pass(url, a.n, a.wave, "Warm pass,")
    f, w = summary(first), summary(warm)
    slowest = sorted(first.items(), key=lambda kv: -kv[1][0])[:5]
    print(json.dumps({"probe": "first_requests", "url": url, "n": a.n, "wave": a.wave,
                      "first": f, "warm": w, "p99_ratio": round(f["p99_s"] / w["p99_s"], 2),
                      "slowest_first": [{"i": k[0], "kind": k[1], "s": round(v[0], 4)}
                                        for k, v in slowest]}))


if __name__ == "__main__":
    main()
