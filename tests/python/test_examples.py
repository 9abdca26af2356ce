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
