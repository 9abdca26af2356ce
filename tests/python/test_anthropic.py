"""Anthropic Messages API end to end: the real binary and model, the
first-party `anthropic` adapter (WIT 0.2.0), the parser plugins and the
test-only `scripted` sampler (the model "says" a given text), driven with
the official `anthropic` Python SDK and raw HTTP.

Covered: plain text (non-streamed, streamed through `messages.stream` and
`create(stream=True)`, and the raw SSE framing), full tool round trips
(tools -> tool_use with stop_reason "tool_use" -> tool_result sent back ->
final text), stop sequences, enforced tool_choice, thinking blocks, a
system message mid-conversation, the prompt the adapter builds (compared
with the openai adapter's for the same conversation) and Anthropic's error
shape.
"""

import json

import anthropic
import pytest

from conftest import Server, plugin_folder

WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["city"],
    },
}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}}}}

HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
HERMES_TWO = (
    'Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    plugins = plugin_folder(
        tmp_path_factory.mktemp("anthropic"),
        "anthropic",
        "openai",
        "standard",
        "scripted",
        "hermes",
        "think",
        "trap",
    )
    s = Server("--tool-parser", "hermes", plugins=plugins)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


def scripted(text):
    return {"sampler": "scripted", "plugin_params": {"scripted": {"text": text}}}


def user(text):
    return {"role": "user", "content": text}


def ask(client, messages, script, **kw):
    extra = {**scripted(script), **kw.pop("extra_body", {})}
    kw.setdefault("max_tokens", 200)
    return client.messages.create(model="claude-any", messages=messages, extra_body=extra, **kw)


def ask_streamed(client, messages, script, **kw):
    """Streams through the SDK's accumulator; returns (final message, text
    deltas joined, the stream's event types)."""
    extra = {**scripted(script), **kw.pop("extra_body", {})}
    kw.setdefault("max_tokens", 200)
    with client.messages.stream(model="claude-any", messages=messages, extra_body=extra, **kw) as s:
        types = [e.type for e in s]
        final = s.get_final_message()
    text = "".join(b.text for b in final.content if b.type == "text")
    return final, text, types


def blocks(message):
    """Content blocks without their (unique) tool-use ids."""
    out = []
    for b in message.content:
        d = b.model_dump(exclude_none=True)
        if b.type == "tool_use":
            assert b.id.startswith("toolu_"), b.id
            d.pop("id")
            d.pop("caller", None)
        out.append(d)
    return out


def test_plain_text_non_streamed(client):
    r = ask(client, [user("Say hello.")], "Hello there.")
    assert r.type == "message" and r.role == "assistant"
    assert r.id.startswith("msg_")
    assert r.model.startswith("SmolLM2-135M-Instruct")
    assert [b.type for b in r.content] == ["text"]
    assert r.content[0].text == "Hello there."
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    assert r.usage.input_tokens + r.usage.cache_read_input_tokens > 10
    assert r.usage.cache_creation_input_tokens == 0
    assert r.usage.output_tokens > 0


def test_plain_text_streamed_equals_non_streamed(client):
    messages = [user("Say hello, streamed.")]
    whole = ask(client, messages, "Hello there, friend.")
    final, text, types = ask_streamed(client, messages, "Hello there, friend.")
    assert text == whole.content[0].text == "Hello there, friend."
    assert blocks(final) == blocks(whole)
    assert (final.stop_reason, final.stop_sequence) == ("end_turn", None)
    assert final.id.startswith("msg_") and final.id != whole.id
    assert types[0] == "message_start" and types[-1] == "message_stop"
    assert final.usage.output_tokens == whole.usage.output_tokens
    total = lambda u: u.input_tokens + (u.cache_read_input_tokens or 0)  # noqa: E731
    assert total(final.usage) == total(whole.usage)


