"""The four-language examples (examples/no-repeat-{rust,c,js,py}, built by examples/build.sh):
each serves a request and does what it says, and all four agree."""

import shutil

import pytest

from conftest import PLUGINS, ROOT, Server, chat

EXAMPLES = ROOT / "examples"
LANGS = ["rust", "c", "js", "py"]
# logit_bias makes greedy decoding pick token 42 at every step; a no-repeat processor (run after
# the standard processors) must then alternate.
REQ = {"messages": chat("Hello"), "max_tokens": 12, "temperature": 0, "logit_bias": {"42": 100},
       "logprobs": True, "return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def examples_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("ex") / "plugins"
    for name in ("standard", "openai", "logit-bias"):
        shutil.copytree(PLUGINS / name, root / name, ignore=shutil.ignore_patterns("src", "Cargo.toml"))
    for lang in LANGS:
        src = EXAMPLES / f"no-repeat-{lang}"
        assert (src / f"no-repeat-{lang}.wasm").is_file(), f"{src} is not built: run examples/build.sh"
        (root / src.name).mkdir()
        shutil.copy(src / "plugin.toml", root / src.name)
        shutil.copy(src / f"no-repeat-{lang}.wasm", root / src.name)
    s = Server(plugins=root)
    yield s
    s.stop()


def ids(response):
    assert response.status_code == 200, response.text
    return [int(t["token"].removeprefix("token_id:")) for t in response.json()["choices"][0]["logprobs"]["content"]]


def test_every_language_bans_the_previous_token_and_all_agree(examples_server):
    with examples_server.http() as c:
        baseline = ids(c.post("/v1/chat/completions", json=REQ))
        assert baseline == [42] * 12
        outputs = {}
        for lang in LANGS:
            out = ids(c.post("/v1/chat/completions", json={**REQ, "logits_processors": [f"no-repeat-{lang}"]}))
            assert all(a != b for a, b in zip(out, out[1:])), (lang, out)
            assert out[0] == 42 and out[1] != 42, (lang, out)
            outputs[lang] = out
        assert len({tuple(o) for o in outputs.values()}) == 1, outputs


def test_an_adapter_in_javascript_is_swapped_in_and_out_without_a_rebuild(tmp_path):
    """examples/ollama-js, an Ollama-style chat API written in JavaScript, dropped into the
    plugins directory of a running server: after the reload its routes serve; removed, they go."""
    import time

    src = EXAMPLES / "ollama-js"
    assert (src / "ollama-js.wasm").is_file(), f"{src} is not built: run examples/build.sh"
    root = tmp_path / "plugins"
    for name in ("standard", "openai"):
        shutil.copytree(PLUGINS / name, root / name, ignore=shutil.ignore_patterns("src", "Cargo.toml"))
    s = Server("--plugins-poll-ms", "200", plugins=root)

    def wait_for(status):
        deadline = time.time() + 120  # the first load compiles the 12 MB component
        while time.time() < deadline:
            r = c.get("/api/tags")
            if r.status_code == status:
                return r
            time.sleep(0.2)
        raise AssertionError(f"/api/tags never answered {status}: {r.status_code} {r.text}")

    try:
        with s.http() as c:
            assert c.get("/api/tags").status_code == 404
            shutil.copytree(src, root / "ollama-js", ignore=shutil.ignore_patterns("*.js"))
            tags = wait_for(200).json()
            assert tags["models"][0]["name"]
            r = c.post("/api/chat", json={"model": "any", "messages": [{"role": "user", "content": "Say hi"}],
                                          "options": {"temperature": 0, "num_predict": 6}})
            assert r.status_code == 200, r.text
            reply = r.json()
            assert reply["done"] is True and reply["message"]["role"] == "assistant"
            assert reply["message"]["content"] and reply["eval_count"] == 6 and reply["done_reason"] == "length"
            # The same conversation through the OpenAI adapter gives the same greedy text.
            same = c.post("/v1/chat/completions", json={"messages": chat("Say hi"), "max_tokens": 6, "temperature": 0})
            assert same.json()["choices"][0]["message"]["content"] == reply["message"]["content"]
            bad = c.post("/api/chat", json={"messages": [{"role": "robot", "content": "x"}]})
            assert bad.status_code == 400 and "messages[0].role" in bad.json()["error"]
            shutil.rmtree(root / "ollama-js")
            wait_for(404)
            assert c.post("/api/chat", json={"messages": []}).status_code == 404
    finally:
        s.stop()
