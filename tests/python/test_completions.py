"""OpenAI legacy Completions (`POST /v1/completions`) through the first-party
`openai` adapter plugin, driven with the official `openai` Python SDK
(`client.completions.create`) and raw HTTP for malformed bodies. The prompt is
raw text tokenized as is (no chat template) or token ids."""

import json

import openai
import pytest

from conftest import run_binary

PROMPT = "Once upon a time,"
COUNT = "1, 2, 3, 4,"
# The float32 path's tolerance (semantics.md), as in test_openai_chat.py.
TOLERANCE = 0.1


def complete(client, **kw):
    return client.completions.create(**{"model": "any", "temperature": 0, **kw})


def streamed(client, **kw):
    return list(complete(client, stream=True, **kw))


def joined(chunks):
    return "".join(c.choices[0].text for c in chunks if c.choices)


def test_greedy_completion_is_deterministic_and_equals_the_stream(client):
    a = complete(client, prompt=PROMPT, max_tokens=24)
    b = complete(client, prompt=PROMPT, max_tokens=24)
    assert a.object == "text_completion"
    assert a.id.startswith("cmpl-")
    choice = a.choices[0]
    assert choice.index == 0 and choice.logprobs is None
    assert choice.text and choice.text == b.choices[0].text
    assert choice.finish_reason in ("stop", "length")
    assert a.usage.prompt_tokens == 5
    assert 0 < a.usage.completion_tokens <= 24
    assert a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens

    chunks = streamed(client, prompt=PROMPT, max_tokens=24, stream_options={"include_usage": True})
    assert {c.object for c in chunks} == {"text_completion"}
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("cmpl-")
    assert joined(chunks) == choice.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [choice.finish_reason]
    # Usage once, on the last chunk, which has no choices.
    assert [c for c in chunks if c.usage] == [chunks[-1]]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == a.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == a.usage.prompt_tokens

    # Without include_usage no chunk carries usage.
    plain = streamed(client, prompt=PROMPT, max_tokens=24)
    assert joined(plain) == choice.text
    assert all(c.usage is None and c.choices for c in plain)


def test_max_tokens_defaults_to_16_as_openai(client):
    r = complete(client, prompt=COUNT)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 16
    r = complete(client, prompt=COUNT, max_tokens=3)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3


def test_a_list_of_one_string_is_the_string(client):
    a = complete(client, prompt=COUNT, max_tokens=6)
    b = complete(client, prompt=[COUNT], max_tokens=6)
    assert a.choices[0].text == b.choices[0].text


def ids_of(r):
    return [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]


