"""Shared prefixes prefilled once, over HTTP, in one run: two requests whose prompts share a long
prefix (an agent's system prompt; default ~10k tokens) and differ in their last user message,
sent alone one after the other and then together. Together, the second waits for the first
row's KV and prefills only its own suffix. Reports each request's TTFT and cached tokens, the
prefilled-token count from /stats, and whether the outputs (greedy) equal the alone runs.
Starts the server itself with the RAM prompt cache off, so reuse can only come from a running
row. Standard library only.

Usage: python shared_prefix.py MLXHOST_BIN [MODEL]   (env: PREFIX_TOKENS=10000, PORT=18091)
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

BIN = sys.argv[1]
MODEL = sys.argv[2] if len(sys.argv) > 2 else "qwen2.5-coder-0.5b"
PREFIX_TOKENS = int(os.environ.get("PREFIX_TOKENS", "10000"))
PORT = int(os.environ.get("PORT", "18091"))
URL = f"http://127.0.0.1:{PORT}"
RULE = "Rule: read the file before editing it, keep changes small, and run the tests after each change. "
QUESTIONS = ["Write a Python function that reverses a string.", "Write a Python function that sums a list."]


def call(method, path, body=None, timeout=3600):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(URL + path, data=data, method=method,
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def ask(system, question):
    started = time.perf_counter()
    body = call("POST", "/v1/chat/completions", {
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "max_tokens": 16, "temperature": 0})
    elapsed = time.perf_counter() - started
    u = body["usage"]
    return {"text": body["choices"][0]["message"]["content"], "s": round(elapsed, 2),
            "prompt_tokens": u["prompt_tokens"],
            "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)}


def main():
    log = open("/tmp/mlxhost-shared-prefix.log", "w")
    proc = subprocess.Popen([BIN, "serve", "--plugins", "plugins", "--port", str(PORT), "--model", MODEL,
                             "--prompt-cache", "0"], stdout=subprocess.DEVNULL, stderr=log)
    try:
        for _ in range(2400):
            if proc.poll() is not None:
                raise RuntimeError(f"server exited {proc.returncode}")
            try:
                if call("GET", "/health", timeout=5).get("status") == "ok":
                    break
            except OSError:
                time.sleep(0.25)
        # ~23 tokens per rule sentence with Qwen's tokenizer.
        system = RULE * max(1, PREFIX_TOKENS // 20)
        alone = [ask(system, q) for q in QUESTIONS]
        before = call("GET", "/stats")["batch"]["prefill_tokens"]
        together = [None, None]
        first = threading.Event()

        def run(i):
            if i == 1:
                first.wait()
                time.sleep(0.5)
            else:
                first.set()
            together[i] = ask(system, QUESTIONS[i])

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = call("GET", "/stats")["batch"]
        result = {
            "model": MODEL,
            "prompt_tokens": [a["prompt_tokens"] for a in alone],
            "alone": alone,
            "together": together,
            "prefilled_together": stats["prefill_tokens"] - before,
            "prefilled_alone": sum(a["prompt_tokens"] for a in alone),
            "same_output": [a["text"] for a in alone] == [t["text"] for t in together],
            "recent": stats["recent"][-2:],
        }
        print(json.dumps(result, indent=1))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


if __name__ == "__main__":
    main()