def test_raw_stream_events_are_anthropic_events(client):
    extra = scripted("One two three.")
    events = list(
        client.messages.create(model="m", max_tokens=50, messages=[user("Count.")], stream=True, extra_body=extra)
    )
    types = [e.type for e in events]
    # The SDK drops `ping`; the raw framing is checked below.
    assert types[0] == "message_start"
    assert types[1] == "content_block_start"
    assert set(types[2:-3]) == {"content_block_delta"}
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[0].message
    assert (start.content, start.stop_reason, start.stop_sequence) == ([], None, None)
    assert events[1].index == 0 and events[1].content_block.type == "text" and events[1].content_block.text == ""
    assert "".join(e.delta.text for e in events[2:-3]) == "One two three."
    delta = events[-2]
    assert (delta.delta.stop_reason, delta.delta.stop_sequence) == ("end_turn", None)
    assert delta.usage.output_tokens > 0
    # The prompt's size is in message_start (the host's first update
    # carries it) and again, cumulative, in message_delta.
    prompt = start.usage.input_tokens + (start.usage.cache_read_input_tokens or 0)
    assert prompt > 10
    assert delta.usage.input_tokens + delta.usage.cache_read_input_tokens == prompt


def test_raw_sse_framing_names_every_event(server):
    body = {"model": "m", "max_tokens": 20, "stream": True, "messages": [user("Hi")], **scripted("Hi!")}
    headers = {"x-api-key": "k", "anthropic-version": "2023-06-01", "anthropic-beta": "interleaved-thinking-2025-05-14"}
    with server.http() as h, h.stream("POST", "/v1/messages", json=body, headers=headers) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    frames = [f for f in raw.split("\n\n") if f.strip()]
    names = []
    for f in frames:
        lines = dict(line.split(": ", 1) for line in f.splitlines())
        assert json.loads(lines["data"])["type"] == lines["event"], f
        if not names or names[-1] != lines["event"]:
            names.append(lines["event"])
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]


def test_tool_round_trip_non_streamed(client):
    messages = [user("What is the weather in Paris?")]
    r = ask(client, messages, HERMES_CALL, tools=[WEATHER])
    assert r.stop_reason == "tool_use" and r.stop_sequence is None
    (call,) = r.content
    assert call.type == "tool_use" and call.id.startswith("toolu_")
    assert call.name == "get_weather"
    assert call.input == {"city": "Paris", "unit": "°C"}

    # The result goes back (the SDK's own blocks as the assistant turn).
    messages += [
        {"role": "assistant", "content": r.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": '{"temperature": 21}'}]},
    ]
    final = ask(client, messages, "It is 21 °C in Paris.", tools=[WEATHER])
    assert final.stop_reason == "end_turn"
    assert [b.type for b in final.content] == ["text"]
    assert final.content[0].text == "It is 21 °C in Paris."
    size = lambda u: u.input_tokens + u.cache_read_input_tokens  # noqa: E731
    assert size(final.usage) > size(r.usage)


def test_tool_round_trip_streamed_equals_non_streamed(client):
    messages = [user("Weather and time in Paris?")]
    whole = ask(client, messages, HERMES_TWO, tools=[WEATHER, TIME])
    final, text, types = ask_streamed(client, messages, HERMES_TWO, tools=[WEATHER, TIME])
    expected = [
        {"type": "text", "text": "Checking both."},
        {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "name": "get_time", "input": {"tz": "Europe/Paris"}},
    ]
    assert blocks(whole) == blocks(final) == expected
    assert whole.stop_reason == final.stop_reason == "tool_use"
    assert "input_json" in types and types.count("content_block_stop") == 3
    # Ids are unique per call, across requests too.
    ids = [b.id for m in (whole, final) for b in m.content if b.type == "tool_use"]
    assert len(set(ids)) == 4

    # Both results back in one user turn, with a note after them.
    calls = [b for b in final.content if b.type == "tool_use"]
    messages += [
        {"role": "assistant", "content": final.content},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": calls[0].id, "content": [{"type": "text", "text": "sunny"}]},
                {"type": "tool_result", "tool_use_id": calls[1].id, "content": "clock offline", "is_error": True},
                {"type": "text", "text": "Answer briefly."},
            ],
        },
    ]
    final, text, _ = ask_streamed(client, messages, "Sunny; the time is unknown.", tools=[WEATHER, TIME])
    assert (text, final.stop_reason) == ("Sunny; the time is unknown.", "end_turn")
    assert [b.type for b in final.content] == ["text"]


