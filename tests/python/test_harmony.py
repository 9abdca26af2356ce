"""gpt-oss's harmony output through the real pipeline in every dialect: the test-only
`scripted` sampler makes the model (SmolLM2; the parsers read text, not token ids) "say" the
recorded harmony outputs in tests/fixtures/tool-calls/harmony/ (reasoning then a final answer,
a tool call, two parallel calls, a preamble then a call, a final answer alone), and the
`harmony` plugin's two parsers (reasoning parser: channels; tool-call parser: `to=functions.*`
messages) turn them into reasoning, content and tool calls. Chat Completions, Responses and
Anthropic Messages, streamed and not, each give the fixture's expected result.
"""

import json
import shutil

import anthropic
import pytest

from conftest import ROOT, Server, plugin_folder
from test_tool_calls import collect_stream

FIXTURES = ROOT / "tests/fixtures/tool-calls/harmony"
CASES = ["reasoning_then_final", "tool_call", "two_parallel_calls", "preamble_then_call", "final_only"]
NAMES = ["get_weather", "get_time", "search"]
PARSERS = {"tool_parser": "harmony", "reasoning_parser": "harmony"}


def case(name):
    text = (FIXTURES / f"{name}.txt").read_text()
    want = json.loads((FIXTURES / f"{name}.json").read_text())
    calls = [(c["name"], c["arguments"]) for c in want.get("calls", [])]
    return text, (want.get("content", ""), want.get("reasoning", ""), calls)


def extra(text):
    return {"sampler": "scripted", "plugin_params": {"scripted": {"text": text}}, **PARSERS}


def schema():
    return {"type": "object", "properties": {}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    plugins = plugin_folder(
        tmp_path_factory.mktemp("harmony"), "openai", "responses", "anthropic", "standard", "scripted", "harmony"
    )
    s = Server(plugins=plugins)
    yield s
    s.stop()


def chat(server, text, stream):
    tools = [{"type": "function", "function": {"name": n, "parameters": schema()}} for n in NAMES]
    r = server.client().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], tools=tools, max_tokens=300,
        stream=stream, extra_body=extra(text),
    )
    if stream:
        content, reasoning, calls, finish = collect_stream(r)
        calls = [(c["name"], json.loads(c["arguments"])) for c in calls]
    else:
        m = r.choices[0].message
        content, reasoning = m.content or "", (m.model_extra or {}).get("reasoning_content") or ""
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or []]
        finish = r.choices[0].finish_reason
    assert finish == ("tool_calls" if calls else "stop")
    return content, reasoning, calls


def responses(server, text, stream):
    client = server.client()
    kw = dict(model="m", input="Hi", tools=[{"type": "function", "name": n, "parameters": schema()} for n in NAMES],
              extra_body=extra(text))
    if stream:
        with client.responses.stream(**kw) as s:
            list(s)
            r = s.get_final_response()
    else:
        r = client.responses.create(**kw)
    reasoning = "".join(c.text for i in r.output if i.type == "reasoning" for c in i.content or [])
    calls = [(i.name, json.loads(i.arguments)) for i in r.output if i.type == "function_call"]
    return r.output_text, reasoning, calls


def messages(server, text, stream):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=300)
    kw = dict(model="m", max_tokens=300, messages=[{"role": "user", "content": "Hi"}],
              tools=[{"name": n, "input_schema": schema()} for n in NAMES], extra_body=extra(text))
    if stream:
        with client.messages.stream(**kw) as s:
            list(s)
            r = s.get_final_message()
    else:
        r = client.messages.create(**kw)
    content = "".join(b.text for b in r.content if b.type == "text")
    reasoning = "".join(b.thinking for b in r.content if b.type == "thinking")
    calls = [(b.name, b.input) for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == ("tool_use" if calls else "end_turn")
    return content, reasoning, calls


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dialect", [chat, responses, messages], ids=["chat", "responses", "messages"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_recorded_harmony_outputs_parse_the_same_in_every_dialect(server, name, dialect, stream):
    text, want = case(name)
    assert dialect(server, text, stream) == want


def test_the_parsers_are_chosen_from_a_harmony_chat_template(server, tmp_path):
    # Not naming them: SmolLM2's template lacks harmony's markers, so nothing is parsed...
    text, want = case("tool_call")
    r = server.client().chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=300,
        extra_body={"sampler": "scripted", "plugin_params": {"scripted": {"text": text}}},
    )
    assert r.choices[0].message.content == text
    # ...while a model whose template renders harmony gets `harmony` for both kinds: the
    # gpt-oss fixture (byte-level vocabulary: any text) with a small harmony template.
    model = tmp_path / "gpt-oss"
    shutil.copytree(ROOT / "tests/fixtures/models/gpt-oss-tiny", model)
    (model / "chat_template.jinja").write_text(
        "{%- for m in messages %}<|start|>{{ m.role }}"
        "{%- if m.role == 'assistant' %}<|channel|>final{% endif %}"
        "<|message|>{{ m.content }}<|end|>{% endfor %}"
        "{%- if add_generation_prompt %}<|start|>assistant{% endif %}"
    )
    plugins = plugin_folder(tmp_path, "openai", "standard", "scripted", "harmony")
    s = Server("--model", str(model), plugins=plugins)
    try:
        tools = [{"type": "function", "function": {"name": n, "parameters": schema()}} for n in NAMES]
        r = s.client().chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], tools=tools, max_tokens=400,
            extra_body={"sampler": "scripted", "plugin_params": {"scripted": {"text": text}}},
        )
        m = r.choices[0].message
        assert m.model_extra.get("reasoning_content") == want[1]
        assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == want[2]
        assert r.choices[0].finish_reason == "tool_calls"
    finally:
        s.stop()
