"""GPU acceptance test for issue "NVIDIA": every command of one mlxhost binary on MLX's GPU
backend (CUDA, or Metal), checked against what the CPU path gives on the same files.

Standard library only (it runs under whatever python3 the GPU machine has). Steps, each printed
as one JSON line `{"step": ..., "ok": ...}`; the exit status is 1 when any step failed:
  backend   `mlxhost bench` reports a GPU backend (skipped with --record)
  convert   `mlxhost convert` GGUF -> MLX directory
  score     teacher-forced top-5 on tests/fixtures/smollm2-greedy.json (mlx-lm's reference), from
            the GGUF and from the directory, prefill and `--decode`: within semantics.md's 0.05
            nats of mlx-lm (the native path's tolerance) and of the CPU record
  bench     `mlxhost bench` on the GGUF (prefill, decode, batch 8)
  serve     the server on the GGUF with plugins/, the RAM and SSD tiers:
            - first request after /health said ready: TTFT reported (target < 1 s on the GPU)
            - greedy chat for the fixture's conversations with logprobs: tokens equal to the CPU
              record until a near-tie (top-2 margin < 0.1 = twice the tolerance, on either
              side), logprobs of equal tokens within 0.1 (each path is within 0.05 of mlx-lm)
            - the same requests 8 at a time (batched) equal each one alone (0.05)
            - the batched rows attended through mlxhost's CUDA kernel (its self-test passed;
              skipped with --record)
            - plugin ops: seeded sampling (top-p/top-k/min-p) repeatable, logit_bias, penalties,
              the mirostat sampler, the DRY processor, top_logprobs
            - `mlxhost generate` equals the server's greedy text
            - a resent prompt is a RAM-tier hit with the same output; after a restart the SSD
              tier restores it into device memory with the same output
            - Anthropic Messages, Responses and Completions answer
            - the converted directory serves the same greedy output as the GGUF
With --record FILE (run on the CPU), the CPU path's outputs are written to FILE instead of being
compared (tests/fixtures/gpu/smollm2-cpu.json).

Usage: python3 tests/gpu/check.py --bin BIN --gguf GGUF --plugins DIR --work DIR [--record FILE]
"""
import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURE = os.path.join(ROOT, "tests/fixtures/smollm2-greedy.json")
CPU_RECORD = os.path.join(ROOT, "tests/fixtures/gpu/smollm2-cpu.json")
TOL = 0.05  # semantics.md: the native path vs mlx-lm
CROSS_TOL = 0.1  # GPU native vs the CPU path: each within 0.05 of mlx-lm
FAILED = []


def report(step, ok, **info):
    print(json.dumps({"step": step, "ok": ok, **info}), flush=True)
    if not ok:
        FAILED.append(step)


def run(args, **kw):
    t = time.time()
    p = subprocess.run(args, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])} exited {p.returncode}: {p.stderr[-2000:]}")
    return p.stdout, time.time() - t


# ---------------------------------------------------------------- score

def check_top(ours, ref, tol):
    """semantics.md's top-5 rule: shared ids within tol; a reference id missing from ours only
    when its value is within tol of our 5th."""
    mine = dict((i, v) for i, v in ours)
    fifth = min(v for _, v in ours)
    worst = 0.0
    for i, v in ref:
        if i in mine:
            worst = max(worst, abs(mine[i] - v))
        elif v > fifth + tol:
            return False, f"reference id {i} ({v:.4f}) missing from ours (5th {fifth:.4f})", worst
    return worst <= tol, f"max shared difference {worst:.4f}", worst


def score(args, model, extra=()):
    cases = json.load(open(FIXTURE))
    inp = os.path.join(args.work, "score-input.jsonl")
    with open(inp, "w") as f:
        for c in cases:
            f.write(json.dumps({"prompt_ids": c["prompt_ids"], "continuation_ids": c["greedy_ids"]}) + "\n")
    out, secs = run([args.bin, "score", "--model", model, "--input", inp, "--top-logprobs", "5", *extra])
    return [json.loads(l) for l in out.splitlines() if l.strip()], secs