def test_disable_parallel_tool_use_ends_after_the_first_call(client):
    messages = [user("Weather and time in Paris?")]
    choice = {"type": "auto", "disable_parallel_tool_use": True}
    r = ask(client, messages, HERMES_TWO, tools=[WEATHER, TIME], tool_choice=choice)
    assert r.stop_reason == "tool_use"
    assert [b.get("name") for b in blocks(r)] == [None, "get_weather"]
    final, _, _ = ask_streamed(client, messages, HERMES_TWO, tools=[WEATHER, TIME], tool_choice=choice)
    assert blocks(final) == blocks(r)


def test_stop_sequences(client):
    script = "Hello STOP world"
    r = ask(client, [user("x")], script, stop_sequences=["STOP"])
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", "STOP")
    assert r.content[0].text == "Hello "
    final, text, _ = ask_streamed(client, [user("x")], script, stop_sequences=["NEVER", "STOP"])
    assert (final.stop_reason, final.stop_sequence, text) == ("stop_sequence", "STOP", "Hello ")
    # Not matched: a normal end.
    r = ask(client, [user("x")], script, stop_sequences=["NEVER"])
    assert (r.stop_reason, r.stop_sequence, r.content[0].text) == ("end_turn", None, script)


def test_max_tokens_gives_stop_reason_max_tokens(client):
    r = ask(client, [user("x")], "one two three four five six seven eight nine ten", max_tokens=3)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_tool_and_any_are_enforced(client, stream):
    # The sampler only writes the arguments: the host forced the call's start.
    rest = '{"city": "Oslo"}}\n</tool_call>'
    for tools, choice in (
        ([WEATHER, TIME], {"type": "tool", "name": "get_weather"}),
        ([WEATHER], {"type": "any"}),
    ):
        if stream:
            r, _, _ = ask_streamed(client, [user("Hi")], rest, tools=tools, tool_choice=choice)
        else:
            r = ask(client, [user("Hi")], rest, tools=tools, tool_choice=choice)
        assert r.stop_reason == "tool_use", r
        assert blocks(r) == [{"type": "tool_use", "name": "get_weather", "input": {"city": "Oslo"}}]


def test_tool_choice_none_leaves_the_text_unparsed(client):
    r = ask(client, [user("x")], HERMES_CALL, tools=[WEATHER], tool_choice={"type": "none"})
    assert (r.stop_reason, r.content[0].text) == ("end_turn", HERMES_CALL)


def test_thinking_blocks(client):
    text = "<think>\nThe user greets me.\n</think>\n\nHello!"
    extra = {"reasoning_parser": "think"}
    r = ask(client, [user("Hi")], text, extra_body=extra, thinking={"type": "enabled", "budget_tokens": 1024})
    expected = [
        {"type": "thinking", "thinking": "The user greets me.", "signature": ""},
        {"type": "text", "text": "Hello!"},
    ]
    assert blocks(r) == expected
    final, streamed_text, types = ask_streamed(client, [user("Hi")], text, extra_body=extra)
    assert blocks(final) == expected and streamed_text == "Hello!"
    assert "thinking" in types
    # The thinking goes back in the history (signature and all).
    messages = [user("Hi"), {"role": "assistant", "content": r.content}, user("And now?")]
    again = ask(client, messages, "Still here.", extra_body=extra)
    assert blocks(again) == [{"type": "text", "text": "Still here."}]


def openai_prompt_tokens(server, messages, **kw):
    """The prompt size the openai adapter gets for the same conversation."""
    with server.http() as h:
        r = h.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": messages, "max_tokens": 1, **scripted("ok"), **kw},
        )
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def prompt_tokens(message):
    return message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_system_forms_and_a_system_message_mid_conversation(server, client):
    # Claude Code sends a role "system" message between turns: it is kept
    # in place, as the same conversation through the openai adapter.
    history = [user("Hi"), {"role": "assistant", "content": "Hello!"}]
    mid = {"role": "system", "content": "Answer in French from now on."}
    r = ask(client, [*history, mid, user("How are you?")], "Bien.", system="You are terse.", max_tokens=5)
    assert r.content[0].text == "Bien."
    same = openai_prompt_tokens(
        server, [{"role": "system", "content": "You are terse."}, *history, mid, user("How are you?")]
    )
    assert prompt_tokens(r) == same
    without = ask(client, [*history, user("How are you?")], "Bien.", system="You are terse.", max_tokens=5)
    assert prompt_tokens(without) < prompt_tokens(r)
    # `system` as text blocks (cache_control ignored) is the same prompt.
    blocks_system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}}]
    r2 = ask(client, [*history, mid, user("How are you?")], "Bien.", system=blocks_system, max_tokens=5)
    assert prompt_tokens(r2) == prompt_tokens(r)


