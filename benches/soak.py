"""Hardening soak benchmark ("Hardening, second pass"): does a hostile client mix make the server
answer 5xx, grow its memory, or slow the real clients sharing it?

It starts `mlxhost serve` itself (a free port, `--plugins plugins`, `--batch 16` unless told)
and runs two phases:

  A  baseline (--baseline-seconds, default 120): 16 real clients stream /v1/chat/completions
     back to back (temperature 0, max_tokens 64, short varied prompts);
  B  soak (--seconds, default 600): the same 16 real streams plus --hostile-workers (default 8)
     processes rotating over hostile requests: bodies just under and just over the body limit
     and of ~30 MB on every adapter route (Content-Length and chunked; a huge "word word ..."
     prompt, or a huge array in an unknown field), a /v1/responses input of 200,000 content
     parts, count_tokens over 5 and 31 MB of text, an unknown field of 2.8M zeros, malformed
     bodies (100k-deep nesting, invalid UTF-8, truncated JSON, a wrong content type, a false gzip
     Content-Encoding, UTF-16), 101+ headers, a duplicate Host, unknown routes, slowloris-style
     partial requests, and clients that disconnect mid-stream.

Measured per phase: the real streams' requests, status codes, per-token gaps (time between
consecutive content chunks; p50/p90/p99) and TTFT (p50/p99); hostile requests by case and status
code; 5xx answers (real and hostile); connection errors; the server's peak RSS (VmRSS read every
0.5 s; VmHWM at the end). Checks, printed PASS/FAIL and written to --out: no 5xx in phase B,
peak RSS under --rss-cap-mib or the RSS at ready plus --rss-growth-cap-mib (when given), phase B's p99 gap at most --max-gap-ratio (2.0) times
phase A's. Exit status 0 unless the server died (then 1): the report says pass or fail.

A hostile request's outcome is its status code, or how its connection ended: `abandoned` (a
slowloris case hung up by design), `closed_on_oversize` (the server closed while an over-limit
body was being sent: its 413 path, not an error), or a connection error (closed, reset, timeout,
refused). The hostile clients are processes of their own, so building and sending 30 MB bodies
does not hold the GIL the real streams' reader threads need; on a small machine they still share
the CPU with the server, which phase B's gaps include.

Run from the repository root (benches/soak.sh picks the test venv's python):
    benches/soak.sh                                   # about 12 minutes
    benches/soak.sh --baseline-seconds 15 --seconds 30 --bin target/debug/mlxhost
    benches/soak.sh --rss-cap-mib 2048 --server-arg='--memory-budget 4' --server-arg='--prompt-cache 0'
Standard library only.
"""
import argparse
import http.client
import json
import multiprocessing
import os
import queue
import re
import select
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from http_bench import stream_chat

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20
STREAMS = 16
ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
          "/v1/messages/count_tokens")
STREAM_ROUTES = ROUTES[:4]
PROMPTS = [
    "Write a haiku about the sea.", "Name three primary colors.", "What is the capital of France?",
    "Explain what a prime number is.", "Give me one tip for better sleep.", "Describe a cat in one sentence.",
    "What is 12 times 7?", "Suggest a name for a bakery.", "List two uses for a paperclip.",
    "Why is the sky blue?", "Write a limerick about a frog.", "What does a compiler do?",
    "Translate 'good morning' to Spanish.", "Tell me a fun fact about owls.", "How do plants make food?",
    "Summarize the plot of Cinderella.",
]
# Outcomes of a hostile request that are not status codes. The first two are by design.
ABANDONED = "abandoned"                    # a slowloris case closed its own connection unanswered
CLOSED_ON_OVERSIZE = "closed_on_oversize"  # closed while an over-limit body was sent: the 413 path
CONNECTION_ERRORS = ("closed", "reset", "timeout", "refused", "garbled")


# --------------------------------------------------------------------------------------------
# The server

class Server:
    """`mlxhost serve` in its own session (so a Ctrl-C meant for this script reaches it only as
    our SIGTERM), its output in a log file."""

    def __init__(self, binary, port, plugins, batch, extra, log_path):
        self.cmd = [str(binary), "serve", "--port", str(port), "--plugins", str(plugins),
                    "--batch", str(batch), *extra]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def alive(self):
        return self.proc.poll() is None

    def wait_healthy(self, timeout):
        """Polls GET /health until 200 (503 while the model loads)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"mlxhost serve exited {self.proc.returncode} while starting")
            if http_status(self.url, "/health") == 200:
                return
            time.sleep(0.2)
        raise RuntimeError(f"mlxhost serve not healthy after {timeout} s")

    def stop(self, timeout=60):
        """SIGTERM (a graceful drain: --shutdown-timeout), SIGKILL past `timeout`; the exit code."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode

    def log_tail(self, lines=30):
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])


