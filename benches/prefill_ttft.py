"""Prefill over HTTP against llama.cpp's own server, on the same GGUF and the same token ids (issue
44): TTFT of a non-streamed `/v1/completions` request with `max_tokens: 1` (temperature 0), so the
time to the answer is the prompt's cold prefill plus one sampled token, for each prompt length.

Both servers are started by this script and stay up side by side on ports PORT and PORT+1 (logs
in a temp directory, both stopped on exit): `mlxhost serve --model MODEL --prompt-cache 0` and
`llama-server -m GGUF -c 32768 -t 2 -np 1`, whose requests carry `cache_prompt: false`; every
request's text also starts with its own run number, so neither can reuse a cached prefix. The
prompt is built as text, tokenized by llama-server's `/tokenize` (no special tokens) and cut to
exactly N ids; both servers get that id list as `prompt`. After a short warm-up request to each,
the servers alternate per length and repeat (A B, then B A) with a pause between requests so the
idle one's threads are asleep. Prefill tok/s = N / TTFT; the ratio is mlxhost's tok/s over
llama.cpp's. Standard library only.

  python3 benches/prefill_ttft.py --model qwen2.5-coder-0.5b [--lengths 512,19000] [--repeats 1]
      [--out prefill.json] [--servers mlxhost,llama]
(env: LLAMA_SERVER, set by benches/llama_server_env.sh)
"""
import argparse
import datetime
import http.client
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CACHE = os.environ.get("MLXHOST_CACHE") or os.path.join(
    os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mlxhost")
# mlxhost's catalog (host/src/model/catalog.rs): short name -> GGUF file under $MLXHOST_CACHE/models.
CATALOG = {
    "smollm2-135m": "SmolLM2-135M-Instruct.Q4_1.gguf",
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "gemma3-270m": "gemma-3-270m-q4_k_m.gguf",
}
PARAGRAPH = ("The lighthouse keeper logged the wind, the swell and every passing ship, and in the evenings "
             "he repaired the lamp, polished the lens and wrote long letters to his sister in the city. "
             "def trim_wick(lamp, length=3):\n    return lamp.wick[:length]  # keep the flame steady\n")
PROCS = []


def request(port, method, path, body=None, timeout=3600):
    """One HTTP request to 127.0.0.1:port; returns (status, parsed JSON or raw text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, None if body is None else json.dumps(body),
                     {"content-type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
    finally:
        conn.close()
    try:
        return resp.status, json.loads(raw)
    except ValueError:
        return resp.status, raw[:500]


def start(name, argv, port, logdir):
    log = open(os.path.join(logdir, f"{name}.log"), "wb")
    print(f"# starting {name}: {' '.join(argv)} (log {log.name})", file=sys.stderr)
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=ROOT)
    PROCS.append(proc)
    started = time.perf_counter()
    while time.perf_counter() - started < 600:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}; see {log.name}")
        try:
            status, _ = request(port, "GET", "/health", timeout=5)
            if status == 200:
                print(f"# {name} ready in {time.perf_counter() - started:.1f} s", file=sys.stderr)
                return proc
        except OSError:
            pass
        time.sleep(0.25)
    raise TimeoutError(f"{name} not ready after 600 s; see {log.name}")


def stop_all(*_):
    for proc in PROCS:
        if proc.poll() is None:
            proc.terminate()
    for proc in PROCS:
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    PROCS.clear()


def token_ids(llama_port, text, n):
    """The first n ids of `text` as llama-server tokenizes it (no BOS or other special tokens)."""
    while True:
        status, out = request(llama_port, "POST", "/tokenize", {"content": text, "add_special": False})
        if status != 200:
            raise RuntimeError(f"/tokenize: HTTP {status}: {out!r}")
        ids = out["tokens"]
        if len(ids) >= n:
            return ids[:n]
        text += PARAGRAPH * ((n - len(ids)) // 40 + 1)


def completion(server, port, ids, timeout):
    """POSTs the non-streamed completion; returns (seconds to the whole answer, response)."""
    body = {"model": "default_model", "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": False}
    if server == "llama":
        body["cache_prompt"] = False
    t0 = time.perf_counter()
    status, out = request(port, "POST", "/v1/completions", body, timeout=timeout)
    elapsed = time.perf_counter() - t0
    if status != 200:
        raise RuntimeError(f"{server}: HTTP {status}: {out!r}")
    return elapsed, out


def loadavg():
    """The 1-minute load average: other work on the machine shows here (these servers idle at ~0)."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except OSError:
        return None


def describe_machine():
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count()}


