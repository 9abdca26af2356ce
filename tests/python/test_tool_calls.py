"""Tool calls and reasoning end to end: the real binary and model, the real
`openai` adapter (WIT 0.2.0), the first-party parser plugins, and the
test-only `scripted` sampler, which makes the model "say" a given text so
real tool-call output of each format goes through the real pipeline.

The `openai` SDK runs full round trips (tools -> tool_calls with
finish_reason "tool_calls" -> the tool result sent back -> a final answer),
streamed and not; streamed and non-streamed responses must agree.
"""

import json

import pytest

from conftest import Server, plugin_folder

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}},
}

HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "°C"}}\n</tool_call>'
HERMES_TWO = (
    'Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    plugins = plugin_folder(
        tmp_path_factory.mktemp("tools"),
        "openai",
        "standard",
        "scripted",
        "hermes",
        "mistral",
        "llama3-json",
        "think",
        "echo-v1",
    )
    s = Server("--tool-parser", "hermes", plugins=plugins)
    yield s
    s.stop()


def scripted(text):
    return {"sampler": "scripted", "plugin_params": {"scripted": {"text": text}}}


def ask(client, messages, script, stream=False, **kw):
    extra = {**scripted(script), **kw.pop("extra_body", {})}
    return client.chat.completions.create(
        model="m", messages=messages, stream=stream, extra_body=extra, max_tokens=200, **kw
    )


def collect_stream(chunks):
    """Joins a stream the way an agent does: content, and tool calls by index."""
    content, reasoning, calls, finish, names_seen = "", "", {}, None, {}
    for c in chunks:
        if not c.choices:
            continue
        ch = c.choices[0]
        d = ch.delta
        content += d.content or ""
        reasoning += (d.model_extra or {}).get("reasoning_content") or ""
        for tc in d.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            if tc.id is not None:
                assert call["id"] is None, "id sent twice"
                call["id"] = tc.id
            if tc.function and tc.function.name is not None:
                names_seen[tc.index] = names_seen.get(tc.index, 0) + 1
                call["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                call["arguments"] += tc.function.arguments
        finish = ch.finish_reason or finish
    assert all(n == 1 for n in names_seen.values()), f"name repeated: {names_seen}"
    return content, reasoning, [calls[i] for i in sorted(calls)], finish


def test_round_trip_non_streamed(tool_server):
    client = tool_server.client()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = ask(client, messages, HERMES_CALL, tools=[WEATHER])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "°C"}

    # The result goes back; the history renders through the chat template.
    messages += [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'},
    ]
    final = ask(client, messages, "It is 21 °C in Paris.", tools=[WEATHER])
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content == "It is 21 °C in Paris."
    assert final.choices[0].message.tool_calls is None
    assert final.usage.prompt_tokens > r.usage.prompt_tokens


def test_round_trip_streamed_equals_non_streamed(tool_server):
    client = tool_server.client()
    messages = [{"role": "user", "content": "Weather and time in Paris?"}]
    whole = ask(client, messages, HERMES_TWO, tools=[WEATHER, TIME])
    content, _, calls, finish = collect_stream(ask(client, messages, HERMES_TWO, stream=True, tools=[WEATHER, TIME]))
    m = whole.choices[0].message
    assert finish == whole.choices[0].finish_reason == "tool_calls"
    # Whitespace between text and a call is the parser's, not content.
    assert content == m.content == "Checking both."
    assert [c["name"] for c in calls] == [c.function.name for c in m.tool_calls] == ["get_weather", "get_time"]
    assert [json.loads(c["arguments"]) for c in calls] == [json.loads(c.function.arguments) for c in m.tool_calls]
    # Ids are unique per call, across requests too.
    ids = [c["id"] for c in calls] + [c.id for c in m.tool_calls]
    assert len(set(ids)) == 4 and all(i.startswith("call_") for i in ids)

    messages += [
        {"role": "assistant", "content": m.content, "tool_calls": [c.model_dump() for c in m.tool_calls]},
        {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "sunny"},
        {"role": "tool", "tool_call_id": m.tool_calls[1].id, "content": "10:00"},
    ]
    content, _, calls, finish = collect_stream(ask(client, messages, "Sunny, and it is 10:00.", stream=True, tools=[WEATHER, TIME]))
    assert (content, calls, finish) == ("Sunny, and it is 10:00.", [], "stop")


