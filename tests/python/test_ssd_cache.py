"""The SSD cache tier over HTTP: entries written once requests settle (or at SIGTERM) are
restored after a restart with the same output as a cold run; another model config or
tokenizer never reuses them; damaged files are quarantined and never crash the server."""

import json
import shutil
import stat
import time

from conftest import Server, run_binary
from test_prompt_cache import FIRST, logprobs, run


def ssd_stats(c):
    return c.get("/stats").json()["ssd_cache"]


def wait_written(c, writes=1, timeout=60):
    """Waits until the write-behind snapshot has happened (requests settled)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = ssd_stats(c)
        if s["writes"] >= writes and s["pending_writes"] == 0:
            return s
        time.sleep(0.2)
    raise TimeoutError(f"no SSD write after {timeout}s: {ssd_stats(c)}")


def entry_files(ssd):
    return sorted((ssd / "v1").glob("*/*.kv"))


def same_output(a, b):
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    for (t1, l1), (t2, l2) in zip(logprobs(a), logprobs(b)):
        assert t1 == t2 and abs(l1 - l2) < 0.1


def serve_and_write(ssd, *args):
    """Serves FIRST once with the SSD tier at `ssd`, waits for its entry to be written, stops;
    returns the response and the SSD stats."""
    s = Server("--ssd-cache", str(ssd), *args)
    try:
        with s.http() as c:
            body = run(c, FIRST)
            return body, wait_written(c)
    finally:
        s.stop()


def test_a_restart_restores_from_ssd_with_the_same_output(tmp_path):
    ssd = tmp_path / "ssd"
    cold, written = serve_and_write(ssd)
    assert written["entries"] == 1 and written["bytes"] > 0
    assert stat.S_IMODE(ssd.stat().st_mode) == 0o700, "cached prompts are private"
    s = Server("--ssd-cache", str(ssd))
    try:
        with s.http() as c:
            assert ssd_stats(c)["entries"] == 1
            warm = run(c, FIRST)
            cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached == warm["usage"]["prompt_tokens"] - 1
            same_output(cold, warm)
            st = ssd_stats(c)
            assert st["hits"] == 1 and st["tokens_restored"] == cached and st["quarantined"] == 0
            # Now RAM holds it: the next turn is served from RAM, not the disk.
            follow = FIRST + [{"role": "assistant", "content": cold["choices"][0]["message"]["content"]},
                              {"role": "user", "content": "And of Italy?"}]
            more = run(c, follow)
            assert more["usage"]["prompt_tokens_details"]["cached_tokens"] >= cold["usage"]["prompt_tokens"]
            assert ssd_stats(c)["hits"] == 1
            assert c.get("/stats").json()["prompt_cache"]["hits"] == 1
    finally:
        s.stop()


def test_sigterm_writes_what_requests_left_unwritten(tmp_path):
    ssd = tmp_path / "ssd"
    # Requests never "settle" in this test (ten minutes of quiet needed): only SIGTERM writes.
    s = Server("--ssd-cache", str(ssd), "--ssd-cache-settle-ms", "600000")
    try:
        with s.http() as c:
            cold = run(c, FIRST)
            time.sleep(1.5)
            assert ssd_stats(c)["writes"] == 0
    finally:
        assert s.stop() == 0
    assert len(entry_files(ssd)) == 1
    s = Server("--ssd-cache", str(ssd))
    try:
        with s.http() as c:
            warm = run(c, FIRST)
            assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == warm["usage"]["prompt_tokens"] - 1
            same_output(cold, warm)
    finally:
        s.stop()


def test_the_ssd_tier_works_with_the_ram_tier_off(tmp_path):
    ssd = tmp_path / "ssd"
    s = Server("--prompt-cache", "0", "--ssd-cache", str(ssd), "--ssd-cache-verify")
    try:
        with s.http() as c:
            cold = run(c, FIRST)
            wait_written(c)
            warm = run(c, FIRST)
            assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == warm["usage"]["prompt_tokens"] - 1
            same_output(cold, warm)
            stats = c.get("/stats").json()
            assert stats["prompt_cache"]["entries"] == 0
            assert stats["ssd_cache"]["hits"] == 1 and stats["ssd_cache"]["verify"] is True
    finally:
        s.stop()


def test_a_changed_model_config_or_tokenizer_never_reuses(tmp_path):
    base = tmp_path / "model"
    r = run_binary("convert", str(Server.default_model()), str(base))
    assert r.returncode == 0, r.stderr
    ssd = tmp_path / "ssd"

    def serve_once(model):
        body, stats = serve_and_write(ssd, "--model", str(model))
        return body["usage"]["prompt_tokens_details"]["cached_tokens"], stats

    cached, st = serve_once(base)
    assert cached == 0 and st["entries"] == 1
    # Same weights, a config that differs in one (ignored) field.
    config = tmp_path / "config-changed"
    shutil.copytree(base, config)
    cfg = json.loads((config / "config.json").read_text())
    cfg["mlxhost_test_marker"] = 1
    (config / "config.json").write_text(json.dumps(cfg))
    # Same weights and config, a tokenizer that differs (truncation set).
    tok = tmp_path / "tokenizer-changed"
    shutil.copytree(base, tok)
    t = json.loads((tok / "tokenizer.json").read_text())
    t["truncation"] = {"direction": "Right", "max_length": 100000, "strategy": "LongestFirst", "stride": 0}
    (tok / "tokenizer.json").write_text(json.dumps(t))
    for changed in (config, tok):
        cached, st = serve_once(changed)
        assert cached == 0, changed.name
        assert st["hits"] == 0 and st["quarantined"] == 0, changed.name
    # The original model still finds its own entry.
    s = Server("--model", str(base), "--ssd-cache", str(ssd))
    try:
        with s.http() as c:
            body = run(c, FIRST)
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert ssd_stats(c)["entries_all"] == 3
    finally:
        s.stop()


def test_damaged_files_are_quarantined_and_the_server_keeps_answering(tmp_path):
    ssd = tmp_path / "ssd"
    cold, _ = serve_and_write(ssd)
    (entry,) = entry_files(ssd)
    data = bytearray(entry.read_bytes())
    data[100] ^= 0x01  # inside the header
    entry.write_bytes(bytes(data))
    (entry.parent / "notes.kv").write_text("not a cache file")
    s = Server("--ssd-cache", str(ssd))
    try:
        with s.http() as c:
            st = ssd_stats(c)
            assert st["quarantined"] == 2 and st["entries"] == 0
            again = run(c, FIRST)
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            same_output(cold, again)
    finally:
        s.stop()
    assert len(list((ssd / "quarantine").iterdir())) == 2


def assert_start_fails(message, *args):
    """`serve` with `args` exits non-zero (after loading) and says `message`."""
    s = Server(*args, wait=False)
    try:
        s.proc.wait(120)
        assert s.proc.returncode != 0
        assert message in s.text()
    finally:
        s.stop()


def test_a_second_server_on_the_same_directory_is_refused(tmp_path):
    ssd = tmp_path / "ssd"
    first = Server("--ssd-cache", str(ssd))
    try:
        assert_start_fails("another mlxhost server is using this directory", "--ssd-cache", str(ssd))
        with first.http() as c:
            assert c.get("/health").status_code == 200
    finally:
        first.stop()


def test_a_bad_ssd_cache_flag_is_named(tmp_path):
    r = run_binary("serve", "--ssd-cache", str(tmp_path), "--ssd-cache-max", "0")
    assert r.returncode != 0 and "--ssd-cache-max" in r.stderr
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert_start_fails("--ssd-cache", "--ssd-cache", str(blocker / "sub"))
