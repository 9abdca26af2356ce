"""OpenAI Chat Completions through the first-party `openai` adapter plugin,
driven with the official `openai` Python SDK."""

import json

from conftest import chat, run_binary

PROMPT = chat("What is the capital of France?")
# The float32 path's tolerance (semantics.md): incremental decode vs one
# teacher-forced pass are two ways of computing the same logprobs.
TOLERANCE = 0.1


def test_models_lists_the_served_model(client):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert len(ids) == 1 and ids[0].startswith("SmolLM2-135M-Instruct")


def test_non_streamed_completion_answers_with_usage(client):
    r = client.chat.completions.create(model="any", messages=PROMPT, max_tokens=16, temperature=0)
    choice = r.choices[0]
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 10
    assert 0 < r.usage.completion_tokens <= 16
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_max_tokens_cuts_with_finish_reason_length(client):
    r = client.chat.completions.create(
        model="any", messages=chat("Write a long story about a dragon."), max_completion_tokens=5, temperature=0
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5


def test_stop_string_ends_generation_and_is_not_returned(client):
    full = client.chat.completions.create(model="any", messages=PROMPT, max_tokens=16, temperature=0)
    text = full.choices[0].message.content
    assert "Paris" in text
    r = client.chat.completions.create(model="any", messages=PROMPT, max_tokens=16, temperature=0, stop=["Paris"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == text[: text.index("Paris")]


def test_streamed_text_equals_non_streamed_at_temperature_0(client):
    messages = chat("Name three colors.")
    whole = client.chat.completions.create(model="any", messages=messages, max_tokens=24, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model="any",
            messages=messages,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [whole.choices[0].finish_reason]
    # With include_usage the last chunk has no choices and carries usage.
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_same_seed_same_sample(client):
    kw = dict(model="any", messages=chat("Tell me a joke."), max_tokens=12, temperature=1.0, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_logprobs_equal_mlxhost_score_on_the_same_tokens(client):
    r = client.chat.completions.create(
        model="any",
        messages=PROMPT,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_tokens_as_token_ids": True},
    )
    content = r.choices[0].logprobs.content
    assert content, "logprobs requested but none returned"
    ids = [int(t.token.removeprefix("token_id:")) for t in content]
    for t in content:
        assert len(t.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert t.top_logprobs[0].token == t.token
        assert t.logprob <= 0
    line = json.dumps({"messages": PROMPT, "continuation_ids": ids})
    out = run_binary("score", "--input", "-", "--top-logprobs", "3", input=line + "\n")
    assert out.returncode == 0, out.stderr
    steps = json.loads(out.stdout.splitlines()[0])["steps"]
    assert [s["token"] for s in steps] == ids
    for t, s in zip(content, steps):
        assert abs(t.logprob - s["logprob"]) < TOLERANCE, (t, s)
        ours = {int(a.token.removeprefix("token_id:")): a.logprob for a in t.top_logprobs}
        for tid, lp in s["top"]:
            if tid in ours:
                assert abs(ours[tid] - lp) < TOLERANCE


def test_streamed_logprobs_cover_every_token(client):
    chunks = list(
        client.chat.completions.create(
            model="any", messages=PROMPT, max_tokens=8, temperature=0, stream=True, logprobs=True, top_logprobs=1
        )
    )
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert bytes(b for t in tokens for b in t.bytes).decode("utf-8") == text
    whole = client.chat.completions.create(
        model="any", messages=PROMPT, max_tokens=8, temperature=0, logprobs=True, top_logprobs=1
    )
    assert [t.token for t in tokens] == [t.token for t in whole.choices[0].logprobs.content]


def test_multi_turn_and_content_parts(client):
    r = client.chat.completions.create(
        model="any",
        messages=[
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": [{"type": "text", "text": "Say hi."}]},
            {"role": "assistant", "content": "Hi."},
            {"role": "developer", "content": "Answer in English."},
            {"role": "user", "content": "Again."},
        ],
        max_tokens=4,
        temperature=0,
    )
    assert r.usage.completion_tokens >= 1


def test_response_carries_a_request_id(http):
    r = http.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 1}, headers={"x-request-id": "abc-123"})
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "abc-123"
    # The client's id is echoed, never used as the response id: two requests
    # sending the same one still get distinct ids.
    again = http.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 1}, headers={"x-request-id": "abc-123"})
    assert r.json()["id"].startswith("chatcmpl-") and again.json()["id"] != r.json()["id"]
