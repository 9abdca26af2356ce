"""The host's side of serving: readiness, cancellation on disconnect,
SIGTERM, start-up with missing or broken plugins, and plugin failures that
fail only their own request."""

import re
import signal
import threading
import time

import httpx
import pytest

from conftest import Server, assert_picked_token_zero, chat, plugin_folder, run_binary

# Far longer than the tests' waits at any decode speed we reach (~250 tok/s on 2 CPU cores:
# 400 tokens once fit inside the 2 s drain below).
LONG = {"messages": chat("Write a long story about a dragon and a knight."), "max_tokens": 4000, "temperature": 0}


def sse_events(response):
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line[len("data: "):]


def test_health_answers_while_a_generation_runs(server, http):
    with httpx.Client(base_url=server.url, timeout=300) as other:
        with other.stream("POST", "/v1/chat/completions", json={**LONG, "max_tokens": 40, "stream": True}) as r:
            events = sse_events(r)
            next(events), next(events)  # role chunk, first text: generation is under way
            started = time.time()
            h = http.get("/health")
            assert h.status_code == 200 and h.json()["in_flight"] >= 1
            assert time.time() - started < 2.0
            assert list(events)[-1] == "[DONE]"


def test_client_disconnect_cancels_its_generation(server, http):
    rid = "disconnect-test-1"
    with httpx.Client(base_url=server.url, timeout=300) as other:
        with other.stream(
            "POST", "/v1/chat/completions", json={**LONG, "stream": True}, headers={"x-request-id": rid}
        ) as r:
            events = sse_events(r)
            next(events), next(events), next(events)
        # Leaving the block closes the connection mid-stream.
    # The log names the request by the server's id, with the client's beside it.
    ours = re.search(r"request_id=(\w+) client_request_id=\"" + rid + '"', server.text())
    assert ours, server.text()[-3000:]
    deadline = time.time() + 60
    pattern = re.compile(r"request_id=" + ours.group(1) + r"\}.*generation finished.*finish=Cancelled")
    while time.time() < deadline and not pattern.search(server.text()):
        time.sleep(0.2)
    assert pattern.search(server.text()), server.text()[-3000:]
    # 4000 tokens would take far longer than this; the engine is free again.
    assert http.get("/health").json()["in_flight"] == 0
    r = http.post("/v1/chat/completions", json={"messages": chat("Hi"), "max_tokens": 2})
    assert r.status_code == 200


def test_sigterm_drains_then_cancels_and_exits_cleanly(tmp_path):
    s = Server("--shutdown-timeout", "2")
    try:
        with httpx.Client(base_url=s.url, timeout=300) as c:
            with c.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as r:
                events = sse_events(r)
                next(events), next(events)
                s.proc.send_signal(signal.SIGTERM)
                rest = list(events)
        # The drain period (2 s) ended before 4000 tokens: the stream ends
        # with an error event naming the shutdown, not silently.
        assert rest and "shut down" in rest[-1], rest[-3:]
        assert s.proc.wait(60) == 0, s.text()
        assert "server stopped" in s.text()
    finally:
        s.stop()


def test_sigterm_lets_a_short_request_finish(tmp_path):
    s = Server("--shutdown-timeout", "60")
    try:
        result = {}

        def request():
            with httpx.Client(base_url=s.url, timeout=300) as c:
                result["r"] = c.post("/v1/chat/completions", json={**LONG, "max_tokens": 12})

        t = threading.Thread(target=request)
        t.start()
        deadline = time.time() + 30
        while time.time() < deadline and "in_flight\":1" not in httpx.get(s.url + "/health").text:
            time.sleep(0.05)
        s.proc.send_signal(signal.SIGTERM)
        t.join(120)
        assert result["r"].status_code == 200
        assert result["r"].json()["usage"]["completion_tokens"] == 12
        assert s.proc.wait(60) == 0
    finally:
        s.stop()


def test_missing_plugins_dir_fails_startup_naming_the_flag(tmp_path):
    out = run_binary("serve", "--port", "0", "--plugins", str(tmp_path / "nope"))
    assert out.returncode != 0
    assert "--plugins" in out.stderr and "does not exist" in out.stderr