def billing(suffix):
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{suffix}; cc_entrypoint=sdk-cli;"}


def test_a_new_claude_code_session_reuses_the_system_prompt(server, client):
    # Claude Code's first system block changes with every session; everything after it does not.
    # Dropped (the default), a second session's request reuses the whole system prompt.
    agent = [{"type": "text", "text": "You are an agent. " * 60, "cache_control": {"type": "ephemeral"}}]
    first = ask(client, [user("Session one.")], "Ok.", system=[billing("3af"), *agent], max_tokens=3)
    second = ask(client, [user("Session two.")], "Ok.", system=[billing("b1a"), *agent], max_tokens=3)
    assert prompt_tokens(second) == prompt_tokens(first)
    cached = second.usage.cache_read_input_tokens
    assert cached >= 0.9 * prompt_tokens(second) - 10, (cached, prompt_tokens(second))
    # The same prompt as a system of the agent's text alone.
    plain = ask(client, [user("Session two.")], "Ok.", system=agent, max_tokens=3)
    assert prompt_tokens(plain) == prompt_tokens(second)
    # Kept verbatim on request (x-mlxhost-keep-metadata; the server's --keep-prompt-metadata):
    # the block reaches the prompt and a new suffix reuses almost nothing.
    keep = {"x-mlxhost-keep-metadata": "true"}
    kept = ask(client, [user("Session three.")], "Ok.", system=[billing("df8"), *agent], max_tokens=3, extra_headers=keep)
    assert prompt_tokens(kept) > prompt_tokens(plain)
    assert kept.usage.cache_read_input_tokens < 0.5 * prompt_tokens(kept), kept.usage


def test_keep_prompt_metadata_flag_keeps_the_billing_block():
    s = Server("--keep-prompt-metadata")
    try:
        c = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0, timeout=300)
        body = dict(model="m", max_tokens=2, messages=[user("Hi")])
        kept = c.messages.create(system=[billing("3af"), {"type": "text", "text": "Be brief."}], **body)
        plain = c.messages.create(system="Be brief.", **body)
        assert prompt_tokens(kept) > prompt_tokens(plain)
    finally:
        s.stop()


def test_tool_history_is_the_same_prompt_as_through_openai(server, client):
    anthropic_history = [
        user("Weather in Paris?"),
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                {"type": "text", "text": "Thanks."},
            ],
        },
    ]
    openai_history = [
        user("Weather in Paris?"),
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
        user("Thanks."),
    ]
    openai_tools = [
        {"type": "function", "function": {"name": WEATHER["name"], "description": WEATHER["description"], "parameters": WEATHER["input_schema"]}}
    ]
    r = ask(client, anthropic_history, "ok", tools=[WEATHER], max_tokens=1)
    assert prompt_tokens(r) == openai_prompt_tokens(server, openai_history, tools=openai_tools)


def test_server_tools_are_ignored_and_headers_accepted(client):
    tools = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}, WEATHER]
    r = ask(client, [user("Weather?")], HERMES_CALL, tools=tools, metadata={"user_id": "u1"}, service_tier="auto")
    assert r.stop_reason == "tool_use" and r.content[0].name == "get_weather"
    # The beta surface posts to /v1/messages?beta=true with anthropic-beta.
    b = client.beta.messages.create(
        model="m",
        max_tokens=20,
        messages=[user("Hi")],
        betas=["context-management-2025-06-27"],
        extra_body=scripted("Beta hello."),
    )
    assert b.content[0].text == "Beta hello."