def test_parallel_tool_calls_false_ends_the_reply_after_the_first_call(tool_server):
    client = tool_server.client()
    messages = [{"role": "user", "content": "Weather and time in Paris?"}]
    r = ask(client, messages, HERMES_TWO, tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    content, _, calls, finish = collect_stream(
        ask(client, messages, HERMES_TWO, stream=True, tools=[WEATHER, TIME], parallel_tool_calls=False)
    )
    assert (content, [c["name"] for c in calls], finish) == ("Checking both.", ["get_weather"], "tool_calls")
    # The row was stopped early: fewer tokens than the whole script.
    whole = ask(client, messages, HERMES_TWO, tools=[WEATHER, TIME])
    assert r.usage.completion_tokens < whole.usage.completion_tokens


def test_malformed_call_is_returned_as_content_and_counted(tool_server):
    client = tool_server.client()
    http = tool_server.http()
    before = http.get("/stats").json()["output"]["invalid_tool_calls"]
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    r = ask(client, [{"role": "user", "content": "x"}], bad, tools=[WEATHER])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].message.content == bad
    content, _, calls, finish = collect_stream(ask(client, [{"role": "user", "content": "x"}], bad, stream=True, tools=[WEATHER]))
    assert (content, calls, finish) == (bad, [], "stop")
    assert http.get("/stats").json()["output"]["invalid_tool_calls"] == before + 2


def test_without_tools_the_text_is_not_parsed(tool_server):
    r = ask(tool_server.client(), [{"role": "user", "content": "x"}], HERMES_CALL)
    assert r.choices[0].message.content == HERMES_CALL
    assert r.choices[0].finish_reason == "stop"
    r = ask(tool_server.client(), [{"role": "user", "content": "x"}], HERMES_CALL, tools=[WEATHER], tool_choice="none")
    assert r.choices[0].message.content == HERMES_CALL


def test_named_tool_choice_is_enforced(tool_server):
    # The sampler only writes arguments: the host forced the call's start.
    client = tool_server.client()
    rest = '{"city": "Oslo"}}\n</tool_call>'
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        r = ask(client, [{"role": "user", "content": "Hi"}], rest, stream=stream, tools=[WEATHER, TIME], tool_choice=choice)
        if stream:
            _, _, calls, finish = collect_stream(r)
            name, args = calls[0]["name"], calls[0]["arguments"]
        else:
            finish = r.choices[0].finish_reason
            name, args = r.choices[0].message.tool_calls[0].function.name, r.choices[0].message.tool_calls[0].function.arguments
        assert finish == "tool_calls"
        assert name == "get_weather" and json.loads(args) == {"city": "Oslo"}


def test_required_tool_choice_with_one_tool_is_enforced_on_the_real_model(tool_server):
    # Greedy SmolLM2 decides the arguments itself; the call is forced.
    r = tool_server.client().chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=60,
    )
    msg = r.choices[0].message
    if r.choices[0].finish_reason == "tool_calls":
        assert msg.tool_calls[0].function.name == "get_weather"
        assert isinstance(json.loads(msg.tool_calls[0].function.arguments), dict)
    else:
        # The model wrote arguments that do not parse: never dropped.
        assert msg.content.startswith('<tool_call>\n{"name": "get_weather", "arguments": ')


def test_required_tool_choice_over_several_tools_picks_a_declared_one(tool_server):
    # The shared start is prefilled; the name's tokens are masked to the tools'.
    for stream in (False, True):
        r = tool_server.client().chat.completions.create(
            model="m",
            messages=[{"role": "user", "content": "Tell me a joke."}],
            tools=[WEATHER, TIME],
            tool_choice="required",
            temperature=0,
            max_tokens=60,
            stream=stream,
        )
        if stream:
            content, _, calls, finish = collect_stream(r)
        else:
            msg = r.choices[0].message
            finish = r.choices[0].finish_reason
            content = msg.content or ""
            calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in msg.tool_calls or []]
        if finish == "tool_calls":
            assert calls[0]["name"] in ("get_weather", "get_time")
        else:
            assert any(content.startswith(f'<tool_call>\n{{"name": "{n}", "arguments": ') for n in ("get_weather", "get_time")), content


def test_reasoning_content(tool_server):
    client = tool_server.client()
    text = "<think>\nThe user greets me.\n</think>\n\nHello!"
    extra = {"reasoning_parser": "think"}
    r = ask(client, [{"role": "user", "content": "Hi"}], text, extra_body=extra)
    msg = r.choices[0].message
    assert msg.content == "Hello!"
    assert msg.model_extra["reasoning_content"] == "The user greets me."
    content, reasoning, _, _ = collect_stream(ask(client, [{"role": "user", "content": "Hi"}], text, stream=True, extra_body=extra))
    assert (content, reasoning) == (msg.content, msg.model_extra["reasoning_content"])


