"""LoRA adapters over HTTP (`serve --lora-dir`, docs/lora.md): the random
adapters of tests/fixtures/lora (benches/make_lora.py) on SmolLM2.

- `GET /v1/models` lists each adapter after the base, with its parent and
  facts;
- a request runs an adapter when `model` is `<base>:<adapter>` or the
  adapter's name, or its `lora` field names one: all three give the same
  reply, which differs from the base's and equals `mlxhost score --lora`
  on the same tokens (teacher-forced);
- an adapter that is not served is a 404 in the dialect's error shape
  (OpenAI's and Anthropic's), naming the served ones.
"""

import json
from pathlib import Path

import pytest

from conftest import ROOT, Server, run_binary

FIXTURES = ROOT / "tests" / "fixtures" / "lora"
ADAPTERS = ["alpha-mlx", "alpha-peft", "beta-mlx", "beta-peft"]
PROMPT = "The capital of France is"
# Server against `score` on the same path and tokens: the same numerics up
# to batching (tests/tests/lora.rs bounds a row's scheduler run against its
# solo score by 1e-3 nats).
TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def lora_server():
    s = Server("--lora-dir", str(FIXTURES))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def lora_http(lora_server):
    with lora_server.http() as c:
        yield c


def base_id(http):
    return http.get("/v1/models").json()["data"][0]["id"]


def complete(http, **body):
    body = {
        "model": "any",
        "prompt": PROMPT,
        "max_tokens": 12,
        "temperature": 0,
        "logprobs": 1,
        "return_tokens_as_token_ids": True,
        **body,
    }
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def ids_and_logprobs(reply):
    lp = reply["choices"][0]["logprobs"]
    return [int(t.removeprefix("token_id:")) for t in lp["tokens"]], lp["token_logprobs"]


def test_models_lists_each_adapter_after_the_base(lora_http):
    data = lora_http.get("/v1/models").json()["data"]
    base = data[0]
    assert "lora" not in base
    assert [m["id"] for m in data[1:]] == ADAPTERS
    for m in data[1:]:
        assert m["parent"] == base["id"]
        assert m["object"] == base["object"]
        assert m["lora"]["format"] == ("mlx" if m["id"].endswith("mlx") else "peft")
    alpha = next(m for m in data if m["id"] == "alpha-mlx")
    assert alpha["lora"]["rank"] == 8
    assert alpha["lora"]["modules"] == ["self_attn.q_proj", "self_attn.v_proj"]


def test_each_way_of_naming_an_adapter_runs_it(lora_http):
    base = base_id(lora_http)
    plain = complete(lora_http)
    for name in ["alpha-mlx", "beta-peft"]:
        by_model = complete(lora_http, model=f"{base}:{name}")
        by_name = complete(lora_http, model=name)
        by_field = complete(lora_http, lora=name)
        ids, lps = ids_and_logprobs(by_model)
        for other in (by_name, by_field):
            o_ids, o_lps = ids_and_logprobs(other)
            assert o_ids == ids, name
            # Within batching's bound (the later ones may start from the
            # prompt cache).
            assert max(abs(a - b) for a, b in zip(o_lps, lps)) < 1e-4, name
        # Not the base's reply: the adapter moves the scores.
        base_ids, base_lps = ids_and_logprobs(plain)
        assert (ids != base_ids) or max(abs(a - b) for a, b in zip(lps, base_lps)) > 0.05, name


@pytest.mark.parametrize("name", ["alpha-mlx", "beta-peft"])
def test_a_served_reply_equals_score_with_the_adapter(lora_http, name):
    # A chat prompt of the fixtures' (token ids, used as is).
    rows = (FIXTURES / "rows.jsonl").read_text().splitlines()
    prompt_ids = json.loads(rows[0])["prompt_ids"]
    reply = complete(lora_http, lora=name, prompt=prompt_ids)
    ids, lps = ids_and_logprobs(reply)
    assert reply["usage"]["prompt_tokens"] == len(prompt_ids)
    line = json.dumps({"prompt_ids": prompt_ids, "continuation_ids": ids})
    out = run_binary(
        "score", "--input", "-", "--top-logprobs", "1", "--lora", str(FIXTURES / name), input=line + "\n"
    )
    assert out.returncode == 0, out.stderr
    steps = json.loads(out.stdout.splitlines()[0])["steps"]
    assert [s["token"] for s in steps] == ids
    for lp, s in zip(lps, steps):
        # Greedy: each served token is the adapter's own argmax.
        assert s["top"][0][0] == s["token"]
        assert abs(lp - s["logprob"]) < TOLERANCE, (lp, s)


def test_an_adapter_that_is_not_served_is_a_404_in_each_dialect(lora_http):
    base = base_id(lora_http)
    for body in ({"lora": "gamma"}, {"model": f"{base}:gamma"}):
        r = lora_http.post("/v1/completions", json={"model": "any", "prompt": PROMPT, "max_tokens": 2, **body})
        assert r.status_code == 404, r.text
        err = r.json()["error"]
        assert "gamma" in err["message"] and "alpha-mlx" in err["message"], err
        assert err["param"] == ("lora" if "lora" in body else "model")
    r = lora_http.post(
        "/v1/messages",
        json={
            "model": f"{base}:gamma",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}],
        },
    )
    assert r.status_code == 404, r.text
    body = r.json()
    assert body["type"] == "error", body
    assert body["error"]["type"] == "not_found_error", body
    assert "gamma" in body["error"]["message"]
