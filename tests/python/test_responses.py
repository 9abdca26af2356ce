"""OpenAI Responses API end to end: the real binary and model, the
first-party `responses` adapter (WIT 0.2.0 with the host's response store
and prompt counter), the parser plugins and the test-only `scripted`
sampler (the model "says" a given text), driven with the official `openai`
Python SDK and raw HTTP.

Covered: text (non-streamed, streamed through `responses.stream` and raw
SSE), full tool round trips (function_call -> function_call_output resent
as items, and through `previous_response_id`), reasoning items, stored
responses (`retrieve`, `delete`, `input_items`, `store: false`, unknown ids,
kept across a restart with `--ssd-cache`), `input_tokens`, tool types that
are ignored, a failure inside a stream (`response.failed`) and the error
shape for malformed input.
"""

import json

import openai
import pytest

from conftest import Server, plugin_folder

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PLUGINS = ("responses", "openai", "standard", "scripted", "hermes", "think", "trap")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server("--tool-parser", "hermes", plugins=plugin_folder(tmp_path_factory.mktemp("responses"), *PLUGINS))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def scripted(text):
    return {"sampler": "scripted", "plugin_params": {"scripted": {"text": text}}}


def create(client, script, **kw):
    extra = {**scripted(script), **kw.pop("extra_body", {})}
    kw.setdefault("input", "Hi")
    return client.responses.create(model="m", extra_body=extra, **kw)


def streamed(client, script, **kw):
    """Streams through the SDK's accumulator: (final response, event types,
    sequence numbers)."""
    extra = {**scripted(script), **kw.pop("extra_body", {})}
    kw.setdefault("input", "Hi")
    with client.responses.stream(model="m", extra_body=extra, **kw) as s:
        events = list(s)
        final = s.get_final_response()
    return final, [e.type for e in events], [e.sequence_number for e in events]


def items(response):
    """Output items without their ids (unique per request)."""
    out = []
    for item in response.output:
        d = item.model_dump(exclude_none=True)
        d.pop("id")
        out.append(d)
    return out


def test_text_response(client):
    r = create(client, "Hello from mlxhost.")
    assert r.object == "response" and r.status == "completed", r
    assert r.id.startswith("resp_")
    assert r.output_text == "Hello from mlxhost."
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_stream_folds_to_the_non_streamed_response(client):
    final, types, seq = streamed(client, "One two three.")
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert seq == list(range(len(seq)))
    assert types.index("response.output_item.added") < types.index("response.content_part.added")
    assert types.index("response.output_text.done") < types.index("response.output_item.done")
    assert final.output_text == "One two three."
    assert items(final) == items(create(client, "One two three."))


def test_max_output_tokens_makes_an_incomplete_response(client):
    r = create(client, "one two three four five six seven eight", max_output_tokens=2)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2
    # Streamed, the terminal event is `response.incomplete` (as OpenAI sends
    # it; the SDK's get_final_response() only accepts `response.completed`).
    with client.responses.stream(model="m", input="Hi", max_output_tokens=2,
                                 extra_body=scripted("one two three four five six seven eight")) as s:
        events = list(s)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.status == "incomplete" and events[-1].response.usage.output_tokens == 2


def test_tool_round_trip_with_items_resent(client):
    r = create(client, HERMES_CALL, input="Weather in Paris?", tools=[WEATHER])
    assert r.status == "completed"
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id
    # The whole history resent as items, as Codex CLI does (store: false).
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"},
    ]
    r2 = create(client, "It is sunny in Paris.", input=history, tools=[WEATHER], store=False)
    assert r2.output_text == "It is sunny in Paris."
    # The tool result reached the prompt: it is longer than the question alone.
    assert r2.usage.input_tokens > r.usage.input_tokens


