"""Hardening, second pass: each case a hostile client (or a broken plugin file)
broke before, driven against the real binary. Big bodies and huge prompts get
a 4xx in the dialect's shape naming the limit, before the work they bound; a
plugin manifest cannot reach outside its folder; one slow sampler does not
stall the batch; hot reload of a broken file keeps the last good plugin; and
the protocol corner cases (duplicate Host, absolute-form targets, 101
headers, unknown Anthropic paths, origin case, gzip and UTF-16 bodies)."""

import json
import os
import shutil
import socket
import threading
import time
from urllib.parse import urlparse

import httpx
import pytest

from conftest import PLUGINS, Server, chat, plugin_folder, run_binary

HI = {"messages": chat("Hi"), "max_tokens": 2, "temperature": 0}
ANTHROPIC = {"anthropic-version": "2023-06-01"}


def rss_mib(server):
    for line in open(f"/proc/{server.proc.pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def openai_error(r, *statuses):
    assert r.status_code in statuses, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert err["message"], err
    return err


def anthropic_error(r, *statuses):
    assert r.status_code in statuses, (r.status_code, r.text[:500])
    body = r.json()
    assert body["type"] == "error", body
    assert body["error"]["type"] and body["error"]["message"], body
    return body["error"]


def post_raw(http, path, body, headers=None):
    return http.post(path, content=body, headers={"content-type": "application/json", **(headers or {})})


# --- 1. Big bodies: 4xx in the dialect's shape naming the limit, never a 500 ---------


def test_a_responses_input_of_200k_parts_is_a_413_naming_the_limit(http):
    parts = [{"type": "input_text", "text": "a"}] * 200_000
    body = json.dumps({"model": "m", "input": [{"role": "user", "content": parts}], "max_output_tokens": 2})
    err = openai_error(post_raw(http, "/v1/responses", body), 413)
    assert "--max-json-values" in err["message"], err


def test_an_unknown_field_of_2_8m_numbers_is_a_413_not_a_500(http):
    body = json.dumps({**HI, "x": [0] * 2_800_000})
    err = openai_error(post_raw(http, "/v1/chat/completions", body), 413)
    assert "--max-json-values" in err["message"], err
    assert http.post("/v1/chat/completions", json=HI).status_code == 200


def test_a_21mb_messages_body_is_a_4xx_in_anthropics_shape(http):
    body = json.dumps({"model": "m", "max_tokens": 2, "messages": chat("word " * 4_400_000)})
    assert len(body) > 21_000_000
    err = anthropic_error(post_raw(http, "/v1/messages", body, ANTHROPIC), 400, 413)
    assert "--" in err["message"], err  # names the flag that bounds it


# --- 2. Characters are bounded before tokenizing ------------------------------------


def test_a_31mb_count_tokens_is_refused_before_tokenizing(server, http):
    before = rss_mib(server)
    body = json.dumps({"model": "m", "messages": chat("word " * 6_300_000)})
    started = time.time()
    err = anthropic_error(post_raw(http, "/v1/messages/count_tokens", body, ANTHROPIC), 400, 413)
    took = time.time() - started
    assert "--" in err["message"], err
    # Before: 12.6 s and +2.6 GB of tokenizer memory for this one request.
    grown = rss_mib(server) - before
    assert grown < 1024, f"RSS grew {grown:.0f} MiB"
    assert took < 10, took


def test_chat_refuses_a_prompt_over_the_character_limit_naming_it():
    s = Server("--max-prompt-chars", "1000")
    try:
        with s.http() as h:
            err = openai_error(h.post("/v1/chat/completions", json={**HI, "messages": chat("x" * 2000)}), 400)
            assert "--max-prompt-chars" in err["message"], err
            r = h.post("/v1/completions", json={"prompt": "y" * 2000, "max_tokens": 1})
            assert "--max-prompt-chars" in openai_error(r, 400)["message"]
            r = h.post("/v1/messages/count_tokens", json={"model": "m", "messages": chat("z" * 2000)}, headers=ANTHROPIC)
            assert "--max-prompt-chars" in anthropic_error(r, 400)["message"]
            assert h.post("/v1/chat/completions", json=HI).status_code == 200
    finally:
        s.stop()


def test_concurrent_big_count_tokens_stay_within_the_prepare_bound(server):
    before = rss_mib(server)
    body = json.dumps({"model": "m", "messages": chat("word " * 1_000_000)})
    statuses = []

    def one():
        with server.http() as h:
            statuses.append(post_raw(h, "/v1/messages/count_tokens", body, ANTHROPIC).status_code)

    threads = [threading.Thread(target=one) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(statuses) == 6 and all(s < 500 for s in statuses), statuses
    # Before: six concurrent 5 MB bodies reached 3.9 GB.
    assert rss_mib(server) - before < 1536


# --- 3. A manifest cannot point outside its plugin folder ---------------------------


def test_a_component_path_outside_the_folder_is_refused_without_reading_it(tmp_path):
    root = plugin_folder(tmp_path, "standard", "openai")
    escape = root / "escape"
    escape.mkdir()
    (escape / "plugin.toml").write_text(
        'name = "escape"\nversion = "0.1.0"\nkinds = ["sampler"]\n'
        'component = "../../../../../../../../etc/passwd"\nwit = "mlxhost:plugin@0.1.0"\n'
    )
    link = root / "link"
    link.mkdir()
    (link / "plugin.toml").write_text(
        'name = "link"\nversion = "0.1.0"\nkinds = ["sampler"]\n'
        'component = "link.wasm"\nwit = "mlxhost:plugin@0.1.0"\n'
    )
    os.symlink("/etc/passwd", link / "link.wasm")
    out = run_binary("plugins", "list", str(root))
    assert out.returncode == 0, out.stderr
    text = out.stdout + out.stderr
    assert "skipped" in text and "escape" in text and "link" in text, text
    assert "root:" not in text, text
    s = Server(plugins=root)
    try:
        assert "root:" not in s.text()
        with s.http() as h:
            assert h.post("/v1/chat/completions", json={**HI, "sampler": "escape"}).status_code == 400
    finally:
        s.stop()


def test_a_component_that_is_not_wasm_is_refused_without_quoting_it(tmp_path):
    root = plugin_folder(tmp_path, "standard")
    (root / "standard" / "standard.wasm").write_text("root:x:0:0:secret-line\n")
    out = run_binary("plugins", "list", str(root))
    assert "skipped" in out.stdout and "secret-line" not in out.stdout + out.stderr, out.stdout


# --- 4. One slow sampler does not stall the batch -----------------------------------


def test_slow_sampler_rows_do_not_stall_the_other_rows(tmp_path):
    plugins = plugin_folder(tmp_path, "standard", "openai", "spin")
    s = Server("--batch", "16", "--plugin-step-ms", "50", plugins=plugins)
    try:
        slow_results, fast_times = [], []

        def slow():
            with s.http() as h:
                slow_results.append(h.post("/v1/chat/completions", json={**HI, "max_tokens": 4, "sampler": "spin"}))

        def fast():
            with s.http() as h:
                t0 = time.time()
                r = h.post("/v1/chat/completions", json={**HI, "max_tokens": 8})
                fast_times.append((time.time() - t0, r.status_code))

        with s.http() as h:  # the alone time of a normal request, for the comparison
            t0 = time.time()
            assert h.post("/v1/chat/completions", json={**HI, "max_tokens": 8}).status_code == 200
            alone = time.time() - t0
        threads = [threading.Thread(target=slow) for _ in range(8)] + [threading.Thread(target=fast) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert all(code == 200 for _, code in fast_times), fast_times
        worst = max(t for t, _ in fast_times)
        # Before: 8 rows each spending their 1 s deadline inside one shared step: 10.4 s.
        # Now each shared step waits at most 50 ms per row: well under the 8 s of 8 deadlines.
        assert worst < alone + 5, (worst, alone)
        for r in slow_results:
            message = r.json()["error"]["message"]
            assert r.status_code == 500 and "spin" in message, r.text
            assert "--plugin-step-ms" in message or "time limit" in message, message
        assert any(
            "--plugin-step-ms" in r.json()["error"]["message"] for r in slow_results
        )
    finally:
        s.stop()


# --- 5. Hot reload keeps the last good version ---------------------------------------


def wait_for(predicate, seconds=30):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def test_a_broken_file_on_hot_reload_keeps_the_last_good_plugin(tmp_path):
    plugins = plugin_folder(tmp_path, "standard", "openai")
    s = Server("--plugins-poll-ms", "200", plugins=plugins)
    try:
        with s.http() as h:
            (plugins / "standard" / "standard.wasm").write_bytes(b"\0asm garbage" * 100)
            (plugins / "openai" / "openai.wasm").write_bytes(b"not a component")
            assert wait_for(lambda: len(h.get("/stats").json()["plugins"]["kept"]) == 2), h.get("/stats").text
            kept = {k["name"]: k for k in h.get("/stats").json()["plugins"]["kept"]}
            assert set(kept) == {"standard", "openai"}, kept
            assert all(k["reason"] for k in kept.values())
            # Requests without a sampler use the kept `standard`; chat is still served by `openai`.
            r = h.post("/v1/chat/completions", json=HI)
            assert r.status_code == 200, r.text
            assert "keeping its last good version" in s.text(), s.text()[-2000:]
            out = run_binary("plugins", "list", "--server", s.url)
            assert out.returncode == 0, out.stderr
            assert "kept     standard" in out.stdout and "kept     openai" in out.stdout, out.stdout
            # A fixed file loads again.
            shutil.copy(PLUGINS / "standard" / "standard.wasm", plugins / "standard" / "standard.wasm")
            assert wait_for(lambda: [k["name"] for k in h.get("/stats").json()["plugins"]["kept"]] == ["openai"])
    finally:
        s.stop()


def test_a_missing_default_sampler_is_a_503_naming_the_server_side_cause(tmp_path):
    # The start refuses a missing --sampler; hot reload can still remove it afterwards.
    plugins = plugin_folder(tmp_path, "standard", "openai")
    s = Server("--plugins-poll-ms", "200", plugins=plugins)
    try:
        with s.http() as h:
            assert h.post("/v1/chat/completions", json=HI).status_code == 200
            shutil.rmtree(plugins / "standard")
            assert wait_for(lambda: h.post("/v1/chat/completions", json=HI).status_code == 503)
            err = openai_error(h.post("/v1/chat/completions", json=HI), 503)
            assert "--sampler" in err["message"] and err.get("param") != "sampler", err
            # Naming a sampler that is loaded still works; naming an unknown one is the client's 400.
            assert h.post("/v1/chat/completions", json={**HI, "sampler": "nope"}).status_code == 400
    finally:
        s.stop()


# --- 6. Protocol corners ---------------------------------------------------------------


def raw_request(server, data):
    u = urlparse(server.url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
        sock.sendall(data)
        chunks = []
        while True:
            try:
                chunk = sock.recv(65536)
            except (socket.timeout, ConnectionResetError):
                break
            if not chunk:
                break
            chunks.append(chunk)
            if b"\r\n\r\n" in b"".join(chunks):
                head, _, rest = b"".join(chunks).partition(b"\r\n\r\n")
                length = [int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")]
                if length and len(rest) >= length[0]:
                    break
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    return status, body


def test_a_duplicate_host_header_is_a_400(server):
    status, body = raw_request(
        server, b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\nConnection: close\r\n\r\n"
    )
    assert status == 400 and b"Host" in body, body


def test_an_absolute_form_target_naming_a_foreign_host_is_refused(server):
    port = urlparse(server.url).port
    status, body = raw_request(
        server,
        f"GET http://evil.example/v1/models HTTP/1.1\r\nHost: localhost:{port}\r\nConnection: close\r\n\r\n".encode(),
    )
    assert status == 400 and b"evil.example" in body, body
    status, _ = raw_request(
        server,
        f"GET http://127.0.0.1:{port}/v1/models HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode(),
    )
    assert status == 200


def test_101_headers_get_a_431_in_the_dialects_shape(http):
    headers = {f"x-h{i}": "v" for i in range(101)}
    err = openai_error(http.get("/v1/models", headers=headers), 431)
    assert "100" in err["message"], err
    r = http.post("/v1/messages", json={"model": "m", "max_tokens": 1, "messages": chat("Hi")}, headers={**headers, **ANTHROPIC})
    anthropic_error(r, 431)


def test_unknown_anthropic_paths_answer_in_anthropics_shape(http):
    anthropic_error(http.post("/v1/messages/nope", json={}), 404)
    s = Server("--api-key", "k")
    try:
        with s.http() as h:
            anthropic_error(h.post("/v1/messages/nope", json={}), 401)
            anthropic_error(h.post("/v1/messages", json={}), 401)
    finally:
        s.stop()


def test_allowed_origins_grant_the_page_in_any_case():
    s = Server("--allowed-origins", "https://app.example")
    try:
        with s.http() as h:
            r = h.post("/v1/chat/completions", json=HI, headers={"origin": "https://APP.example"})
            assert r.status_code == 200, r.text
            assert r.headers["access-control-allow-origin"] == "https://APP.example"
            r = h.options(
                "/v1/chat/completions",
                headers={"origin": "https://App.Example", "access-control-request-method": "POST"},
            )
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://App.Example"
    finally:
        s.stop()


def test_gzip_and_utf16_bodies_are_415s(http):
    import gzip

    body = json.dumps(HI).encode()
    r = http.post(
        "/v1/chat/completions",
        content=gzip.compress(body),
        headers={"content-type": "application/json", "content-encoding": "gzip"},
    )
    assert "gzip" in openai_error(r, 415)["message"]
    r = http.post(
        "/v1/chat/completions",
        content=json.dumps(HI).encode("utf-16"),
        headers={"content-type": "application/json; charset=utf-16"},
    )
    assert "UTF-8" in openai_error(r, 415)["message"]
    r = http.post("/v1/messages", content=gzip.compress(body), headers={"content-type": "application/json", "content-encoding": "gzip", **ANTHROPIC})
    anthropic_error(r, 415)