def test_token_id_prompt_is_used_as_is(client):
    # Token ids the model produced (a text completion's, with ids as tokens).
    seed = complete(client, prompt=PROMPT, max_tokens=8, logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    prompt_ids = ids_of(seed)
    assert len(prompt_ids) == 8
    r = complete(
        client, prompt=prompt_ids, max_tokens=6, logprobs=1, extra_body={"return_tokens_as_token_ids": True}
    )
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.choices[0].text
    # An array of one array of ids is the same prompt.
    again = complete(client, prompt=[prompt_ids], max_tokens=6)
    assert again.choices[0].text == r.choices[0].text
    # Greedy on those ids = the argmax of a teacher-forced pass on them.
    ids = ids_of(r)
    line = json.dumps({"prompt_ids": prompt_ids, "continuation_ids": ids})
    out = run_binary("score", "--input", "-", "--top-logprobs", "1", input=line + "\n")
    assert out.returncode == 0, out.stderr
    steps = json.loads(out.stdout.splitlines()[0])["steps"]
    assert [s["token"] for s in steps] == ids
    for lp, s in zip(r.choices[0].logprobs.token_logprobs, steps):
        assert s["top"][0][0] == s["token"]
        assert abs(lp - s["logprob"]) < TOLERANCE


def test_echo_returns_the_prompt_then_the_completion(client):
    plain = complete(client, prompt=PROMPT, max_tokens=8)
    echoed = complete(client, prompt=PROMPT, max_tokens=8, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    chunks = streamed(client, prompt=PROMPT, max_tokens=8, echo=True)
    assert chunks[0].choices[0].text == PROMPT
    assert joined(chunks) == echoed.choices[0].text


def test_logprobs_2_gives_two_alternatives_per_token(client):
    r = complete(client, prompt=COUNT, max_tokens=10, logprobs=2)
    choice = r.choices[0]
    lp = choice.logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == choice.text
    for token, logprob, top, offset in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset):
        assert len(top) == 2
        # Greedy: the chosen token is the most likely alternative.
        assert top[token] == logprob == max(top.values())
        assert logprob <= 0
        assert choice.text[offset:].startswith(token)
    # Streamed: the same tokens, offsets continuing across chunks.
    chunks = streamed(client, prompt=COUNT, max_tokens=10, logprobs=2)
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens
    assert offsets == lp.text_offset
    # logprobs=0: the sampled token only.
    r = complete(client, prompt=COUNT, max_tokens=4, logprobs=0)
    assert all(len(top) == 1 for top in r.choices[0].logprobs.top_logprobs)


def test_stop_ends_generation_and_is_not_returned(client):
    full = complete(client, prompt=COUNT, max_tokens=12).choices[0].text
    assert "," in full and "6" in full
    r = complete(client, prompt=COUNT, max_tokens=12, stop=",")
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index(",")]
    r = complete(client, prompt=COUNT, max_tokens=12, stop=["7", "6"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == full[: full.index("6")]
    chunks = streamed(client, prompt=COUNT, max_tokens=12, stop=["7", "6"])
    assert joined(chunks) == r.choices[0].text


GOOD = {"model": "any", "prompt": COUNT, "max_tokens": 2, "temperature": 0}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "any"}, "prompt"),
        ({**GOOD, "prompt": None}, "prompt"),
        ({**GOOD, "prompt": 12}, "prompt"),
        ({**GOOD, "prompt": ""}, "prompt"),
        ({**GOOD, "prompt": []}, "prompt"),
        ({**GOOD, "prompt": ["one", "two"]}, "prompt"),
        ({**GOOD, "prompt": [[1, 2], [3]]}, "prompt"),
        ({**GOOD, "prompt": [1, "x"]}, "prompt"),
        ({**GOOD, "prompt": [-1]}, "prompt"),
        # Checked by the host against the vocabulary.
        ({**GOOD, "prompt": [1, 999999]}, "prompt"),
        ({**GOOD, "prompt": "x" * 100000}, "prompt"),
        ({**GOOD, "suffix": " and so on"}, "suffix"),
        ({**GOOD, "best_of": 2}, "best_of"),
        ({**GOOD, "n": 2}, "n"),
        ({**GOOD, "max_tokens": 0}, "max_tokens"),
        ({**GOOD, "max_tokens": "many"}, "max_tokens"),
        ({**GOOD, "max_tokens": 2**40}, "max_tokens"),
        ({**GOOD, "temperature": "hot"}, "temperature"),
        ({**GOOD, "logprobs": 6}, "logprobs"),
        ({**GOOD, "logprobs": True}, "logprobs"),
        ({**GOOD, "echo": "yes"}, "echo"),
        ({**GOOD, "echo": True, "prompt": [1, 2, 3]}, "echo"),
        ({**GOOD, "echo": True, "logprobs": 1}, "echo"),
        ({**GOOD, "stream": "yes"}, "stream"),
        ({**GOOD, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({**GOOD, "logit_bias": {"99999999": 1}}, "logit_bias"),
        ({**GOOD, "sampler": "no-such-sampler"}, "sampler"),
    ],
)
def test_bad_field_is_a_400_naming_it(http, body, param):
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param, err
    assert err["message"]


def test_sdk_sees_openai_errors_and_the_server_keeps_serving(client):
    for kw, param, words in [
        ({"suffix": "!"}, "suffix", "not supported"),
        ({"best_of": 2}, "best_of", "best_of"),
        ({"prompt": ["a", "b"]}, "prompt", "only one prompt"),
        ({"prompt": [7, 10**6]}, "prompt", "outside the vocabulary"),
        ({"prompt": [1, 2], "echo": True}, "echo", "text prompt"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            complete(client, **{"prompt": COUNT, "max_tokens": 2, **kw})
        assert e.value.status_code == 400
        assert e.value.param == param
        assert words in e.value.message
    assert complete(client, prompt=COUNT, max_tokens=2).usage.completion_tokens == 2
