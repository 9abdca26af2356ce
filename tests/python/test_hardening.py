"""Serving hardening, as a hostile or careless client meets it: API keys,
browser safety (content type, Host, Origin, CORS), header and body read
timeouts, per-request limits, the whole-request timeout, memory-budget
admission, refused starts that exit 1, and Prometheus metrics."""

import os
import socket
import stat
import threading
import time
from urllib.parse import urlparse

import anthropic
import httpx
import openai
import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from conftest import Server, chat, run_binary

HI = {"messages": chat("Hi"), "max_tokens": 2, "temperature": 0}


def openai_error(r, status):
    assert r.status_code == status, (r.status_code, r.text)
    err = r.json()["error"]
    assert err["message"], err
    return err


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# team keys\n\nfile-key\n")
    s = Server("--api-key", "k1", "--api-key-file", str(keys))
    yield s
    s.stop()


def test_api_keys_are_required_in_either_header_style(keyed):
    with keyed.http() as h:
        r = h.post("/v1/chat/completions", json=HI)
        err = openai_error(r, 401)
        assert "API key" in err["message"]
        assert r.headers["www-authenticate"] == "Bearer"
        assert openai_error(h.post("/v1/chat/completions", json=HI, headers={"authorization": "Bearer nope"}), 401)
        assert h.post("/v1/chat/completions", json=HI, headers={"authorization": "Bearer k1"}).status_code == 200
        assert h.post("/v1/chat/completions", json=HI, headers={"x-api-key": "file-key"}).status_code == 200
        # Anthropic clients send x-api-key; refusals come in Anthropic's shape.
        body = {"model": "m", "max_tokens": 2, "messages": chat("Hi")}
        r = h.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
        assert r.status_code == 401 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "authentication_error", r.text


def test_health_is_open_while_stats_and_metrics_need_the_key(keyed):
    with keyed.http() as h:
        assert h.get("/health").status_code == 200
        for path in ("/stats", "/metrics"):
            assert h.get(path).status_code == 401, path
            assert h.get(path, headers={"authorization": "Bearer k1"}).status_code == 200, path


def test_the_official_sdks_pass_their_keys(keyed):
    c = openai.OpenAI(base_url=keyed.url + "/v1", api_key="k1", max_retries=0)
    assert c.chat.completions.create(model="m", **HI).choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0).chat.completions.create(
            model="m", **HI
        )
    a = anthropic.Anthropic(base_url=keyed.url, api_key="file-key", max_retries=0)
    msg = a.messages.create(model="m", max_tokens=2, messages=chat("Hi"))
    assert msg.stop_reason in ("end_turn", "max_tokens")
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=keyed.url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=2, messages=chat("Hi")
        )


