"""Bad input: each a clear 4xx with an OpenAI-shaped error body naming the
field, and the server still serving afterwards."""

import pytest

from conftest import Server, chat

GOOD = {"messages": chat("Hi"), "max_tokens": 2, "temperature": 0}


def error_of(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["message"]
    return err


def still_serving(http):
    assert http.get("/health").json()["status"] == "ok"
    r = http.post("/v1/chat/completions", json=GOOD)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"messages": "hello"}, "messages"),
        ({"messages": []}, "messages"),
        ({}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content[0].type"),
        ({**GOOD, "temperature": "hot"}, "temperature"),
        ({**GOOD, "temperature": 3}, "temperature"),
        ({**GOOD, "top_p": 1.5}, "top_p"),
        ({**GOOD, "max_tokens": -1}, "max_tokens"),
        ({**GOOD, "max_tokens": 0}, "max_tokens"),
        ({**GOOD, "max_tokens": "many"}, "max_tokens"),
        ({**GOOD, "max_tokens": 2**40}, "max_tokens"),
        ({**GOOD, "stream": "yes"}, "stream"),
        ({**GOOD, "n": 2}, "n"),
        ({**GOOD, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({**GOOD, "stop": 7}, "stop"),
        ({**GOOD, "top_logprobs": 3}, "top_logprobs"),
        ({**GOOD, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({**GOOD, "logit_bias": {"abc": 1}}, "logit_bias"),
        ({**GOOD, "logit_bias": {"99999999": 1}}, "logit_bias"),
        ({**GOOD, "sampler": "no-such-sampler"}, "sampler"),
        ({**GOOD, "logits_processors": ["no-such-processor"]}, "logits_processors"),
        ({**GOOD, "plugin_params": {"other": {"x": 1}}}, "plugin_params"),
        ({**GOOD, "presence_penalty": 9}, "presence_penalty"),
    ],
)
def test_bad_field_is_a_400_naming_it(http, body, param):
    err = error_of(http.post("/v1/chat/completions", json=body), 400)
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param


def test_malformed_json_is_a_400(http):
    r = http.post("/v1/chat/completions", content=b'{"messages": [', headers={"content-type": "application/json"})
    assert "not valid JSON" in error_of(r, 400)["message"]
    r = http.post("/v1/chat/completions", content=b"[1, 2]")
    assert "JSON object" in error_of(r, 400)["message"]
    still_serving(http)


def test_a_100k_token_prompt_is_a_400_naming_the_context(http):
    # ~100k tokens: far past SmolLM2's 8192-token context.
    text = "hello world " * 50_000
    err = error_of(http.post("/v1/chat/completions", json={"messages": chat(text)}), 400)
    assert "context" in err["message"] and err["param"] == "messages"
    still_serving(http)


def test_max_tokens_past_the_context_is_an_upper_bound_unless_strict(http):
    # opencode sends max_tokens 32000 whatever the context (8192 here): clamped, as llama.cpp does.
    body = {**GOOD, "max_tokens": 32000}
    for path, b in (("/v1/chat/completions", body), ("/v1/completions", {"prompt": "Hi", "max_tokens": 32000, "stop": [" "]})):
        r = http.post(path, json={**b, "stop": [" "]})
        assert r.status_code == 200, (path, r.text)
    strict = Server("--strict-max-tokens")
    try:
        with strict.http() as h:
            err = error_of(h.post("/v1/chat/completions", json=body), 400)
            assert err["param"] == "max_tokens" and "--strict-max-tokens" in err["message"], err
            # Anthropic's max_tokens is an upper bound by the API's own rule, yet strict is strict.
            r = h.post("/v1/messages", json={"model": "m", "max_tokens": 32000, "messages": chat("Hi")})
            assert r.status_code == 400 and "--strict-max-tokens" in r.json()["error"]["message"], r.text
            assert h.post("/v1/chat/completions", json=GOOD).status_code == 200
    finally:
        strict.stop()


def test_unknown_route_and_wrong_method(http):
    error_of(http.get("/v1/nothing"), 404)
    r = http.get("/v1/chat/completions")
    error_of(r, 405)
    assert r.headers["allow"] == "POST"
    still_serving(http)


def test_the_sdk_raises_bad_request(client):
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="any", messages=[], max_tokens=1)
    assert e.value.body["param"] == "messages"