def http_status(url, path):
    """Status of GET `url``path`, None when it cannot be asked."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_binary(given):
    if given:
        path = Path(given)
        if not path.is_file():
            raise SystemExit(f"soak: {path} not found")
        return path
    for build in ("release", "debug"):
        path = ROOT / "target" / build / "mlxhost"
        if path.is_file():
            return path
    raise SystemExit("soak: no target/release/mlxhost or target/debug/mlxhost; build one or pass --bin")


def proc_kib(pid, field):
    """A `VmRSS`-style field of /proc/<pid>/status in KiB; None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


class RssSampler(threading.Thread):
    """Reads the server's VmRSS every `interval` s; keeps every sample and each phase's peak."""

    def __init__(self, pid, interval=0.5):
        super().__init__(daemon=True)
        self.pid, self.interval = pid, interval
        self.phase = "startup"
        self.samples = []   # (seconds since start, phase, MiB)
        self.peak_mib = {}
        self.done = threading.Event()
        self.started_at = time.monotonic()

    def run(self):
        while not self.done.is_set():
            kib = proc_kib(self.pid, "VmRSS")
            if kib is None:
                return
            mib = kib / 1024
            self.samples.append((round(time.monotonic() - self.started_at, 1), self.phase, round(mib, 1)))
            self.peak_mib[self.phase] = max(self.peak_mib.get(self.phase, 0.0), mib)
            self.done.wait(self.interval)

    def stop(self):
        self.done.set()
        self.join(5)


# --------------------------------------------------------------------------------------------
# Real streams (threads of this process: they only read small SSE chunks)

def real_request(url, tag, prompt, timeout):
    """One streamed chat completion through http_bench.stream_chat; a record of how it went."""
    body = {"model": "default_model", "messages": [{"role": "user", "content": f"Request {tag}. {prompt}"}],
            "max_tokens": 64, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    times = []
    try:
        first, _, usage, chunks = stream_chat(url, body, times, timeout=timeout)
    except RuntimeError as e:  # stream_chat's non-200 answer: "URL: HTTP 503: ..."
        m = re.search(r"HTTP (\d{3})", str(e))
        return {"status": int(m.group(1))} if m else {"status": None, "error": "garbled"}
    except (OSError, http.client.HTTPException, ValueError) as e:
        return {"status": None, "error": error_kind(e)}
    return {
        "status": 200,
        "ttft_ms": first * 1e3 if first is not None else None,
        "gaps_ms": [(b - a) * 1e3 for a, b in zip(times, times[1:])],
        "tokens": (usage or {}).get("completion_tokens", chunks),
        # A stream that ends in an error event has no usage chunk (stream_chat skips the event).
        "incomplete": usage is None,
    }


def error_kind(e):
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, ConnectionRefusedError):
        return "refused"
    if isinstance(e, (ConnectionResetError, BrokenPipeError)):
        return "reset"
    if isinstance(e, (http.client.RemoteDisconnected, http.client.IncompleteRead)):
        return "closed"
    if isinstance(e, ValueError):
        return "garbled"
    return type(e).__name__


def real_worker(url, phase, idx, deadline, stop, records, timeout):
    """Streams back to back until the phase ends; every prompt is unique (no cached prefix)."""
    n = 0
    while time.monotonic() < deadline and not stop.is_set():
        tag = f"{phase}{idx}.{n}"
        record = real_request(url, tag, PROMPTS[(idx + n) % len(PROMPTS)], timeout)
        records.append(record)
        n += 1
        if record.get("error") == "refused":
            return  # nothing listens on loopback: the server is gone (the main loop reports it)


# --------------------------------------------------------------------------------------------
# Hostile requests, over raw sockets: httpx refuses to send most of them, and one code path
# classifies every case's outcome alike (a status code, or how the connection ended).

