"""The peers' own speculative decoding on the prompts of benches/speculative.py (issue 40), for
benches/speculative_peers.sh: llama.cpp's `llama-server` without and with a draft model (`-md`),
and `mlx_lm.generate` without and with `--draft-model`, greedy, batch 1.

llama-server: a non-streamed `/v1/chat/completions` per prompt (its chat template, temperature
0); decode tok/s is the server's own `timings.predicted_per_second` (tokens after prefill over
their time), with `timings.draft_n` / `draft_n_accepted` where it drafted. mlx-lm: one
`mlx_lm.generate` per prompt and mode (the model's chat template), its printed "Generation: N
tokens, X tokens-per-sec".

Usage:
  python speculative_peers.py llama URL_PLAIN URL_DRAFT     (servers started by the .sh)
  python speculative_peers.py mlx-lm PYTHON TARGET_DIR DRAFT_DIR
Env: MAX_TOKENS (256), N1 (prompts per set, 2), SETS ("code-edit free-text"), NUM_DRAFT (mlx-lm's
--num-draft-tokens, 3: its default). Prints one JSON line per (engine, set, mode) and the ratio.
"""
import json
import os
import re
import subprocess
import sys
import urllib.request

sys.path.insert(0, os.path.dirname(__file__))
from speculative import prompt  # noqa: E402

MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "256"))
N1 = int(os.environ.get("N1", "2"))
SETS = os.environ.get("SETS", "code-edit free-text").split()
NUM_DRAFT = os.environ.get("NUM_DRAFT", "3")


def llama_one(url, text):
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "stream": False}
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        out = json.load(r)
    t = out.get("timings", {})
    return (t.get("predicted_n", 0), t.get("predicted_ms", 0.0), t.get("draft_n", 0),
            t.get("draft_n_accepted", 0))


def mlx_lm_one(python, target, draft, text):
    args = [python, "-m", "mlx_lm", "generate", "--model", target, "--prompt", text,
            "--max-tokens", str(MAX_TOKENS), "--temp", "0"]
    if draft:
        args += ["--draft-model", draft, "--num-draft-tokens", NUM_DRAFT]
    out = subprocess.run(args, capture_output=True, text=True, timeout=7200)
    m = re.search(r"Generation: (\d+) tokens, ([0-9.]+) tokens-per-sec", out.stdout + out.stderr)
    if not m:
        raise RuntimeError(f"mlx_lm.generate printed no generation speed:\n{out.stderr[-2000:]}")
    n, tps = int(m.group(1)), float(m.group(2))
    return n, n / tps * 1e3 if tps > 0 else 0.0, 0, 0


def main():
    engine = sys.argv[1]
    if engine == "llama":
        plain_url, draft_url = sys.argv[2], sys.argv[3]
        modes = {"none": lambda t: llama_one(plain_url, t),
                 "draft model": lambda t: llama_one(draft_url, t)}
        name = "llama.cpp"
    else:
        python, target, draft = sys.argv[2], sys.argv[3], sys.argv[4]
        modes = {"none": lambda t: mlx_lm_one(python, target, None, t),
                 "draft model": lambda t: mlx_lm_one(python, target, draft, t)}
        name = "mlx-lm"
    for kind in SETS:
        acc = {m: [0, 0.0, 0, 0] for m in modes}
        # Modes alternate prompt by prompt: a machine whose load changes slows both alike.
        for i in range(N1):
            for mode, run in modes.items():
                for k, v in enumerate(run(prompt(kind, i))):
                    acc[mode][k] += v
        tps = {}
        for mode, (n, ms, drafted, accepted) in acc.items():
            tps[mode] = n / ms * 1e3 if ms > 0 else 0.0
            print(json.dumps({"engine": name, "set": kind, "mode": mode, "tokens": n,
                              "decode_tok_s": round(tps[mode], 2), "drafted": drafted,
                              "accepted": accepted}), flush=True)
        if tps["none"] > 0:
            print(json.dumps({"engine": name, "set": kind,
                              "draft_model_speedup": round(tps["draft model"] / tps["none"], 3)}),
                  flush=True)


if __name__ == "__main__":
    main()