@pytest.mark.parametrize(
    "kw, path",
    [
        (
            {"messages": [{"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}},
            ]}]},
            "messages[0].content[1]",
        ),
        ({"tools": [{"name": "f", "input_schema": "object"}]}, "tools[0].input_schema"),
        ({"tools": [{"name": "", "input_schema": {"type": "object"}}]}, "tools[0].name"),
        ({"tools": [{"name": "get weather", "input_schema": {"type": "object"}}]}, "tools[0].name"),
        ({"extra_body": {"plugin_params": {"standard": {"x": 1}}}}, "plugin_params.standard"),
        ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": ""}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages[0].content[0].tool_use_id"),
        ({"extra_body": {"temperature": 1.5}}, "temperature"),
        ({"extra_body": {"tool_parser": "nope"}, "tools": [WEATHER]}, "tool_parser"),
    ],
)
def test_bad_requests_are_anthropic_400s_naming_the_field(client, kw, path):
    kw.setdefault("messages", [user("x")])
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model="m", max_tokens=10, **kw)
    e = err.value
    assert e.status_code == 400
    assert e.body["type"] == "error"
    assert e.body["error"]["type"] == "invalid_request_error"
    assert e.body["error"]["message"].startswith(path + ": "), e.body
    assert e.body["request_id"] == e.response.headers["x-request-id"]


def test_image_is_rejected_as_text_only(client):
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(
            model="m",
            max_tokens=10,
            messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}],
        )
    assert "text only" in err.value.body["error"]["message"]


def test_missing_max_tokens_is_a_400(server):
    # The SDK will not send a request without max_tokens: raw HTTP.
    with server.http() as h:
        r = h.post("/v1/messages", json={"model": "m", "messages": [user("x")]})
        assert r.status_code == 400
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"].startswith("max_tokens: ")
        r = h.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_max_tokens_over_the_context_is_clamped_not_rejected(server):
    # Anthropic's max_tokens is an upper bound (clamp-max-tokens): raw HTTP,
    # since the SDK may refuse such a large non-streamed max_tokens itself.
    with server.http() as h:
        r = h.post("/v1/messages", json={"model": "m", "max_tokens": 1_000_000, "messages": [user("x")],
                                         "sampler": "scripted", "plugin_params": {"scripted": {"text": "ok"}}})
    assert r.status_code == 200, r.text
    assert r.json()["content"][0]["text"] == "ok"


def test_count_tokens_equals_the_prompt_a_message_takes(client):
    system = "You are terse."
    messages = [user("What is the weather in Paris?")]
    counted = client.messages.count_tokens(model="m", system=system, messages=messages, tools=[WEATHER])
    reply = ask(client, messages, "ok", system=system, tools=[WEATHER])
    assert counted.input_tokens == reply.usage.input_tokens + reply.usage.cache_read_input_tokens > 0
    # The system prompt is part of it.
    longer = client.messages.count_tokens(model="m", system=system * 5, messages=messages, tools=[WEATHER])
    assert longer.input_tokens > counted.input_tokens
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model="m", messages=[])


def test_models_in_anthropic_shape(client, server):
    page = client.models.list()
    [model] = page.data
    assert model.type == "model" and model.id and model.created_at.year >= 2025
    assert client.models.retrieve(model.id).id == model.id
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("no-such-model")
    # Without Anthropic's header the same route answers in OpenAI's shape.
    with server.http() as h:
        assert h.get("/v1/models").json()["object"] == "list"


def test_a_failure_inside_a_stream_is_an_anthropic_error_body(server):
    # The `trap` sampler fails on its third step, after the stream began.
    body = {"model": "m", "max_tokens": 20, "stream": True, "messages": [user("Hi")], "sampler": "trap"}
    with server.http() as h, h.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    frames = [dict(line.split(": ", 1) for line in f.splitlines()) for f in raw.split("\n\n") if f.strip()]
    assert frames[0]["event"] == "message_start"
    # The error is the stream's last event, named as Anthropic names it.
    assert frames[-1].get("event") == "error", frames[-1]
    error = json.loads(frames[-1]["data"])
    assert error["type"] == "error" and error["error"]["type"] == "api_error", error
    assert "trap" in error["error"]["message"]


def test_the_sdk_raises_on_a_failure_inside_a_stream(client):
    with pytest.raises(anthropic.APIStatusError):
        with client.messages.stream(model="m", max_tokens=20, messages=[user("Hi")], extra_body={"sampler": "trap"}) as s:
            for _ in s:
                pass


def test_max_tokens_beyond_the_context_is_an_upper_bound(client):
    # Claude Code sends max_tokens 32000 whatever the model's context is.
    r = client.messages.create(model="m", max_tokens=1_000_000, messages=[user("Hi")],
                               extra_body={"sampler": "scripted", "plugin_params": {"scripted": {"text": "Hello."}}})
    assert r.content[0].text == "Hello." and r.stop_reason == "end_turn"