def test_a_text_plain_or_form_post_is_refused(server, http):
    for ctype, data in [("text/plain", '{"messages":[{"role":"user","content":"Hi"}]}'), ("application/x-www-form-urlencoded", "a=b")]:
        r = http.post("/v1/chat/completions", content=data, headers={"content-type": ctype})
        err = openai_error(r, 415)
        assert ctype in err["message"]
    # JSON with a charset is JSON.
    r = http.post(
        "/v1/chat/completions",
        content=httpx.Request("POST", "/", json=HI).content,
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert r.status_code == 200, r.text


def test_a_foreign_host_or_origin_is_refused_on_a_loopback_bind(server, http):
    port = urlparse(server.url).port
    r = http.post("/v1/chat/completions", json=HI, headers={"host": f"evil.example:{port}"})
    assert "evil.example" in openai_error(r, 403)["message"]
    assert http.post("/v1/chat/completions", json=HI, headers={"host": f"localhost:{port}"}).status_code == 200
    r = http.post("/v1/chat/completions", json=HI, headers={"origin": "https://evil.example"})
    assert "origin" in openai_error(r, 403)["message"]
    # A CORS preflight from a page is refused too (CORS is off by default).
    r = http.options(
        "/v1/chat/completions",
        headers={"origin": "https://evil.example", "access-control-request-method": "POST"},
    )
    assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_allowed_origins_get_correct_preflights():
    s = Server("--allowed-origins", "https://app.example")
    try:
        with s.http() as h:
            r = h.options(
                "/v1/chat/completions",
                headers={
                    "origin": "https://app.example",
                    "access-control-request-method": "POST",
                    "access-control-request-headers": "content-type,authorization",
                },
            )
            assert r.status_code == 200, r.text
            assert r.headers["access-control-allow-origin"] == "https://app.example"
            assert "POST" in r.headers["access-control-allow-methods"]
            assert "content-type" in r.headers["access-control-allow-headers"].lower()
            r = h.post("/v1/chat/completions", json=HI, headers={"origin": "https://app.example"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
            assert h.post("/v1/chat/completions", json=HI, headers={"origin": "https://other.example"}).status_code == 403
    finally:
        s.stop()


def test_limits_on_counts_and_sizes_are_400s_naming_the_field(server, http):
    r = http.post("/v1/chat/completions", json={**HI, "logits_processors": [{"name": "penalties"}] * 300})
    assert openai_error(r, 400)["param"] == "logits_processors"
    r = http.post("/v1/chat/completions", json={**HI, "stop": [f"s{i}" for i in range(100)]})
    assert openai_error(r, 400)["param"] == "stop"
    r = http.get("/v1/models?" + "a" * 10_000)
    assert openai_error(r, 414)
    r = http.post("/v1/chat/completions", json=HI, headers={"x-big": "b" * 100_000})
    assert openai_error(r, 431)
    r = http.post("/health", json={})
    assert r.status_code == 405 and r.headers["allow"] and r.json()["error"]["message"]
    assert http.get("/health").status_code == 200


@pytest.fixture(scope="module")
def strict():
    s = Server(
        "--header-timeout", "2", "--body-timeout", "2", "--request-timeout", "3",
        "--memory-budget", "0.05", "--batch", "1", "--max-queue", "1",
    )
    yield s
    s.stop()


def raw_connection(server):
    u = urlparse(server.url)
    return socket.create_connection((u.hostname, u.port), timeout=30)


def closed_within(sock, seconds):
    """Seconds until the server closed `sock` (None if it stayed open)."""
    started = time.time()
    sock.settimeout(0.2)
    while time.time() - started < seconds:
        try:
            if sock.recv(4096) == b"":
                return time.time() - started
        except socket.timeout:
            continue
        except ConnectionResetError:
            return time.time() - started
    return None


def test_a_slow_header_client_is_dropped_while_others_are_served(strict):
    sock = raw_connection(strict)
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
    served = {}

    def other():
        with strict.http() as h:
            served["status"] = h.post("/v1/chat/completions", json=HI).status_code

    t = threading.Thread(target=other)
    t.start()
    # Trickle header bytes: each arrives before the timeout, the whole head never does.
    for _ in range(3):
        time.sleep(0.5)
        try:
            sock.sendall(b"x-slow: 1\r\n")
        except OSError:
            break
    closed = closed_within(sock, 8)
    t.join(60)
    assert served.get("status") == 200
    assert closed is not None, "the slow client is still connected"
    sock.close()


def test_an_idle_keep_alive_connection_is_closed(strict):
    sock = raw_connection(strict)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert sock.recv(4096).startswith(b"HTTP/1.1 200")
    assert closed_within(sock, 8) is not None
    sock.close()


def test_a_body_shorter_than_its_length_gets_408(strict):
    sock = raw_connection(strict)
    sock.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
        b"content-length: 100\r\n\r\n{\"messages\":"
    )
    sock.settimeout(10)
    started = time.time()
    head = sock.recv(65536).decode(errors="replace")
    assert head.startswith("HTTP/1.1 408"), head
    assert time.time() - started < 8
    assert '"error"' in head
    sock.close()


def test_the_request_timeout_stops_a_long_generation(strict):
    with strict.http() as h:
        cancelled = ("mlxhost_generations_total", (("finish_reason", "cancelled"),))
        before = metrics(h).get(cancelled, 0)
        started = time.time()
        r = h.post("/v1/chat/completions", json={"messages": chat("Tell a long story."), "max_tokens": 1000, "temperature": 0})
        # 1000 tokens fit the memory budget (~46 KB of float32 KV per token) but not 3 seconds of
        # this CPU's decode (~125 tok/s at best).
        err = openai_error(r, 504)
        assert "--request-timeout" in err["message"]
        assert time.time() - started < 30
        # Streamed: the stream ends with an error event instead.
        with h.stream(
            "POST", "/v1/chat/completions",
            json={"messages": chat("Tell a long story."), "max_tokens": 1000, "temperature": 0, "stream": True},
        ) as s:
            lines = [l for l in s.iter_lines() if l.startswith("data: ")]
        assert "--request-timeout" in lines[-1] or "--request-timeout" in lines[-2], lines[-3:]
        assert h.post("/v1/chat/completions", json=HI).status_code == 200
        # Both stopped generations are counted, with their tokens.
        assert metrics(h)[cancelled] == before + 2


def test_a_prompt_over_the_memory_budget_is_a_400_and_the_next_succeeds(strict):
    with strict.http() as h:
        # ~2k prompt tokens: more KV than the 0.05 GiB budget holds at SmolLM2's 46 KB a token.
        r = h.post("/v1/chat/completions", json={"messages": chat("word " * 2000), "max_tokens": 2})
        err = openai_error(r, 400)
        assert "--memory-budget" in err["message"] and "prompt" in err["message"], err
        assert h.post("/v1/chat/completions", json=HI).status_code == 200


def test_a_full_queue_answers_503_with_retry_after(strict):
    results = []

    def long_one():
        with strict.http() as h:
            # Longer than the strict server's 3 s request timeout at any speed we reach, so
            # the queue stays full while the loop below asks.
            results.append(h.post("/v1/chat/completions", json={"messages": chat("Tell a story."), "max_tokens": 1000, "temperature": 0}).status_code)

    threads = [threading.Thread(target=long_one) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.3)
    with strict.http() as h:
        deadline = time.time() + 10
        r = None
        while time.time() < deadline:
            r = h.post("/v1/chat/completions", json=HI)
            if r.status_code == 503:
                break
            time.sleep(0.05)
        assert r is not None and r.status_code == 503, r and r.text
        assert r.headers["retry-after"] == "1"
    for t in threads:
        t.join(120)


def metrics(h):
    r = h.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_parse_and_move_with_traffic(server, http):
    before = metrics(http)
    r = http.post("/v1/chat/completions", json={"messages": chat("Say hello."), "max_tokens": 5, "temperature": 0})
    assert r.status_code == 200
    used = r.json()["usage"]
    after = metrics(http)
    ok = ("mlxhost_http_requests_total", (("method", "POST"), ("route", "/v1/chat/completions"), ("status", "200")))
    assert after[ok] == before.get(ok, 0) + 1
    for name, moved in [
        ("mlxhost_completion_tokens_total", used["completion_tokens"]),
        ("mlxhost_prompt_tokens_total", used["prompt_tokens"]),
        ("mlxhost_time_to_first_token_seconds_count", 1),
    ]:
        assert after[(name, ())] == before.get((name, ()), 0) + moved, name
    assert after[("mlxhost_engine_steps_total", ())] > before.get(("mlxhost_engine_steps_total", ()), 0)
    calls = [k for k in after if k[0] == "mlxhost_plugin_calls_total"]
    assert calls, sorted(after)[:40]
    assert ("mlxhost_cache_bytes", (("tier", "ram"),)) in after


def make_unusable_cache(kind, root):
    path = root / kind
    if kind == "world-writable":
        path.mkdir()
        os.chmod(path, 0o777)
    elif kind == "regular-file":
        path.write_text("not a folder")
    return path


@pytest.mark.parametrize("kind", ["world-writable", "regular-file"])
def test_a_refused_start_always_exits_1(tmp_path, kind):
    path = make_unusable_cache(kind, tmp_path)
    for _ in range(20):
        r = run_binary("serve", "--port", "0", "--ssd-cache", str(path), timeout=120)
        assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
        assert "--ssd-cache" in r.stderr, r.stderr[-2000:]
        assert "corrupted" not in r.stderr and "serving" not in r.stderr


def test_a_cache_held_by_another_server_refuses_the_start_before_loading(tmp_path):
    cache = tmp_path / "ssd"
    s = Server("--ssd-cache", str(cache))
    try:
        for _ in range(20):
            started = time.time()
            r = run_binary("serve", "--port", "0", "--ssd-cache", str(cache), timeout=120)
            assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
            assert "another mlxhost server" in r.stderr, r.stderr[-2000:]
            assert "loading" not in r.stderr.lower() or time.time() - started < 5
    finally:
        s.stop()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def test_a_model_that_fails_to_load_exits_1(tmp_path):
    broken = tmp_path / "broken.gguf"
    with open(Server.default_model(), "rb") as f:
        broken.write_bytes(f.read(4 << 20))
    for _ in range(5):
        r = run_binary("serve", "--port", "0", "--model", str(broken), "--plugins", str(tmp_path), timeout=120)
        assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
        assert "error:" in r.stderr


@pytest.fixture(scope="module")
def chatty():
    s = Server("--sse-keep-alive", "1")
    yield s
    s.stop()


@pytest.mark.parametrize(
    "path,body,keep_alive",
    [
        ("/v1/chat/completions", {}, ":"),
        # Anthropic's own keep-alive event (plugin.toml `stream_keep_alive`), which Claude
        # Code's stream watchdog counts where it ignores comments.
        ("/v1/messages", {"model": "m"}, "event: ping"),
    ],
)
def test_a_stream_silent_during_a_long_prefill_gets_keep_alives(chatty, path, body, keep_alive):
    # ~1.5k prompt tokens: a prefill of several keep-alive intervals (1 s here, 15 s by default).
    long_prompt = f"{path}: the quick brown fox jumps over the lazy dog. " * 130
    body = {**body, "messages": chat(long_prompt), "max_tokens": 1, "temperature": 0, "stream": True}
    lines, started = [], time.time()
    with chatty.http() as h, h.stream("POST", path, json=body, headers={"anthropic-version": "2023-06-01"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line:
                lines.append((time.time() - started, line))
    data = [t for t, l in lines if l.startswith("data: ")]
    alive = [t for t, l in lines if l.startswith(keep_alive)]
    assert data[-1] - data[0] > 2, "the prefill was too short to test keep-alives"
    assert alive, lines[:5]
    # Sent only while the stream is silent: between its first and last events.
    assert all(data[0] < t < data[-1] for t in alive), (alive, data)


def test_health_while_loading_is_a_503_with_retry_after():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    s = Server("--port", str(port), wait=False)
    try:
        seen = None
        deadline = time.time() + 60
        while time.time() < deadline and seen is None:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
                if r.status_code == 503:
                    seen = r
                elif r.status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.02)
        if seen is None:
            pytest.skip("the model loaded before /health could be asked")
        assert seen.json()["status"] == "loading" and seen.headers["retry-after"] == "1"
    finally:
        s.stop()
