"""Sampling through plugins over HTTP: the first-party processors the host
inserts for standard fields, per-request sampler selection with parameters,
hostile plugins failing only their own request, and hot reload."""

import shutil
import threading
import time

import httpx
import pytest

from conftest import PLUGINS, Server, assert_picked_token_zero, chat, plugin_folder

BASE = {"messages": chat("Write a poem about the sea."), "max_tokens": 24, "temperature": 0,
        "logprobs": True, "return_tokens_as_token_ids": True}


def token_ids(r):
    assert r.status_code == 200, r.text
    return [int(t["token"].removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["content"]]


def test_standard_fields_run_the_first_party_processors(http):
    greedy = token_ids(http.post("/v1/chat/completions", json=BASE))
    # logit_bias -100 on the greedy first token: a different first token.
    biased = token_ids(http.post("/v1/chat/completions", json={**BASE, "logit_bias": {str(greedy[0]): -100}}))
    assert biased[0] != greedy[0]
    # +100 on an arbitrary token: it is chosen first.
    forced = token_ids(http.post("/v1/chat/completions", json={**BASE, "max_tokens": 1, "logit_bias": {"42": 100}}))
    assert forced == [42]
    for field, value in [("repetition_penalty", 1.8), ("presence_penalty", 2.0), ("frequency_penalty", 2.0)]:
        changed = token_ids(http.post("/v1/chat/completions", json={**BASE, field: value}))
        assert changed != greedy, field
    # The generated text never repeats a token when frequency penalties are huge... and the
    # processors leave the reported logprobs raw: the first token's logprob is unchanged.
    a = http.post("/v1/chat/completions", json={**BASE, "max_tokens": 1}).json()
    b = http.post("/v1/chat/completions", json={**BASE, "max_tokens": 1, "presence_penalty": 2.0}).json()
    assert a["choices"][0]["logprobs"]["content"][0]["logprob"] == pytest.approx(
        b["choices"][0]["logprobs"]["content"][0]["logprob"], abs=1e-5)


def test_mirostat_is_selectable_per_request_with_its_parameters(http):
    req = {**BASE, "temperature": 0.9, "seed": 11, "sampler": "mirostat", "plugin_params": {"mirostat": {"tau": 3.0}}}
    a, b = token_ids(http.post("/v1/chat/completions", json=req)), token_ids(http.post("/v1/chat/completions", json=req))
    assert a == b, "same seed, same output"
    r = http.post("/v1/chat/completions", json={**req, "plugin_params": {"mirostat": {"tau": -1}}})
    assert r.status_code == 400 and "mirostat" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "plugin_params.mirostat", r.json()
    r = http.post("/v1/chat/completions", json={**req, "plugin_params": {"mirostat": {"typo": 1}}})
    assert r.status_code == 400 and "typo" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    plugins = plugin_folder(tmp_path_factory.mktemp("h"), "standard", "openai", "spin", "hog", "bad-token")
    s = Server("--sampler-deadline-ms", "300", "--plugin-memory", "32", plugins=plugins)
    yield s
    s.stop()


@pytest.mark.parametrize("plugin, cause", [
    ("spin", "time limit"),
    ("hog", "memory limit"),
    ("bad-token", "outside the vocabulary"),
])
def test_a_hostile_plugin_fails_only_its_own_request(hostile, plugin, cause):
    with hostile.http() as c:
        result = {}

        def bad():
            with hostile.http() as c2:
                result["r"] = c2.post("/v1/chat/completions", json={"messages": chat("Hi"), "max_tokens": 4, "sampler": plugin})

        t = threading.Thread(target=bad)
        t.start()
        # Meanwhile the server answers /health and queues other requests.
        assert c.get("/health").json()["status"] == "ok"
        ok = c.post("/v1/chat/completions", json={"messages": chat("Hi"), "max_tokens": 3, "temperature": 0})
        t.join(120)
        assert ok.status_code == 200
        r = result["r"]
        assert r.status_code == 500, r.text
        message = r.json()["error"]["message"]
        assert plugin in message and cause in message, message
        # The instance is recycled: the same plugin fails the same way again, and others work.
        again = c.post("/v1/chat/completions", json={"messages": chat("Hi"), "max_tokens": 4, "sampler": plugin})
        assert again.status_code == 500
        assert c.post("/v1/chat/completions", json={"messages": chat("Hi"), "max_tokens": 2}).status_code == 200


def test_hot_reload_adds_and_removes_plugins_without_dropping_in_flight_requests(tmp_path):
    plugins = plugin_folder(tmp_path, "standard", "openai")
    s = Server("--plugins-poll-ms", "200", plugins=plugins)
    try:
        with s.http() as c, httpx.Client(base_url=s.url, timeout=300) as streaming:
            pick = {"messages": chat("Hi"), "max_tokens": 1, "sampler": "lowest-id"}
            assert c.post("/v1/chat/completions", json=pick).status_code == 400
            with streaming.stream("POST", "/v1/chat/completions", json={**BASE, "max_tokens": 40, "stream": True}) as r:
                lines = r.iter_lines()
                next(lines)
                shutil.copytree(PLUGINS / "testing" / "lowest-id", plugins / "lowest-id",
                                ignore=shutil.ignore_patterns("src", "Cargo.toml"))
                rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]", rest[-3:]
            deadline = time.time() + 30
            while time.time() < deadline:
                r = c.post("/v1/chat/completions", json={**pick, "logprobs": True, "return_tokens_as_token_ids": True})
                if r.status_code == 200:
                    break
                time.sleep(0.2)
            assert r.status_code == 200, r.text
            assert_picked_token_zero(r.json())
            assert "plugins reloaded" in s.text()
            shutil.rmtree(plugins / "lowest-id")
            deadline = time.time() + 30
            while time.time() < deadline and c.post("/v1/chat/completions", json=pick).status_code != 400:
                time.sleep(0.2)
            assert c.post("/v1/chat/completions", json=pick).status_code == 400
    finally:
        s.stop()


