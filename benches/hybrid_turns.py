"""Time to first token of each turn of an agent-style conversation on a hybrid (gated-DeltaNet)
model, over HTTP, mlxhost serve against mlx_lm.server on the same directory: each turn resends the
whole conversation (the previous prompt, a fixed assistant reply that is not what the model
generated, as an agent's tool output or an edited reply is, and a new ~TURN_TOKENS-token user
message), `/v1/completions` with `max_tokens` 1 and temperature 0, so a request's wall time is its
time to first token. A recurrent state cannot be trimmed back, so a server must resume each turn
from a state checkpoint at the previous prompt's end, or prefill everything again.

The model directory needs a context of TURNS * TURN_TOKENS tokens (for the tiny fixture, a copy
with `max_position_embeddings` raised: benches/hybrid_turns.sh makes one). Byte-level tokenizer:
a byte is a token. Standard library only.

Usage: python hybrid_turns.py NAME=URL [NAME=URL ...]   (env: TURNS=20, TURN_TOKENS=1000)
Prints one JSON line per (server, turn) and a table of turns 1, 2, 10 and the last.
"""
import json
import os
import sys
import time
import urllib.request

TURNS = int(os.environ.get("TURNS", "20"))
TURN_TOKENS = int(os.environ.get("TURN_TOKENS", "1000"))
WORDS = ("the keeper logged wind swell ships and lamp oil while the lens turned over a grey sea "
         "and letters waited for the boat").split()


def text(k, n):
    """About `n` bytes of ASCII for turn `k`."""
    out, i = [], 0
    while sum(len(w) + 1 for w in out) < n:
        out.append(WORDS[(i * 7 + k * 3) % len(WORDS)])
        i += 1
    return " ".join(out)[:n]


def complete(url, prompt):
    body = json.dumps({"model": "default_model", "prompt": prompt, "max_tokens": 1,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=3600) as r:
        out = json.loads(r.read())
    return time.perf_counter() - t, out.get("usage", {})


def main():
    servers = [a.split("=", 1) for a in sys.argv[1:]]
    results = {}
    for name, url in servers:
        prompt = ""
        rows = []
        for k in range(TURNS):
            if k:
                prompt += "\nassistant: " + text(1000 + k, 40)
            prompt += "\nuser: " + text(k, TURN_TOKENS - 16)
            s, usage = complete(url, prompt)
            row = {"server": name, "turn": k + 1, "prompt_bytes": len(prompt), "ttft_s": round(s, 3),
                   "prompt_tokens": usage.get("prompt_tokens")}
            print(json.dumps(row), flush=True)
            rows.append(row)
        results[name] = rows
    print()
    show = sorted({1, 2, 10, TURNS} & set(range(1, TURNS + 1)))
    print("turn  bytes  " + "  ".join(f"{n:>12}" for n, _ in servers))
    for t in show:
        cells = "  ".join(f"{results[n][t - 1]['ttft_s']:>11.3f}s" for n, _ in servers)
        print(f"{t:>4}  {results[servers[0][0]][t - 1]['prompt_bytes']:>5}  {cells}")


if __name__ == "__main__":
    main()