def test_mistral_format_by_request_field(tool_server):
    text = '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Rome"}}]'
    r = ask(tool_server.client(), [{"role": "user", "content": "x"}], text, tools=[WEATHER], extra_body={"tool_parser": "mistral"})
    assert r.choices[0].finish_reason == "tool_calls"
    assert json.loads(r.choices[0].message.tool_calls[0].function.arguments) == {"city": "Rome"}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"tools": "get_weather"}, "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_parser": "nope"}, "tool_parser"),
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"tools": [WEATHER], "plugin_params": {"mistral": {}}}, "plugin_params"),
    ],
)
def test_malformed_tool_fields_are_400_naming_the_field(tool_server, body, param):
    r = tool_server.http().post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize(
    "messages, param",
    [
        ([{"role": "tool", "content": "42"}], "messages[0].tool_call_id"),
        ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}]}], "messages[0].tool_calls[0].function.arguments"),
        ([{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"arguments": "{}"}}]}], "messages[0].tool_calls[0].function.name"),
    ],
)
def test_malformed_tool_history_is_400_naming_the_field(tool_server, messages, param):
    r = tool_server.http().post("/v1/chat/completions", json={"model": "m", "messages": messages})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_0_1_0_adapter_serves_beside_0_2_0_plugins(tool_server):
    http = tool_server.http()
    r = http.post("/v1/echo", json={"text": "hi", **scripted("plain words")})
    assert r.status_code == 200, r.text
    assert r.json()["text"] == "plain words" and r.json()["finish"] == "stop"
    # Its tools reach the 0.2.0 pipeline (lowered to 0.1.0 events).
    r = http.post("/v1/echo", json={"text": "hi", "tools": ["get_weather"], **scripted(HERMES_CALL)})
    body = r.json()
    assert body["finish"] == "tool_calls", body
    assert body["events"][0]["tool_call_start"][2] == "get_weather"
    # Its errors render in its own shape.
    assert http.post("/v1/echo", json={}).json() == {"error": "`text` is required"}


def test_template_kwargs_keep_prompt_cache_hits(tool_server):
    # mlx-lm issue 1803: template keyword arguments must not bypass the cache.
    http = tool_server.http()
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "A long question about caching, " * 8}],
        "chat_template_kwargs": {"enable_thinking": False},
        "max_tokens": 2,
        "temperature": 0,
    }
    first = http.post("/v1/chat/completions", json=body)
    assert first.status_code == 200, first.text
    second = http.post("/v1/chat/completions", json=body).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, second["usage"]
    bad = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": [1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_control_tokens_reach_parsers_but_never_the_user(tool_server):
    client = tool_server.client()
    # The ids of "Hello world" (vLLM's `return_tokens_as_token_ids`).
    r = ask(client, [{"role": "user", "content": "x"}], "Hello world", logprobs=True,
            extra_body={"return_tokens_as_token_ids": True})
    ids = [int(t.token.split(":")[1]) for t in r.choices[0].logprobs.content]
    # `<|im_start|>` (id 1 in SmolLM2) in the middle of the reply.
    script = {"sampler": "scripted", "plugin_params": {"scripted": {"ids": ids[:1] + [1] + ids[1:]}}}
    for tools in ({}, {"tools": [WEATHER]}):
        for stream in (False, True):
            r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                               stream=stream, extra_body=script, max_tokens=20, **tools)
            content = collect_stream(r)[0] if stream else r.choices[0].message.content
            assert content == "Hello world", (tools, stream, content)


def test_numbers_beyond_f64_are_valid_json_arguments(tool_server):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"x": 1e400}}\n</tool_call>'
    r = ask(tool_server.client(), [{"role": "user", "content": "x"}], text, tools=[WEATHER])
    assert r.choices[0].finish_reason == "tool_calls", r
    assert r.choices[0].message.tool_calls[0].function.arguments == '{"x":1e400}'


def test_parallel_false_also_cuts_calls_released_together(tool_server):
    text = '{"name": "get_weather", "parameters": {}}; {"name": "get_time", "parameters": {}}'
    extra = {"tool_parser": "llama3-json"}
    r = ask(tool_server.client(), [{"role": "user", "content": "x"}], text, tools=[WEATHER, TIME],
            parallel_tool_calls=False, extra_body=extra)
    assert [c.function.name for c in r.choices[0].message.tool_calls] == ["get_weather"]
    assert r.choices[0].finish_reason == "tool_calls"


def test_control_tokens_never_reach_invalid_calls(tool_server):
    client = tool_server.client()
    head = '<tool_call>\n{"name": "get_weather",'
    r = ask(client, [{"role": "user", "content": "x"}], head + "bad}", logprobs=True,
            extra_body={"return_tokens_as_token_ids": True})
    ids = [int(t.token.split(":")[1]) for t in r.choices[0].logprobs.content]
    n = len(ask(client, [{"role": "user", "content": "x"}], head, logprobs=True,
                extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs.content)
    script = {"sampler": "scripted", "plugin_params": {"scripted": {"ids": ids[:n] + [1] + ids[n:]}}}
    r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], tools=[WEATHER],
                                       extra_body=script, max_tokens=40)
    assert "<|im_start|>" not in r.choices[0].message.content
    assert r.choices[0].message.content.startswith(head), r.choices[0].message.content