def test_tool_round_trip_through_previous_response_id(client):
    r = create(client, HERMES_CALL, input="Weather in Paris?", tools=[WEATHER])
    [call] = r.output
    follow = [{"type": "function_call_output", "call_id": call.call_id, "output": "18 C and sunny"}]
    r2 = create(client, "Sunny.", input=follow, tools=[WEATHER], previous_response_id=r.id)
    assert r2.output_text == "Sunny." and r2.previous_response_id == r.id
    # The same conversation resent as items takes exactly as many tokens.
    resent = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        *follow,
    ]
    counted = client.responses.input_tokens.count(model="m", input=resent, tools=[WEATHER])
    assert counted.input_tokens == r2.usage.input_tokens


def test_streamed_tool_call_events(client):
    final, types, _ = streamed(client, HERMES_CALL, input="Weather?", tools=[WEATHER])
    assert "response.function_call_arguments.delta" in types
    assert "response.function_call_arguments.done" in types
    [call] = final.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}


def test_reasoning_output_and_reasoning_items_in_input(client):
    text = "<think>\nThe user greets me.\n</think>\n\nHello!"
    r = create(client, text, extra_body={"reasoning_parser": "think"}, reasoning={"summary": "auto"})
    kinds = [i.type for i in r.output]
    assert kinds == ["reasoning", "message"], r.output
    assert "The user greets me." in r.output[0].content[0].text
    assert "The user greets me." in r.output[0].summary[0].text
    assert r.output_text.strip() == "Hello!"
    final, types, _ = streamed(client, text, extra_body={"reasoning_parser": "think"}, reasoning={"summary": "auto"})
    assert "response.reasoning_text.delta" in types and "response.reasoning_summary_text.delta" in types
    assert items(final) == items(r)
    # Reasoning items come back in the next request's input (with or without summary).
    history = [
        {"role": "user", "content": "Hi"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Greeting."}], "encrypted_content": None},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"type": "reasoning", "summary": []},
        {"role": "user", "content": [{"type": "input_text", "text": "Again"}]},
    ]
    assert create(client, "ok", input=history).output_text == "ok"


def test_stored_responses_retrieve_list_delete(client):
    r = create(client, "Stored.", input="Keep this", instructions="Be brief.", metadata={"k": "v"})
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == "Stored."
    assert got.instructions == "Be brief." and got.metadata == {"k": "v"}
    listed = client.responses.input_items.list(r.id)
    assert [i.type for i in listed.data] == ["message"]
    assert listed.data[0].content[0].text == "Keep this"
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(r.id)


def test_input_items_are_listed_in_openais_item_shapes(server, client):
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    history = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking."},
        call,
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    r = create(client, "Sunny.", input=history, tools=[WEATHER])
    with server.http() as h:
        listed = h.get(f"/v1/responses/{r.id}/input_items").json()
    data = listed["data"][::-1]  # newest first
    assert [i["type"] for i in data] == ["message", "message", "function_call", "function_call_output"]
    assert data[0]["content"] == [{"type": "input_text", "text": "Weather?"}]
    assert data[1]["content"] == [{"type": "output_text", "text": "Checking.", "annotations": []}]
    assert all(isinstance(i["id"], str) and i["status"] == "completed" for i in data)
    assert len({i["id"] for i in data}) == 4
    assert listed["first_id"] == listed["data"][0]["id"]
    # The SDK parses every item.
    assert len(client.responses.input_items.list(r.id).data) == 4


def test_a_clients_request_id_never_becomes_the_response_id(server, client):
    headers = {"x-request-id": "same-id"}
    a = create(client, "First.", extra_headers=headers)
    b = create(client, "Second.", extra_headers=headers)
    assert a.id != b.id
    assert client.responses.retrieve(a.id).output_text == "First."
    assert client.responses.retrieve(b.id).output_text == "Second."


def test_a_prompt_over_the_context_is_context_length_exceeded_naming_input(server):
    with server.http() as h:
        r = h.post("/v1/responses", json={"model": "m", "input": "word " * 20000})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "input" and error["code"] == "context_length_exceeded", error
        # Counting a multi-megabyte prompt takes the host a while; the
        # adapter's deadline does not count it (an answer, never a 500).
        big = {"model": "m", "input": "word " * 600_000}
        counted = h.post("/v1/responses/input_tokens", json=big, timeout=300)
        assert counted.status_code in (200, 400), counted.text
        if counted.status_code == 200:
            assert counted.json()["input_tokens"] > 500_000
        only_instructions = h.post("/v1/responses/input_tokens", json={"model": "m", "instructions": "Be brief."})
        assert only_instructions.status_code == 200 and only_instructions.json()["input_tokens"] > 0


def test_store_false_is_not_kept_and_unknown_ids_are_404(client):
    r = create(client, "Not kept.", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError) as err:
        create(client, "x", previous_response_id="resp_does_not_exist")
    assert err.value.body["code"] == "previous_response_not_found"
    assert err.value.body["param"] == "previous_response_id"


def test_instructions_are_not_carried_to_the_next_response(client):
    r = create(client, "A.", input="Q1", instructions="You are a pirate. " * 20)
    r2 = create(client, "B.", input="Q2", previous_response_id=r.id)
    r3 = create(client, "B.", input="Q2", previous_response_id=r.id, instructions="You are a pirate. " * 20)
    assert r3.usage.input_tokens > r2.usage.input_tokens


def test_input_tokens_matches_usage(client):
    r = create(client, "ok", input="Count me, please.", instructions="Be brief.", tools=[WEATHER])
    counted = client.responses.input_tokens.count(
        model="m", input="Count me, please.", instructions="Be brief.", tools=[WEATHER]
    )
    assert counted.input_tokens == r.usage.input_tokens


def test_tool_types_other_than_function_are_ignored(client):
    tools = [
        {"type": "web_search"},
        {"type": "namespace", "name": "mcp", "tools": []},
        {"type": "custom", "name": "apply_patch"},
        WEATHER,
    ]
    r = create(client, HERMES_CALL, input="Weather?", tools=tools, parallel_tool_calls=False)
    assert r.output[0].type == "function_call"
    assert [t["type"] for t in r.model_dump()["tools"]] == ["function"]


def test_failure_inside_a_stream_is_response_failed(server):
    body = {"model": "m", "input": "Hi", "stream": True, "sampler": "trap"}
    with server.http() as h, h.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        raw = r.read().decode()
    frames = [dict(line.split(": ", 1) for line in f.splitlines()) for f in raw.split("\n\n") if f.strip()]
    last = json.loads(frames[-1]["data"])
    assert frames[-1]["event"] == "response.failed" and last["type"] == "response.failed"
    assert last["response"]["status"] == "failed"
    assert "trap" in last["response"]["error"]["message"]


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": 5}, "input"),
        ({"input": [{"type": "bogus"}]}, "input[0].type"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": []}]}, "input[0].content"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "x", "tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
        ({"input": "x", "temperature": 3}, "temperature"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata.k"),
        ({}, "input"),
    ],
)
def test_malformed_requests_are_400_naming_the_field(server, body, param):
    with server.http() as h:
        r = h.post("/v1/responses", json={"model": "m", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_stored_responses_survive_a_restart_with_the_ssd_cache(tmp_path):
    plugins = plugin_folder(tmp_path, *PLUGINS)
    cache = tmp_path / "ssd"
    s = Server("--ssd-cache", str(cache), plugins=plugins)
    try:
        r = create(s.client(), "Kept on disk.")
    finally:
        s.stop()
    s = Server("--ssd-cache", str(cache), plugins=plugins)
    try:
        c = s.client()
        assert c.responses.retrieve(r.id).output_text == "Kept on disk."
        assert create(c, "Continued.", input="and?", previous_response_id=r.id).output_text == "Continued."
    finally:
        s.stop()