def test_corrupt_component_is_skipped_and_the_server_serves(tmp_path):
    plugins = plugin_folder(tmp_path, "standard", "openai", "lowest-id")
    for f in (plugins / "lowest-id").glob("*.wasm"):
        f.write_bytes(b"\0asm garbage")
    s = Server(plugins=plugins)
    try:
        assert "lowest-id" in s.text() and "skipped" in s.text()
        with s.http() as c:
            r = c.post("/v1/chat/completions", json={"messages": chat("Hi"), "max_tokens": 2})
            assert r.status_code == 200
            r = c.post("/v1/chat/completions", json={"messages": chat("Hi"), "max_tokens": 2, "sampler": "lowest-id"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "sampler"
    finally:
        s.stop()


def test_without_an_adapter_the_routes_do_not_exist(tmp_path):
    s = Server(plugins=plugin_folder(tmp_path, "standard"))
    try:
        assert "no API adapter" in s.text()
        with s.http() as c:
            assert c.get("/health").status_code == 200
            r = c.post("/v1/chat/completions", json={"messages": chat("Hi")})
            assert r.status_code == 404
    finally:
        s.stop()


def test_missing_default_sampler_fails_startup(tmp_path):
    out = run_binary("serve", "--port", "0", "--plugins", str(plugin_folder(tmp_path, "openai")))
    assert out.returncode != 0 and "--sampler standard" in out.stderr


@pytest.fixture(scope="module")
def testing_server(tmp_path_factory):
    plugins = plugin_folder(tmp_path_factory.mktemp("p"), "standard", "openai", "ban-token", "lowest-id", "trap")
    s = Server(plugins=plugins)
    yield s
    s.stop()


def test_a_trapping_plugin_fails_only_its_request(testing_server):
    with testing_server.http() as c:
        r = c.post("/v1/chat/completions", json={"messages": chat("Hi"), "max_tokens": 8, "sampler": "trap"})
        assert r.status_code == 500
        err = r.json()["error"]
        assert "trap" in err["message"] and err["type"] == "server_error"
        # Streamed: headers were sent, so the error arrives in the stream.
        with c.stream(
            "POST", "/v1/chat/completions", json={"messages": chat("Hi"), "max_tokens": 8, "sampler": "trap", "stream": True}
        ) as s:
            events = list(sse_events(s))
        assert '"error"' in events[-1] and "trap" in events[-1]
        ok = c.post("/v1/chat/completions", json={"messages": chat("Hi"), "max_tokens": 4, "temperature": 0})
        assert ok.status_code == 200
        assert c.get("/health").json()["status"] == "ok"


def test_plugin_selection_and_parameters_per_request(testing_server):
    with testing_server.http() as c:
        base = {"messages": chat("What is the capital of France?"), "max_tokens": 3, "temperature": 0, "logprobs": True,
                "return_tokens_as_token_ids": True}
        greedy = c.post("/v1/chat/completions", json=base).json()
        first = greedy["choices"][0]["logprobs"]["content"][0]["token"]
        banned_id = int(first.removeprefix("token_id:"))
        banned = c.post(
            "/v1/chat/completions",
            json={**base, "logits_processors": ["ban-token"], "plugin_params": {"ban-token": {"id": banned_id}}},
        ).json()
        assert banned["choices"][0]["logprobs"]["content"][0]["token"] != first
        lowest = c.post("/v1/chat/completions", json={**base, "sampler": "lowest-id"}).json()
        assert_picked_token_zero(lowest)


def test_parameters_a_plugin_rejects_are_a_400_naming_it(testing_server):
    with testing_server.http() as c:
        r = c.post(
            "/v1/chat/completions",
            json={"messages": chat("Hi"), "max_tokens": 2, "logits_processors": ["ban-token"],
                  "plugin_params": {"ban-token": {"id": "seven"}}},
        )
        assert r.status_code == 400
        err = r.json()["error"]
        assert "ban-token" in err["message"] and "`id`" in err["message"], err
        assert err["param"] == "plugin_params.ban-token", err


def test_sigterm_exits_even_when_a_client_never_finishes_its_body():
    import socket
    from urllib.parse import urlparse

    s = Server("--shutdown-timeout", "1")
    try:
        u = urlparse(s.url)
        sock = socket.create_connection((u.hostname, u.port))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"mess")
        time.sleep(0.5)
        started = time.time()
        s.proc.send_signal(signal.SIGTERM)
        # Drain (1 s) + the host's grace period (5 s), not forever.
        assert s.proc.wait(30) == 0, s.text()
        assert time.time() - started < 20
        sock.close()
    finally:
        s.stop()