def test_plugins_check_smoke_calls_each_plugin_and_names_failures(tmp_path):
    from conftest import run_binary

    good = run_binary("plugins", "check", str(PLUGINS))
    assert good.returncode == 0, good.stdout + good.stderr
    for name in ("standard", "mirostat", "repetition-penalty", "openai"):
        assert name in good.stdout
    assert good.stdout.count("smoke:") >= 7
    bad = plugin_folder(tmp_path, "standard", "spin")
    (bad / "broken").mkdir()
    (bad / "broken" / "plugin.toml").write_text('name = "broken"\n')
    out = run_binary("plugins", "check", str(bad))
    assert out.returncode != 0
    assert "spin" in out.stdout and "time limit" in out.stdout, out.stdout
    assert "broken" in out.stdout and "skipped" in out.stdout


def test_dry_penalizes_continuing_a_repeat_over_http(http):
    # The prompt repeats a phrase; greedy decoding continues the repeat. DRY (llama.cpp's
    # definition, checked against llama.cpp in tests/tests/plugin_goldens.rs) must change that.
    messages = chat("Repeat after me exactly: the quick brown fox, the quick brown fox, the quick brown fox,")
    base = {"messages": messages, "max_tokens": 20, "temperature": 0}
    plain = http.post("/v1/chat/completions", json=base).json()["choices"][0]["message"]["content"]
    dry = http.post("/v1/chat/completions", json={**base, "logits_processors": ["dry"],
                                                  "plugin_params": {"dry": {"multiplier": 2.0}}})
    assert dry.status_code == 200, dry.text
    assert dry.json()["choices"][0]["message"]["content"] != plain
    bad = http.post("/v1/chat/completions", json={**base, "logits_processors": ["dry"],
                                                  "plugin_params": {"dry": {"base": 0.5}}})
    assert bad.status_code == 400 and "`base`" in bad.json()["error"]["message"]