class Body:
    """A request body as `prefix + unit * count + suffix`, produced in ~1 MiB pieces so a 32 MiB
    body never sits in memory whole (8 worker processes send them at once)."""

    def __init__(self, prefix, unit=b"", count=0, suffix=b""):
        self.prefix, self.unit, self.count, self.suffix = prefix, unit, count, suffix
        self.length = len(prefix) + len(unit) * count + len(suffix)

    def pieces(self):
        yield self.prefix
        if self.count:
            per = max(1, MIB // len(self.unit))
            full, rest = divmod(self.count, per)
            block = self.unit * per
            for _ in range(full):
                yield block
            if rest:
                yield self.unit * rest
        yield self.suffix


def sized(prefix, unit, close, size):
    """A JSON body of exactly `size` bytes: `prefix`, `unit` repeated, `close`, then spaces (JSON
    whitespace) before the final `}` to make up the length."""
    count, pad = divmod(size - len(prefix) - len(close) - 1, len(unit))
    return Body(prefix, unit, count, close + b" " * pad + b"}")


def small_request(route, text="Hi", stream=False, max_tokens=16):
    """A small valid request of `route`'s dialect."""
    user = [{"role": "user", "content": text}]
    if route == "/v1/completions":
        body = {"model": "m", "prompt": text, "max_tokens": max_tokens}
    elif route == "/v1/responses":
        body = {"model": "m", "input": text, "max_output_tokens": max_tokens}
    elif route == "/v1/messages/count_tokens":
        body = {"model": "m", "messages": user}
    else:
        body = {"model": "m", "messages": user, "max_tokens": max_tokens}
    if stream:
        body["stream"] = True
    return body


def split_at(body, marker):
    """`body` as compact JSON bytes, split around the JSON string `marker` (kept out)."""
    before, after = json.dumps(body, separators=(",", ":")).encode().split(json.dumps(marker).encode())
    return before, after


def text_parts(route):
    """(prefix, close) around the prompt text of `route`'s valid request, for huge prompts."""
    before, after = split_at(small_request(route, "@@"), "@@")
    return before + b'"', b'"' + after[:-1]   # the final "}" goes after the padding


def frame(pieces, chunked):
    """The body on the wire: as is, or in HTTP/1.1 chunked transfer coding."""
    for piece in pieces:
        if not chunked:
            yield piece
        elif piece:
            yield b"%x\r\n%b\r\n" % (len(piece), piece)
    if chunked:
        yield b"0\r\n\r\n"


def request_head(port, method, path, *, length=None, chunked=False, ctype="application/json", headers=()):
    lines = [f"{method} {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", "Connection: close"]
    if path.startswith("/v1/messages"):
        lines.append("anthropic-version: 2023-06-01")
    if ctype:
        lines.append(f"Content-Type: {ctype}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    elif length is not None:
        lines.append(f"Content-Length: {length}")
    lines += headers
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def answered(sock):
    """Whether the server has said something (or closed) already."""
    return bool(select.select([sock], [], [], 0)[0])


def read_head(sock, timeout):
    """Reads the answer's head; (status code as a string, bytes read) or (how it ended, bytes)."""
    buf = b""
    deadline = time.monotonic() + timeout
    try:
        while b"\r\n\r\n" not in buf and len(buf) < MIB:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            data = sock.recv(65536)
            if not data:
                break
            buf += data
    except TimeoutError:
        if not buf:
            return "timeout", buf
    except (ConnectionResetError, BrokenPipeError):
        if not buf:
            return "reset", buf
    m = re.match(rb"HTTP/1\.[01] (\d{3})", buf)
    if m:
        return m.group(1).decode(), buf
    return ("garbled" if buf else "closed"), buf


def connect(port, timeout):
    return socket.create_connection(("127.0.0.1", port), timeout=timeout)


def exchange(port, head, body, *, chunked=False, limit=None, timeout=120.0):
    """Sends one request and returns its outcome: the status code, or how the connection ended.
    Like curl, it stops sending once the server answered (a 413 before the body was read)."""
    try:
        sock = connect(port, timeout)
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "timeout"
    read_timeout = timeout
    with sock:
        try:
            sock.sendall(head)
            for piece in frame(body.pieces() if body else (), chunked):
                if answered(sock):
                    break
                sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            read_timeout = 5.0  # it stopped reading: an answer, if any, is already on its way
        outcome, _ = read_head(sock, read_timeout)
    if limit is not None and body is not None and body.length > limit and outcome in ("closed", "reset"):
        # The server refused the body and closed while we sent it; the reset can discard its 413.
        return CLOSED_ON_OVERSIZE
    return outcome


def disconnect_mid_stream(port, route, rst, timeout):
    """Starts a real stream, reads three events, then drops the connection (FIN, or RST)."""
    body = json.dumps(small_request(route, "Tell me a long story about a dragon.", stream=True, max_tokens=256)).encode()
    try:
        sock = connect(port, timeout)
    except OSError as e:
        return error_kind(e)
    with sock:
        sock.sendall(request_head(port, "POST", route, length=len(body)) + body)
        status, buf = read_head(sock, timeout)
        deadline = time.monotonic() + timeout
        try:
            while status == "200" and buf.count(b"data:") < 3 and time.monotonic() < deadline:
                sock.settimeout(max(0.01, deadline - time.monotonic()))
                data = sock.recv(65536)
                if not data:
                    break
                buf += data
        except OSError:
            pass
        if rst:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    return status


def abandon(port, head, partial, hold):
    """Slowloris-ish: sends `head` and part of a body, waits `hold` s, closes without finishing.
    An answer within `hold` (a timeout, a refusal) is the outcome instead."""
    try:
        sock = connect(port, 30)
    except OSError as e:
        return error_kind(e)
    with sock:
        try:
            sock.sendall(head)
            for piece in partial:
                sock.sendall(piece)
        except OSError:
            return read_head(sock, 5)[0]
        if select.select([sock], [], [], hold)[0]:
            outcome, _ = read_head(sock, 5)
            return ABANDONED if outcome == "closed" else outcome
    return ABANDONED


def hostile_families(port, limit, timeout):
    """{family: [(case name, run() -> outcome)]}: every hostile case, grouped so that a rotation
    over families gives each kind of abuse the same share of turns, however many variants."""

    def post(path, body, *, chunked=False, ctype="application/json", headers=(), method="POST"):
        body = Body(body) if isinstance(body, bytes) else body
        head = request_head(port, method, path, length=body.length if body else None, chunked=chunked,
                            ctype=ctype if body else None, headers=headers)
        return lambda: exchange(port, head, body, chunked=chunked, limit=limit, timeout=timeout)

    fams = {}

    big = fams["big-body"] = []
    sizes = {"under-limit": limit - 1, "over-limit": limit + 1, "30MB": 30_000_000}
    for route in ROUTES:
        kinds = {"text": text_parts(route), "unknown-array": (b'{"x":[', b"0]")}
        for kind, (prefix, close) in kinds.items():
            unit = b"word " if kind == "text" else b"0,"
            for size_name, size in sizes.items():
                for chunked in (False, True):
                    name = f"{route} {kind} {size_name} {'chunked' if chunked else 'length'}"
                    big.append((name, post(route, sized(prefix, unit, close, size), chunked=chunked)))

    before, after = split_at({"model": "m", "max_output_tokens": 16, "input": [{"role": "user", "content": "@@"}]}, "@@")
    part = b'{"type":"input_text","text":"hi"}'
    parts = Body(before + b"[", part + b",", 199_999, part + b"]" + after)
    fams["responses-200k-parts"] = [(f"/v1/responses 200k parts {f}", post("/v1/responses", parts, chunked=f == "chunked"))
                                    for f in ("length", "chunked")]

    prefix, close = text_parts("/v1/messages/count_tokens")
    fams["count-tokens-big"] = [(f"/v1/messages/count_tokens {mb} MB text",
                                 post("/v1/messages/count_tokens", sized(prefix, b"word ", close, mb * 1_000_000)))
                                for mb in (5, 31)]

    before, after = split_at({**small_request("/v1/chat/completions"), "x": "@@"}, "@@")
    zeros = Body(before + b"[", b"0,", 2_799_999, b"0]" + after)
    fams["chat-unknown-x-2.8M"] = [("/v1/chat/completions x=[0]*2800000", post("/v1/chat/completions", zeros))]

    fams["malformed"] = malformed_cases(post)
    fams["headers"] = header_cases(port, post)
    fams["unknown-route"] = [
        (f"{m} {p}", post(p, b'{"model":"m"}' if m in ("POST", "PUT") else None, method=m))
        for m, p in [("POST", "/v1/messages/foo"), ("GET", "/v1/messages/foo"), ("POST", "/v1/chat/completions/x"),
                     ("POST", "/v2/chat/completions"), ("GET", "/v1/responses/resp_doesnotexist"),
                     ("DELETE", "/v1/responses/resp_doesnotexist"), ("POST", "/v1/responses/resp_x/cancel"),
                     ("GET", "/v1/messages"), ("PUT", "/v1/chat/completions"), ("POST", "/%ff%fe/..%2f..%2fetc")]]
    fams["slowloris"] = slowloris_cases(port)
    fams["disconnect-mid-stream"] = [
        (f"{route} {'RST' if rst else 'FIN'}", (lambda route=route, rst=rst: disconnect_mid_stream(port, route, rst, timeout)))
        for route in STREAM_ROUTES for rst in (False, True)]
    return fams


def malformed_cases(post):
    cases = []
    for route in ROUTES:
        valid = json.dumps(small_request(route)).encode()
        prefix, close = text_parts(route)
        variants = {
            "nested-100k-open": b"[" * 100_000,
            "nested-100k-unknown-field": b'{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}",
            "invalid-utf8": prefix + b"Hi \xff\xfe\xc3\x28" + close + b"}",
            "truncated": valid[: len(valid) // 2],
            "empty": b"",
        }
        cases += [(f"{route} {name}", post(route, body)) for name, body in variants.items()]
        cases += [
            (f"{route} text/plain", post(route, valid, ctype="text/plain")),
            (f"{route} gzip-not-gzip", post(route, valid, headers=["Content-Encoding: gzip"])),
            (f"{route} utf-16", post(route, valid.decode().encode("utf-16"), ctype="application/json; charset=utf-16")),
        ]
    return cases


def header_cases(port, post):
    route = "/v1/chat/completions"
    valid = json.dumps(small_request(route)).encode()
    return [
        ("101 headers", post(route, valid, headers=[f"x-h{i}: v" for i in range(101)])),
        ("150 headers", post(route, valid, headers=[f"x-h{i}: v" for i in range(150)])),
        ("duplicate Host (foreign)", post(route, valid, headers=["Host: evil.example"])),
        ("duplicate Host (same)", post(route, valid, headers=[f"Host: 127.0.0.1:{port}"])),
        ("conflicting Content-Length", post(route, valid, headers=[f"Content-Length: {len(valid) + 7}"])),
        ("Content-Length and chunked", post(route, valid, chunked=True, headers=[f"Content-Length: {len(valid)}"])),
    ]


def slowloris_cases(port):
    route = "/v1/chat/completions"
    some = b'{"messages":[{"role":"user","content":"' + b"a" * 64
    head = request_head(port, "POST", route)
    return [
        ("partial head", lambda: abandon(port, head[:-4] + b"\r\nx-slow: 1", [], 2.0)),
        ("partial body (Content-Length)", lambda: abandon(port, request_head(port, "POST", route, length=4096), [some], 2.0)),
        ("partial body (chunked)", lambda: abandon(port, request_head(port, "POST", route, chunked=True), [b"1000\r\n" + some], 2.0)),
        ("5 MB of a declared 30 MB body", lambda: abandon(
            port, request_head(port, "POST", route, length=30_000_000), Body(some, b"word ", 1_000_000).pieces(), 1.0)),
    ]


def hostile_worker(idx, workers, port, limit, timeout, deadline, stop, out, nice):
    """One hostile client process (its own GIL, so building and sending 30 MB bodies does not
    delay the real streams' reader threads). Rotates over families; in each family over cases,
    each worker from its own starting point. Puts one record per request on `out`."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and stops us
    # On one small machine the clients share the server's cores; a hostile client elsewhere
    # costs the server only what it sends. Lowering the clients' priority (--hostile-nice)
    # keeps the measurement about the server's own handling of the mix.
    os.nice(nice)
    fams = hostile_families(port, limit, timeout)
    names = sorted(fams)
    pos = {f: idx * len(fams[f]) // workers for f in names}
    turn = idx
    while time.time() < deadline and not stop.is_set():
        family = names[turn % len(names)]
        turn += 1
        name, run = fams[family][pos[family] % len(fams[family])]
        pos[family] += 1
        started = time.monotonic()
        try:
            outcome = run()
        except Exception as e:  # a bug in a case must not end the soak; it shows in the report
            outcome = f"client-error:{type(e).__name__}"
        out.put({"family": family, "case": name, "outcome": outcome,
                 "seconds": round(time.monotonic() - started, 3)})
        if outcome == "refused":
            return  # the server is gone: stop rather than spin on refused connections


# --------------------------------------------------------------------------------------------
# Phases

def run_phase(name, server, port, args, sampler, hostile, raw):
    """Runs the real streams (and, with `hostile`, the hostile workers) for the phase's length;
    puts the raw records in `raw[name]` as they come, so an interrupted phase is still reported."""
    seconds = args.seconds if hostile else args.baseline_seconds
    print(f"# phase {name}: {seconds} s, {STREAMS} real streams"
          + (f" + {args.hostile_workers} hostile workers" if hostile else ""), file=sys.stderr, flush=True)
    sampler.phase = name
    started = time.monotonic()
    deadline = started + seconds
    stop = threading.Event()
    real, procs, hostile_records = [], [], []
    result = raw[name] = {"seconds": None, "real": real, "hostile": hostile_records}
    if hostile:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process running threads
        out, mp_stop = ctx.Queue(), ctx.Event()
        wall_deadline = time.time() + seconds
        procs = [ctx.Process(target=hostile_worker, daemon=True,
                             args=(i, args.hostile_workers, port, args.body_limit_mib * MIB,
                                   args.hostile_timeout, wall_deadline, mp_stop, out, args.hostile_nice))
                 for i in range(args.hostile_workers)]
        for p in procs:
            p.start()
    threads = [threading.Thread(target=real_worker, daemon=True,
                                args=(server.url, name, i, deadline, stop, real, args.stream_timeout))
               for i in range(STREAMS)]
    for t in threads:
        t.start()
    try:
        while time.monotonic() < deadline and server.alive():
            drain(out if hostile else None, hostile_records, 0.5)
            report_progress(name, started, seconds, real, hostile_records)
    finally:
        # The server died or the phase ended: stop starting requests; the running ones end
        # within their timeouts.
        stop.set()
        if hostile:
            mp_stop.set()
            wait_hostile(procs, out, hostile_records, args.hostile_timeout + 30)
        for t in threads:
            t.join(args.stream_timeout + 5)
        result["seconds"] = round(time.monotonic() - started, 1)


def drain(out, records, wait):
    """Moves the hostile records off the queue (a full queue would block the workers)."""
    if out is None:
        time.sleep(wait)
        return
    try:
        records.append(out.get(timeout=wait))
        while True:
            records.append(out.get_nowait())
    except queue.Empty:
        pass


def wait_hostile(procs, out, records, grace):
    """Lets the hostile workers finish the request each has running (bounded by its timeout)."""
    deadline = time.monotonic() + grace
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        drain(out, records, 0.5)
    for p in procs:
        if p.is_alive():
            p.terminate()
        p.join(5)
    drain(out, records, 0.1)


_last_progress = [0.0]


def report_progress(name, started, seconds, real, hostile):
    """A line every 10 s on stderr, so a long soak shows it is moving."""
    now = time.monotonic()
    if now - _last_progress[0] < 10:
        return
    _last_progress[0] = now
    fives = sum(1 for r in real if (r.get("status") or 0) >= 500) + sum(1 for h in hostile if is_5xx(h["outcome"]))
    print(f"#   {name}: {now - started:5.0f}/{seconds} s, {len(real)} real, {len(hostile)} hostile, {fives} 5xx",
          file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# Report

def pct(values, p):
    """Nearest-rank percentile; None for no values."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, -(-len(v) * p // 100) - 1))]


def is_5xx(outcome):
    return outcome.isdigit() and outcome.startswith("5")


def summarize_real(records):
    statuses = Counter(str(r["status"]) if r["status"] is not None else r["error"] for r in records)
    ok = [r for r in records if r["status"] == 200]
    gaps = [g for r in ok for g in r["gaps_ms"]]
    ttfts = [r["ttft_ms"] for r in ok if r["ttft_ms"] is not None]
    r2 = lambda x: None if x is None else round(x, 2)  # noqa: E731
    return {
        "requests": len(records),
        "statuses": dict(statuses),
        "5xx": sum(n for s, n in statuses.items() if is_5xx(s)),
        "other_non_200": sum(n for s, n in statuses.items() if s.isdigit() and s != "200" and not is_5xx(s)),
        "connection_errors": {s: n for s, n in statuses.items() if not s.isdigit()},
        "incomplete_streams": sum(1 for r in ok if r["incomplete"]),
        "tokens": sum(r["tokens"] or 0 for r in ok),
        "gaps": len(gaps),
        "gap_ms": {"p50": r2(pct(gaps, 50)), "p90": r2(pct(gaps, 90)), "p99": r2(pct(gaps, 99)), "max": r2(max(gaps, default=None))},
        "ttft_ms": {"p50": r2(pct(ttfts, 50)), "p99": r2(pct(ttfts, 99))},
    }


def summarize_hostile(records):
    by_family, by_case = {}, {}
    for r in records:
        by_family.setdefault(r["family"], Counter())[r["outcome"]] += 1
        by_case.setdefault(r["case"], Counter())[r["outcome"]] += 1
    outcomes = Counter(r["outcome"] for r in records)
    return {
        "requests": len(records),
        "statuses": dict(outcomes),
        "5xx": sum(n for s, n in outcomes.items() if is_5xx(s)),
        "connection_errors": {s: n for s, n in outcomes.items() if s in CONNECTION_ERRORS or s.startswith("client-error")},
        "closed_on_oversize": outcomes.get(CLOSED_ON_OVERSIZE, 0),
        "abandoned_by_design": outcomes.get(ABANDONED, 0),
        "by_family": {f: {"requests": sum(c.values()), "statuses": dict(c)} for f, c in sorted(by_family.items())},
        "by_case": {k: dict(c) for k, c in sorted(by_case.items())},
        "5xx_cases": {k: {s: n for s, n in c.items() if is_5xx(s)} for k, c in sorted(by_case.items())
                      if any(is_5xx(s) for s in c)},
        "slowest_s": max((r["seconds"] for r in records), default=None),
    }


def summarize_phase(raw, peak_mib):
    real = summarize_real(raw["real"])
    hostile = summarize_hostile(raw["hostile"])
    return {"seconds": raw["seconds"], "real": real, "hostile": hostile,
            "5xx_total": real["5xx"] + hostile["5xx"],
            "peak_rss_mib": None if peak_mib is None else round(peak_mib, 1)}


def checks(report, args):
    a, b = report["phases"].get("A"), report["phases"].get("B")
    out = []
    if b is None:
        out.append(("0 5xx in phase B", False, "phase B did not run"))
    else:
        out.append(("0 5xx in phase B", b["5xx_total"] == 0,
                     f"{b['5xx_total']} (real {b['real']['5xx']}, hostile {b['hostile']['5xx']})"))
    peaks = [p["peak_rss_mib"] for p in report["phases"].values() if p["peak_rss_mib"] is not None]
    peak = max(peaks, default=None)
    cap = args.rss_cap_mib
    if args.rss_growth_cap_mib is not None and report.get("rss_startup_mib") is not None:
        grown_cap = report["rss_startup_mib"] + args.rss_growth_cap_mib
        cap = grown_cap if cap is None else min(cap, grown_cap)
    if cap is None:
        out.append(("peak RSS (no cap: --rss-cap-mib / --rss-growth-cap-mib)", None, f"{peak} MiB"))
    else:
        out.append((f"peak RSS under {round(cap, 1)} MiB", peak is not None and peak < cap, f"{peak} MiB"))
    ratio = report.get("p99_gap_ratio")
    out.append((f"p99 gap ratio B/A <= {args.max_gap_ratio}", ratio is not None and ratio <= args.max_gap_ratio,
                f"{ratio}" if ratio is not None else "not measured"))
    return [{"check": c, "pass": p, "value": v} for c, p, v in out]


def print_phase(name, p):
    r, h = p["real"], p["hostile"]
    print(f"phase {name} ({p['seconds']} s):")
    print(f"  real streams: {r['requests']} requests, {r['tokens']} tokens; statuses {r['statuses']}; "
          f"5xx {r['5xx']}, other non-200 {r['other_non_200']}, connection errors {r['connection_errors'] or 0}, "
          f"incomplete streams {r['incomplete_streams']}")
    g, t = r["gap_ms"], r["ttft_ms"]
    print(f"  per-token gap ms: p50 {g['p50']}  p90 {g['p90']}  p99 {g['p99']}  max {g['max']}  ({r['gaps']} gaps); "
          f"TTFT ms: p50 {t['p50']}  p99 {t['p99']}")
    if h["requests"]:
        print(f"  hostile: {h['requests']} requests; 5xx {h['5xx']}; connection errors {h['connection_errors'] or 0}; "
              f"closed on an over-limit body {h['closed_on_oversize']}; abandoned by design {h['abandoned_by_design']}; "
              f"slowest {h['slowest_s']} s")
        for fam, c in h["by_family"].items():
            hist = " ".join(f"{s}:{n}" for s, n in sorted(c["statuses"].items()))
            print(f"    {fam:24} {c['requests']:6}  {hist}")
        for case, c in h["5xx_cases"].items():
            print(f"    5xx: {case}: " + " ".join(f"{s} x{n}" for s, n in sorted(c.items())))
        odd = [(k, v) for k, v in h["by_case"].items() if any(s in CONNECTION_ERRORS or s.startswith("client-error") for s in v)]
        for case, c in odd[:20]:
            print(f"    connection error: {case}: " + " ".join(f"{s}:{n}" for s, n in sorted(c.items())))
        if len(odd) > 20:
            print(f"    ... {len(odd) - 20} more cases with connection errors (by_case in the JSON report)")
    print(f"  5xx total: {p['5xx_total']}; peak RSS {p['peak_rss_mib']} MiB")


def print_report(report):
    print(f"\n== mlxhost soak: {' '.join(report['server']['cmd'])}")
    print(f"   RSS at startup {report['rss_startup_mib']} MiB, VmHWM at the end {report['vmhwm_mib']} MiB")
    for name, p in report["phases"].items():
        print_phase(name, p)
    print(f"p99 gap ratio B/A: {report['p99_gap_ratio']}")
    for c in report["checks"]:
        verdict = {True: "PASS", False: "FAIL", None: "INFO"}[c["pass"]]
        print(f"{verdict}: {c['check']}: {c['value']}")
    if report["server"]["died"]:
        print(f"SERVER DIED (exit code {report['server']['exit_code']}); log {report['server']['log']}:\n"
              f"{report['server']['log_tail']}")
    if report.get("interrupted"):
        print("INTERRUPTED: the report covers what ran")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", help="mlxhost binary (default target/release/mlxhost, else target/debug/mlxhost)")
    ap.add_argument("--plugins", default=str(ROOT / "plugins"), help="plugins directory (default plugins)")
    ap.add_argument("--batch", type=int, default=16, help="the server's --batch (default 16)")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="more `serve` arguments, shell-split: --server-arg='--memory-budget 4' (repeatable)")
    ap.add_argument("--baseline-seconds", type=float, default=120, help="phase A length (default 120)")
    ap.add_argument("--seconds", type=float, default=600, help="phase B length (default 600)")
    ap.add_argument("--hostile-workers", type=int, default=8, help="hostile client processes (default 8)")
    ap.add_argument("--hostile-nice", type=int, default=19,
                    help="niceness of the hostile client processes (default 19: on one machine they share "
                         "the server's cores; a remote hostile client would not)")
    ap.add_argument("--hostile-timeout", type=float, default=120, help="per hostile request socket wait, s (default 120)")
    ap.add_argument("--stream-timeout", type=float, default=120, help="per real-stream socket wait, s (default 120)")
    ap.add_argument("--body-limit-mib", type=int, default=32, help="the server's --body-limit, for the just under/over sizes (default 32)")
    ap.add_argument("--rss-cap-mib", type=float, help="peak RSS must stay under this (default: no check)")
    ap.add_argument("--rss-growth-cap-mib", type=float,
                    help="peak RSS must stay under the RSS at ready plus this (docs/configuration.md, "
                         "'Memory bound': the flags' terms above the ready process)")
    ap.add_argument("--max-gap-ratio", type=float, default=2.0, help="most phase B / phase A p99 gap (default 2.0)")
    ap.add_argument("--startup-timeout", type=float, default=300, help="wait for /health 200, s (default 300)")
    ap.add_argument("--log", help="server log file (default a temporary file)")
    ap.add_argument("--out", default="soak.json", help="JSON report (default soak.json)")
    return ap.parse_args()


def raise_interrupt(*_):
    raise KeyboardInterrupt


def main():
    args = parse_args()
    binary = find_binary(args.bin)
    port = free_port()
    extra = [a for s in args.server_arg for a in shlex.split(s)]
    log = args.log or tempfile.mkstemp(prefix="mlxhost-soak-", suffix=".log")[1]
    server = Server(binary, port, args.plugins, args.batch, extra, log)
    signal.signal(signal.SIGTERM, raise_interrupt)  # so `finally` stops the server
    sampler = RssSampler(server.proc.pid)
    report = {"server": {"cmd": server.cmd, "log": log}, "config": vars(args), "phases": {},
              "rss_startup_mib": None, "vmhwm_mib": None}
    raw = {}
    try:
        print(f"# starting {' '.join(server.cmd)} (log {log})", file=sys.stderr, flush=True)
        server.wait_healthy(args.startup_timeout)
        report["rss_startup_mib"] = round((proc_kib(server.proc.pid, "VmRSS") or 0) / 1024, 1)
        sampler.start()
        run_phase("A", server, port, args, sampler, False, raw)
        if server.alive():
            run_phase("B", server, port, args, sampler, True, raw)
        hwm = proc_kib(server.proc.pid, "VmHWM")
        report["vmhwm_mib"] = None if hwm is None else round(hwm / 1024, 1)
    except KeyboardInterrupt:
        report["interrupted"] = True
    except RuntimeError as e:  # the server did not come up
        print(f"soak: {e}", file=sys.stderr)
    finally:
        if sampler.is_alive():
            sampler.stop()
        died = not server.alive()
        code = server.stop()
    report["server"].update(died=died, exit_code=code if died else None, log_tail=server.log_tail() if died else None)
    for name, r in raw.items():
        report["phases"][name] = summarize_phase(r, sampler.peak_mib.get(name))
    gaps = [report["phases"].get(p, {}).get("real", {}).get("gap_ms", {}).get("p99") for p in "AB"]
    report["p99_gap_ratio"] = round(gaps[1] / gaps[0], 3) if None not in gaps and gaps[0] > 0 else None
    report["checks"] = checks(report, args)
    report["rss_samples"] = sampler.samples
    print_report(report)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"(report written to {args.out})")
    return 1 if died else 0


if __name__ == "__main__":
    sys.exit(main())