def compare_scores(name, ours, ref_cases, tol):
    worst = 0.0
    for c, (case, o) in enumerate(zip(ref_cases, ours)):
        for s, (r, step) in enumerate(zip(case, o["steps"])):
            ok, why, diff = check_top(step["top"], r, tol)
            worst = max(worst, diff)
            if not ok:
                report(name, False, case=c, at_step=s, why=why)
                return
    report(name, True, max_shared_nats=round(worst, 4), tolerance=tol)


# ---------------------------------------------------------------- server

class Server:
    def __init__(self, args, model, port, *extra):
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(os.path.join(args.work, f"serve-{port}-{int(time.time())}.log"), "w")
        self.started = time.time()
        self.p = subprocess.Popen([args.bin, "serve", "--model", model, "--plugins", args.plugins,
                                   "--port", str(port), *extra], stdout=self.log, stderr=self.log)
        while True:
            if self.p.poll() is not None:
                self.log.flush()
                tail = open(self.log.name).read()[-3000:]
                raise RuntimeError(f"server exited {self.p.returncode}; log {self.log.name}:\n{tail}")
            try:
                if get(self.url + "/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.time() - self.started > 900:
                raise RuntimeError("server not ready after 900 s")
            time.sleep(0.1)
        self.ready_s = time.time() - self.started

    def stop(self):
        self.p.send_signal(signal.SIGTERM)
        try:
            self.p.wait(60)
        except subprocess.TimeoutExpired:
            self.p.kill()
        self.log.close()


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, None


def post(url, body, timeout=600):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def stream_ttft(url, body):
    """Seconds from send to the first content chunk of a streamed chat completion."""
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    t = time.time()
    first = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if first is None and line.startswith(b"data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                if choices[0].get("delta", {}).get("content"):
                    first = time.time() - t
    return first


GREEDY = {"max_tokens": 32, "temperature": 0, "logprobs": True, "top_logprobs": 2,
          "return_tokens_as_token_ids": True}


def chat(s, messages, **kw):
    code, body = post(s.url + "/v1/chat/completions", {**GREEDY, "messages": messages, **kw})
    if code != 200:
        raise RuntimeError(f"chat answered {code}: {body}")
    return body


def tokens(body):
    """[(id, logprob, top-2 margin)] of a chat completion with logprobs."""
    out = []
    for t in body["choices"][0]["logprobs"]["content"]:
        tops = sorted((x["logprob"] for x in t["top_logprobs"]), reverse=True)
        margin = tops[0] - tops[1] if len(tops) > 1 else 99.0
        out.append((int(t["token"].split(":")[1]), t["logprob"], margin))
    return out


def same_greedy(a, b, tol):
    """Tokens equal until a near-tie (margin < 2 * tolerance on either side), logprobs of
    equal tokens within tol. Returns (ok, why, steps compared)."""
    for k, ((ia, la, ma), (ib, lb, mb)) in enumerate(zip(a, b)):
        if ia != ib:
            if min(ma, mb) < 2 * tol:
                return True, f"diverged at step {k} after a near-tie", k
            return False, f"step {k}: token {ia} vs {ib} (margins {ma:.3f}/{mb:.3f})", k
        if abs(la - lb) > tol:
            return False, f"step {k}: logprob {la:.4f} vs {lb:.4f}", k
        if min(ma, mb) < 2 * tol:
            return True, f"stopped at a near-tie at step {k}", k + 1
    if len(a) != len(b):
        return False, f"lengths {len(a)} vs {len(b)}", min(len(a), len(b))
    return True, "equal", len(a)


def conversations():
    return [c["messages"] for c in json.load(open(FIXTURE))]


def serve_checks(args, record):
    ssd = os.path.join(args.work, "ssd")
    s = Server(args, args.gguf, args.port, "--ssd-cache", ssd, "--prompt-cache", "1")
    try:
        report("serve.ready", True, seconds=round(s.ready_s, 2))
        probe = {"messages": [{"role": "user", "content": "Write a haiku about the ocean at night."}],
                 "max_tokens": 8, "temperature": 0}
        first = stream_ttft(s.url, probe)
        second = stream_ttft(s.url, {**probe, "messages": [{"role": "user", "content": "Name three rivers in Europe, briefly."}]})
        report("serve.first_request_ttft", True, first_s=round(first, 3), next_new_prompt_s=round(second, 3))

        greedy = [chat(s, m) for m in conversations()]
        record["greedy"] = [tokens(b) for b in greedy]
        if args.cpu is not None:
            for k, (ours, cpu) in enumerate(zip(record["greedy"], args.cpu["greedy"])):
                ok, why, n = same_greedy(ours, [tuple(x) for x in cpu], CROSS_TOL)
                report(f"serve.greedy_vs_cpu[{k}]", ok, why=why, steps=n)

        # Batched: the fixture conversations plus 5 others at once, each against itself alone.
        extra = [[{"role": "user", "content": f"Count from {i} to {i + 5}."}] for i in range(5)]
        alone = greedy + [chat(s, m) for m in extra]
        batched = [None] * len(alone)
        msgs = conversations() + extra

        def one(i):
            batched[i] = chat(s, msgs[i])
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(msgs))]
        [t.start() for t in threads]
        [t.join() for t in threads]
        worst = []
        for i, (a, b) in enumerate(zip(alone, batched)):
            ok, why, _ = same_greedy(tokens(a), tokens(b), TOL)
            worst.append(ok)
            if not ok:
                report(f"serve.batched_vs_alone[{i}]", False, why=why)
        report("serve.batched_vs_alone", all(worst), rows=len(msgs))
        # Those rows attended through mlxhost's CUDA kernel (model::cuda_decode_attention) unless
        # its start-up self-test failed and MLX's SDPA took over: say which, from the server log.
        s.log.flush()
        lines = [l for l in open(s.log.name).read().splitlines() if "slab decode attention" in l]
        used = any("CUDA kernel in use" in l for l in lines)
        report("serve.slab_attention_kernel", used or args.record is not None,
               why=(lines[0][-300:] if lines else "no slab attention line in the server log"))

        plugin_checks(s, msgs[0])

        # generate (CLI) against the server's greedy text.
        text = greedy[0]["choices"][0]["message"]["content"]
        conv = conversations()[0]
        out, _ = run([args.bin, "generate", "--model", args.gguf, "--plugins", args.plugins,
                      "--prompt", conv[-1]["content"], "--max-tokens", "32"])
        report("generate", out.strip() == text.strip(), generate=out.strip()[:80], serve=text[:80])
        # The opt-in fused layer kernels (model::cuda_fused, MLXHOST_FUSED_KERNELS=on): they
        # pass their self-test and give the same greedy text as MLX's ops.
        p = subprocess.run([args.bin, "generate", "--model", args.gguf, "--plugins", args.plugins,
                            "--prompt", conv[-1]["content"], "--max-tokens", "32"],
                           capture_output=True, text=True,
                           # The "kernels in use" line is logged at info; one-shot
                           # commands log warnings only by default.
                           env={**os.environ, "MLXHOST_FUSED_KERNELS": "on",
                                "MLXHOST_LOG": "info"})
        used = "kernels in use" in p.stderr
        report("generate.fused_kernels", p.returncode == 0 and (used or args.record is not None)
               and p.stdout.strip() == out.strip(), used=used, generate=p.stdout.strip()[:80],
               why=p.stderr[-300:] if p.returncode != 0 or not used else "")

        # mlxhost's quantized mat-vec kernel (model::cuda_qmv): forced on, it passes its self-test
        # against MLX's quantized_matmul and gives the same greedy text as MLX's op everywhere.
        qmv = {}
        for mode in ("on", "off"):
            qmv[mode] = subprocess.run(
                [args.bin, "generate", "--model", args.gguf, "--plugins", args.plugins,
                 "--prompt", conv[-1]["content"], "--max-tokens", "32"],
                capture_output=True, text=True,
                env={**os.environ, "MLXHOST_QMV": mode, "MLXHOST_LOG": "info"})
        used = "quantized mat-vec CUDA kernel in use" in qmv["on"].stderr
        report("generate.qmv_kernel",
               all(p.returncode == 0 for p in qmv.values()) and (used or args.record is not None)
               and qmv["on"].stdout.strip() == qmv["off"].stdout.strip(),
               used=used, on=qmv["on"].stdout.strip()[:80], off=qmv["off"].stdout.strip()[:80],
               why=qmv["on"].stderr[-300:] if not used else "")

        # RAM tier: the same prompt again is a hit with the same output.
        again = chat(s, conversations()[1])
        cached = again["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        ok, why, _ = same_greedy(tokens(greedy[1]), tokens(again), TOL)
        report("serve.ram_cache_hit", ok and cached > 0, cached_tokens=cached, why=why)

        dialects(s)
        # Let the SSD tier write the settled prompts.
        deadline = time.time() + 60
        while time.time() < deadline:
            st = get(s.url + "/stats")[1]["ssd_cache"]
            if st["writes"] >= 1 and st["pending_writes"] == 0:
                break
            time.sleep(0.2)
    finally:
        s.stop()

    s = Server(args, args.gguf, args.port, "--ssd-cache", ssd)
    try:
        warm = chat(s, conversations()[1])
        st = get(s.url + "/stats")[1]["ssd_cache"]
        ok, why, _ = same_greedy(tokens(greedy[1]), tokens(warm), TOL)
        cached = warm["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
        report("serve.ssd_restore", ok and st["hits"] >= 1 and cached > 0, ssd_hits=st["hits"],
               cached_tokens=cached, why=why)
    finally:
        s.stop()

    mlx_dir = os.path.join(args.work, "smollm2-mlx")
    s = Server(args, mlx_dir, args.port)
    try:
        d = chat(s, conversations()[1])
        ok, why, _ = same_greedy(tokens(greedy[1]), tokens(d), TOL)
        report("serve.mlx_directory_vs_gguf", ok, why=why)
    finally:
        s.stop()


def plugin_checks(s, messages):
    base = {"messages": messages, "max_tokens": 16}
    url = s.url + "/v1/chat/completions"

    def text(body):
        return body["choices"][0]["message"]["content"]
    sampled = {**base, "temperature": 0.9, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 7}
    a, b = post(url, sampled), post(url, sampled)
    report("plugins.seeded_sampling_repeats", a[0] == b[0] == 200 and text(a[1]) == text(b[1]),
           code=a[0], text=text(a[1])[:60] if a[0] == 200 else a[1])
    g = post(url, {**base, "temperature": 0, "logprobs": True, "top_logprobs": 5,
                   "return_tokens_as_token_ids": True})
    first_id = int(g[1]["choices"][0]["logprobs"]["content"][0]["token"].split(":")[1])
    top5 = len(g[1]["choices"][0]["logprobs"]["content"][0]["top_logprobs"])
    banned = post(url, {**base, "temperature": 0, "logit_bias": {str(first_id): -100}, "logprobs": True,
                        "return_tokens_as_token_ids": True})
    new_first = int(banned[1]["choices"][0]["logprobs"]["content"][0]["token"].split(":")[1])
    report("plugins.logit_bias_and_top_logprobs", new_first != first_id and top5 == 5,
           first=first_id, after_bias=new_first)
    for name, extra in [("penalties", {"temperature": 0, "repetition_penalty": 1.3, "presence_penalty": 0.5,
                                       "frequency_penalty": 0.5}),
                        ("mirostat", {"temperature": 0.9, "seed": 3, "sampler": "mirostat",
                                      "plugin_params": {"mirostat": {"tau": 3.0}}}),
                        ("dry", {"temperature": 0, "logits_processors": ["dry"],
                                 "plugin_params": {"dry": {"multiplier": 2.0}}})]:
        r1, r2 = post(url, {**base, **extra}), post(url, {**base, **extra})
        ok = r1[0] == 200 and r1[1]["choices"][0]["message"]["content"] == r2[1]["choices"][0]["message"]["content"]
        report(f"plugins.{name}", ok and bool(text(r1[1])), code=r1[0])


def dialects(s):
    msg = {"model": "default", "max_tokens": 8}
    c1 = post(s.url + "/v1/messages", {**msg, "messages": [{"role": "user", "content": "Hi"}]})
    c2 = post(s.url + "/v1/responses", {"model": "default", "input": "Hi", "max_output_tokens": 8})
    c3 = post(s.url + "/v1/completions", {**msg, "prompt": "Once upon a time"})
    report("serve.dialects", [c1[0], c2[0], c3[0]] == [200, 200, 200], messages=c1[0], responses=c2[0],
           completions=c3[0])


def mlx_lm_decode_scores(args, mlx_dir):
    """mlx-lm's scores of the fixture in decode mode (benches/mlx_lm_score.py --decode) on this
    machine's MLX, as top-5 lists per case; None when mlx-lm is not importable here."""
    py = os.environ.get("MLX_LM_PYTHON", "python3")
    if subprocess.run([py, "-c", "import mlx_lm"], capture_output=True).returncode != 0:
        report("mlx_lm_decode_reference", True, skipped="mlx-lm not importable")
        return None
    inp = os.path.join(args.work, "score-input.jsonl")
    with open(inp, "w") as f:
        for c in json.load(open(FIXTURE)):
            f.write(json.dumps({"prompt_ids": c["prompt_ids"], "continuation_ids": c["greedy_ids"]}) + "\n")
    with open(inp) as stdin:
        out = subprocess.run([py, os.path.join(ROOT, "benches/mlx_lm_score.py"), mlx_dir, "--decode"],
                             stdin=stdin, capture_output=True, text=True)
    if out.returncode != 0:
        report("mlx_lm_decode_reference", False, error=out.stderr[-1500:])
        return None
    rows = [json.loads(l) for l in out.stdout.splitlines() if l.strip()]
    # mlx-lm's decode against its own one-forward reference: how far the device's decode kernels
    # move the numbers by themselves.
    compare_scores("mlx_lm_decode_vs_prefill_reference",
                   rows, [[r["top5"] for r in c["teacher_forced_top5"]] for c in json.load(open(FIXTURE))],
                   CROSS_TOL)
    return [[s["top"] for s in r["steps"]] for r in rows]


# ---------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--plugins", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--port", type=int, default=18090)
    ap.add_argument("--record")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    args.cpu = None if args.record else json.load(open(CPU_RECORD))
    record = {}

    out, _ = run([args.bin, "bench", "--model", args.gguf, "--prompt-tokens", "128", "--decode-tokens", "32"])
    bench = json.loads(out.strip().splitlines()[-1])
    report("backend", args.record is not None or bench.get("backend") != "cpu", backend=bench.get("backend"))
    report("bench", True, **{k: bench.get(k) for k in ("compute", "prefill_tok_s", "decode_ms_per_token")})
    out, _ = run([args.bin, "bench", "--model", args.gguf, "--batch", "8", "--prompt-tokens", "64",
                  "--decode-tokens", "16"])
    b8 = json.loads(out.strip().splitlines()[-1])
    report("bench.batch8", True, decode_ms_per_step=b8.get("decode_ms_per_token"))

    mlx_dir = os.path.join(args.work, "smollm2-mlx")
    _, secs = run([args.bin, "convert", args.gguf, mlx_dir])
    report("convert", os.path.isfile(os.path.join(mlx_dir, "model.safetensors")), seconds=round(secs, 1))

    ref = [[r["top5"] for r in c["teacher_forced_top5"]] for c in json.load(open(FIXTURE))]
    peer_decode = None if args.record else mlx_lm_decode_scores(args, mlx_dir)
    for name, model, extra in [("score.gguf", args.gguf, ()), ("score.mlx_directory", mlx_dir, ()),
                               ("score.gguf_decode", args.gguf, ("--decode",))]:
        ours, secs = score(args, model, extra)
        if extra and peer_decode is not None:
            # Step-by-step decode: against mlx-lm's own decode loop on this device (its KV cache
            # and one-query attention kernels), not the one-forward reference.
            compare_scores(name + "_vs_mlx_lm_decode", ours, peer_decode, TOL)
            compare_scores(name + "_vs_mlx_lm_prefill_reference", ours, ref, CROSS_TOL)
        else:
            compare_scores(name + "_vs_mlx_lm", ours, ref, TOL)
        tops = [[s["top"] for s in o["steps"]] for o in ours]
        record[name] = tops
        if args.cpu is not None and name in args.cpu:
            compare_scores(name + "_vs_cpu", ours, args.cpu[name], CROSS_TOL)

    serve_checks(args, record)
    if args.record:
        os.makedirs(os.path.dirname(args.record), exist_ok=True)
        with open(args.record, "w") as f:
            json.dump({"made_by": "RECORD=1 tests/gpu/run.sh on the CPU backend (mlxhost's default CPU "
                       "path: quantized kernels) from the installed SmolLM2-135M-Instruct Q4_1 GGUF",
                       **record}, f)
            f.write("\n")
    print(json.dumps({"failed": FAILED}))
    sys.exit(1 if FAILED else 0)


if __name__ == "__main__":
    main()