def git_head():
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() or None
    except OSError:
        return None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b",
                    help="mlxhost catalog name (qwen2.5-coder-0.5b, ...) or a .gguf path")
    ap.add_argument("--gguf", help="the GGUF for llama-server (default: the catalog file under $MLXHOST_CACHE/models)")
    ap.add_argument("--lengths", default="512,19000", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--servers", default="mlxhost,llama", help="which to run: mlxhost, llama or both")
    ap.add_argument("--port", type=int, default=18190, help="mlxhost's port; llama-server gets port+1")
    ap.add_argument("--bin", default=os.path.join(ROOT, "target/release/mlxhost"))
    ap.add_argument("--llama-server", default=os.environ.get("LLAMA_SERVER"))
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t (and -tb)")
    ap.add_argument("--ctx", type=int, default=32768, help="llama-server -c")
    ap.add_argument("--pause", type=float, default=2.0, help="seconds between requests")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one request may take")
    ap.add_argument("--mlxhost-args", default="", help="extra `mlxhost serve` flags, space-separated")
    ap.add_argument("--llama-args", default="", help="extra llama-server flags, space-separated")
    args = ap.parse_args()

    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not servers or any(s not in ("mlxhost", "llama") for s in servers):
        ap.error("--servers takes mlxhost, llama or both")
    lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
    if args.model.endswith(".gguf"):
        gguf = args.gguf or args.model
    elif args.gguf:
        gguf = args.gguf
    elif args.model in CATALOG:
        gguf = os.path.join(CACHE, "models", CATALOG[args.model])
    else:
        ap.error(f"no GGUF known for {args.model!r}: pass --gguf")
    if not os.path.isfile(gguf):
        sys.exit(f"{gguf} is missing (mlxhost models pull {args.model})")
    if not args.llama_server or not os.access(args.llama_server, os.X_OK):
        sys.exit("llama-server not found: source benches/llama_server_env.sh or pass --llama-server "
                 "(its /tokenize gives the prompt ids, so it runs even with --servers mlxhost)")

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    logdir = tempfile.mkdtemp(prefix="prefill_ttft.")
    ports = {"mlxhost": args.port, "llama": args.port + 1}
    llama_version = subprocess.run([args.llama_server, "--version"], capture_output=True, text=True)
    llama_version = (llama_version.stdout + llama_version.stderr).strip().splitlines()
    try:
        start("llama", [args.llama_server, "-m", gguf, "-c", str(args.ctx), "-t", str(args.threads),
                        "-tb", str(args.threads), "--port", str(ports["llama"]), "-np", "1",
                        *args.llama_args.split()], ports["llama"], logdir)
        if "mlxhost" in servers:
            start("mlxhost", [args.bin, "serve", "--model", args.model, "--port", str(ports["mlxhost"]),
                              "--prompt-cache", "0", *args.mlxhost_args.split()], ports["mlxhost"], logdir)
        # Warm-up: a short request each (page faults, first-use allocations), not counted.
        warm = token_ids(ports["llama"], "Warm-up. " + PARAGRAPH, 32)
        for s in servers:
            completion(s, ports[s], warm, args.timeout)
        runs = []
        for n in lengths:
            for rep in range(args.repeats):
                text = f"Run {rep} of the {n}-token prompt. " + PARAGRAPH * (n // 40 + 1)
                ids = token_ids(ports["llama"], text, n)
                order = servers if rep % 2 == 0 else servers[::-1]
                for s in order:
                    time.sleep(args.pause)
                    load = loadavg()
                    if load is not None and load > 0.5:
                        print(f"# warning: load average {load} before this request: other work shares the "
                              "cores (llama.cpp, whose threads spin at barriers, loses far more than half)",
                              file=sys.stderr)
                    ttft, out = completion(s, ports[s], ids, args.timeout)
                    usage = out.get("usage") or {}
                    run = {"server": s, "prompt_tokens": n, "repeat": rep, "ttft_s": ttft, "prefill_tok_s": n / ttft,
                           "usage_prompt_tokens": usage.get("prompt_tokens"), "loadavg_1m_before": load}
                    if s == "llama" and out.get("timings"):
                        t = out["timings"]
                        run["llama_prompt_n"] = t.get("prompt_n")
                        run["llama_prompt_ms"] = t.get("prompt_ms")
                    if run["usage_prompt_tokens"] not in (None, n):
                        print(f"# warning: {s} counted {run['usage_prompt_tokens']} prompt tokens, sent {n}",
                              file=sys.stderr)
                    runs.append(run)
                    print(f"# {s:8} {n:>6} tokens rep {rep}: TTFT {ttft:.3f} s, {n / ttft:.1f} tok/s (load {load})",
                          file=sys.stderr)
    finally:
        stop_all()

    summary = []
    for n in lengths:
        row = {"prompt_tokens": n}
        for s in servers:
            ttfts = [r["ttft_s"] for r in runs if r["server"] == s and r["prompt_tokens"] == n]
            row[s] = {"ttft_s_median": statistics.median(ttfts), "ttft_s_min": min(ttfts),
                      "ttft_s_max": max(ttfts), "prefill_tok_s": n / statistics.median(ttfts), "runs": len(ttfts)}
        if "mlxhost" in row and "llama" in row:
            row["ratio_mlxhost_over_llama"] = row["mlxhost"]["prefill_tok_s"] / row["llama"]["prefill_tok_s"]
        summary.append(row)

    names = {"mlxhost": "mlxhost", "llama": "llama.cpp"}
    head = "| prompt tokens |" + "".join(f" {names[s]} TTFT s | {names[s]} tok/s |" for s in servers)
    both = len(servers) == 2
    print(f"\n{args.model} ({os.path.basename(gguf)}), median of {args.repeats}\n")
    print(head + (" mlxhost / llama.cpp |" if both else ""))
    print("|---:|" + "---:|---:|" * len(servers) + ("---:|" if both else ""))
    for row in summary:
        cells = "".join(f" {row[s]['ttft_s_median']:.3f} | {row[s]['prefill_tok_s']:.1f} |" for s in servers)
        ratio = f" {row['ratio_mlxhost_over_llama']:.2f}x |" if both else ""
        print(f"| {row['prompt_tokens']} |{cells}{ratio}")

    if args.out:
        result = {
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "model": args.model, "gguf": gguf, "machine": describe_machine(), "mlxhost_commit": git_head(),
            "mlxhost_bin": args.bin, "llama_server": args.llama_server, "llama_server_version": llama_version,
            "settings": {"threads": args.threads, "ctx": args.ctx, "repeats": args.repeats, "pause_s": args.pause,
                         "mlxhost_args": args.mlxhost_args, "llama_args": args.llama_args},
            "runs": runs, "summary": summary,
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"\nwrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
