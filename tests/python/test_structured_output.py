"""Structured output on the real Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF): every reply to a
request with a JSON Schema parses and validates against that schema with an independent
validator (Python `jsonschema`, draft 2020-12, formats checked), streamed and not, greedy and
sampled; in every dialect (Chat Completions `response_format`, Responses `text.format`,
Completions' vLLM fields, Anthropic `output_config.format`); the official `openai` SDK's
`parse` helpers with a Pydantic model; and a schema feature the engine does not support is a
400 naming the field and the feature.

The 36 schemas are JSON-Schema-Test-Suite's (tests/fixtures/structured-output-schemas.json says
which and how they were picked). Requests run concurrently, so constrained rows share batch
steps with each other and with unconstrained ones.

Needs `mlxhost models pull qwen2.5-coder-0.5b` (scripts/test.sh does it) and the `grammar`
plugin built (scripts/build-plugins.sh).
"""

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pydantic
import pytest

from conftest import ROOT, Server

FIXTURE = json.loads((ROOT / "tests/fixtures/structured-output-schemas.json").read_text())
SCHEMAS = FIXTURE["schemas"]
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def qwen():
    s = Server("--model", "qwen2.5-coder-0.5b")
    yield s
    s.stop()


def prompt(schema):
    return (
        "Write one JSON value that is valid against this JSON Schema:\n"
        f"{json.dumps(schema)}\nReply with the JSON only, short."
    )


def validate(text, schema):
    """The reply parses as JSON and validates (formats included)."""
    value = json.loads(text)
    validator = jsonschema.Draft202012Validator(
        schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
    )
    errors = [e.message for e in validator.iter_errors(value)]
    assert not errors, (text, errors)


def chat(qwen, schema, stream, sampled):
    """One Chat Completions request under `schema`: (text, finish_reason)."""
    body = {
        "messages": [{"role": "user", "content": prompt(schema)}],
        "max_tokens": MAX_TOKENS,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "answer", "strict": True, "schema": schema},
        },
        "stream": stream,
        **({"temperature": 0.8, "top_p": 0.95, "seed": 7} if sampled else {"temperature": 0}),
    }
    with qwen.http() as http:
        if not stream:
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["message"]["content"], choice["finish_reason"]
        text, finish = "", None
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                for c in chunk.get("choices", []):
                    text += c["delta"].get("content") or ""
                    finish = c.get("finish_reason") or finish
        return text, finish


@pytest.mark.parametrize("mode", ["greedy", "sampled", "greedy-stream", "sampled-stream"])
def test_every_reply_validates_against_its_schema(qwen, mode):
    sampled, stream = mode.startswith("sampled"), mode.endswith("stream")
    with ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(lambda case: chat(qwen, case["schema"], stream, sampled), SCHEMAS)
        )
    failures = []
    for case, (text, finish) in zip(SCHEMAS, results):
        try:
            assert finish == "stop", f"finish_reason {finish}"
            validate(text, case["schema"])
        except (AssertionError, json.JSONDecodeError) as e:
            failures.append(f"{case['file']} / {case['description']}: {text!r}: {e}")
    assert not failures, "\n".join(failures)


def test_streamed_equals_non_streamed(qwen):
    for case in SCHEMAS[:6]:
        assert chat(qwen, case["schema"], True, False) == chat(qwen, case["schema"], False, False)


@pytest.mark.parametrize("case", FIXTURE["unsupported"], ids=lambda c: c["keyword"])
def test_an_unsupported_feature_is_a_400_naming_it(qwen, case):
    with qwen.http() as http:
        r = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": case["schema"]}},
        })
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "response_format"
    assert case["keyword"] in error["message"], error["message"]


class Person(pydantic.BaseModel):
    name: str
    age: int = pydantic.Field(ge=0, le=150)
    languages: list[str]


def test_openai_sdk_parse_helpers_with_a_pydantic_model(qwen):
    client = qwen.client()
    messages = [{"role": "user", "content": "Describe Ada, 36, who speaks English and French."}]
    parse = getattr(getattr(client, "beta", None), "chat", None)
    parse = parse.completions.parse if parse is not None else client.chat.completions.parse
    r = parse(model="m", messages=messages, response_format=Person, temperature=0, max_tokens=100)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person), r
    r = client.responses.parse(model="m", input=messages[0]["content"], text_format=Person,
                               temperature=0, max_output_tokens=100)
    assert isinstance(r.output_parsed, Person), r


def test_completions_vllm_fields(qwen):
    with qwen.http() as http:
        r = http.post("/v1/completions", json={
            "prompt": "Is water wet? Answer:", "max_tokens": 5, "temperature": 0,
            "guided_choice": ["yes", "no"]})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] in ("yes", "no")
        r = http.post("/v1/completions", json={
            "prompt": "A US phone number:", "max_tokens": 20, "temperature": 0.9, "seed": 1,
            "structured_outputs": {"regex": r"\(\d{3}\) \d{3}-\d{4}"}})
        assert r.status_code == 200, r.text
        import re
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", r.json()["choices"][0]["text"])
        r = http.post("/v1/completions", json={
            "prompt": "x", "max_tokens": 5, "guided_grammar": "start: nope"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "guided_grammar", r.text


def test_responses_and_anthropic_fields(qwen):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
              "population": {"type": "integer", "minimum": 0}},
              "required": ["city", "population"], "additionalProperties": False}
    with qwen.http() as http:
        r = http.post("/v1/responses", json={
            "input": "A big city and its population, as JSON.", "max_output_tokens": 80,
            "temperature": 0,
            "text": {"format": {"type": "json_schema", "name": "c", "schema": schema}}})
        assert r.status_code == 200, r.text
        body = r.json()
        validate(body["output"][-1]["content"][0]["text"], schema)
        assert body["text"]["format"]["type"] == "json_schema"
        r = http.post("/v1/messages", json={
            "model": "m", "max_tokens": 80, "temperature": 0,
            "messages": [{"role": "user", "content": "A big city and its population, as JSON."}],
            "output_config": {"format": {"type": "json_schema", "schema": schema}}})
        assert r.status_code == 200, r.text
        validate(r.json()["content"][0]["text"], schema)
        r = http.post("/v1/messages", json={
            "model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
            "output_config": {"format": {"type": "json_schema", "schema": {"not": {}}}}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"].startswith("output_config.format: "), r.text


def test_constrained_and_free_rows_share_steps(qwen):
    schema = {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
              "minItems": 2, "maxItems": 4}

    def free(_):
        with qwen.http() as http:
            r = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 12,
                "temperature": 0})
            return r.status_code

    with ThreadPoolExecutor(6) as pool:
        constrained = [pool.submit(chat, qwen, schema, False, True) for _ in range(3)]
        frees = list(pool.map(free, range(3)))
        for f in constrained:
            text, finish = f.result()
            assert finish == "stop"
            validate(text, schema)
    assert frees == [200, 200, 200]


def test_decode_lookahead_gives_the_same_constrained_output(qwen):
    """With `--decode-lookahead on` (the default with a GPU), a constrained row's forward runs
    ahead with the batch's and its mask is computed on the next call, once its token is taken:
    the same greedy replies as without (this CPU's default), and the steps really look ahead."""
    cases = SCHEMAS[:6]
    ahead = Server("--model", "qwen2.5-coder-0.5b", "--decode-lookahead", "on")
    try:
        def replies(server):
            with ThreadPoolExecutor(len(cases)) as pool:
                return list(pool.map(lambda c: chat(server, c["schema"], False, False), cases))

        with_lookahead = replies(ahead)
        with ahead.http() as http:
            sizes = http.get("/stats").json()["batch"]["by_batch_size"]
    finally:
        ahead.stop()
    assert sum(b["lookahead_steps"] for b in sizes if b["rows"] >= 2) > 0, sizes
    assert with_lookahead == replies(qwen)
    for case, (text, finish) in zip(cases, with_lookahead):
        assert finish == "stop"
        validate(text, case["schema"])


STRICT_TOOLS = [
    {"type": "function", "function": {"name": "book_table", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False,
        "required": ["restaurant", "party_size", "day", "time"],
        "properties": {
            "restaurant": {"type": "string", "minLength": 1, "maxLength": 40},
            "party_size": {"type": "integer", "minimum": 1, "maximum": 20},
            "day": {"enum": ["monday", "tuesday", "wednesday", "thursday", "friday",
                             "saturday", "sunday"]},
            "time": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"}}}}},
    {"type": "function", "function": {"name": "convert", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["amount", "from", "to"],
        "properties": {
            "amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000000},
            "from": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "round_to": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 4},
                                   {"type": "null"}]}}}}},
    {"type": "function", "function": {"name": "schedule", "strict": True, "parameters": {
        "type": "object", "additionalProperties": False, "required": ["title", "attendees"],
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "attendees": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
                "type": "object", "additionalProperties": False, "required": ["name"],
                "properties": {"name": {"type": "string", "maxLength": 30},
                               "optional": {"type": "boolean"}}}}}}}},
]
STRICT_PROMPTS = [
    "Book a table for 4 at Luigi on Friday at 19:00.",
    "Convert 250 US dollars to euros.",
    "Schedule a meeting called Planning with Ann and Bo.",
    "Reserve Sushi Go for two people on Sunday at noon.",
    "How many yen is 99.5 GBP? Round to 2 places.",
]


def test_strict_tool_calls_give_arguments_that_validate(qwen):
    """20 forced calls (`required` and named, sampled) of strict tools: every call's arguments
    validate against its tool's `parameters`, with Python `jsonschema`."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in STRICT_TOOLS}
    names = list(schemas)

    def call(i):
        choice = "required" if i % 2 == 0 else {"type": "function",
                                                 "function": {"name": names[i % 3]}}
        with qwen.http() as http:
            r = http.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": STRICT_PROMPTS[i % len(STRICT_PROMPTS)]}],
                "tools": STRICT_TOOLS, "tool_choice": choice, "max_tokens": 160,
                "temperature": 0.9, "seed": i})
        assert r.status_code == 200, r.text
        return choice, r.json()["choices"][0]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, range(20)))
    failures = []
    for choice, c in results:
        calls = c["message"].get("tool_calls") or []
        if c["finish_reason"] != "tool_calls" or not calls:
            failures.append(f"no call: {c}")
            continue
        for tc in calls:
            name = tc["function"]["name"]
            if isinstance(choice, dict) and name != choice["function"]["name"]:
                failures.append(f"called {name}, not the named function")
            try:
                validate(tc["function"]["arguments"], schemas[name])
            except (AssertionError, json.JSONDecodeError, KeyError) as e:
                failures.append(f"{name}: {e}")
    assert not failures, "\n".join(failures)


def test_a_grammar_failure_fails_its_row_only(tmp_path):
    """A test-only constraint plugin traps in one row and reaches a dead end in another: those
    two requests fail naming the plugin, while a constrained row sharing the batch (and the
    plugin's per-model instance, rebuilt after the trap with its session replayed) and a free
    row finish."""
    import time

    from conftest import plugin_folder

    plugins = plugin_folder(tmp_path, "openai", "standard", "constraint-trap")
    s = Server("--grammar-plugin", "constraint-trap", plugins=plugins)
    try:
        def complete(regex, delay, max_tokens):
            time.sleep(delay)
            body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0}
            if regex:
                body["guided_regex"] = regex
            with s.http() as http:
                return http.post("/v1/completions", json=body)

        with ThreadPoolExecutor(4) as pool:
            ok = pool.submit(complete, "ok", 0, 60)
            free = pool.submit(complete, None, 0, 60)
            trap = pool.submit(complete, "trap", 0.2, 10)
            dead = pool.submit(complete, "dead", 0.2, 10)
            ok, free, trap, dead = ok.result(), free.result(), trap.result(), dead.result()
        assert ok.status_code == 200, ok.text
        assert free.status_code == 200, free.text
        assert trap.status_code == 500 and "constraint-trap" in trap.text, trap.text
        assert "trapped" in trap.json()["error"]["message"], trap.text
        assert dead.status_code == 500 and "dead end" in dead.text, dead.text
        assert "rebuilt after a trap" in s.text()
    finally:
        s.stop()


@pytest.mark.parametrize("api", ["chat", "responses"])
def test_openai_agents_output_type_completes_a_run(qwen, api):
    """openai-agents with a Pydantic `output_type` runs to a typed final output against the
    server, through Chat Completions (`response_format`) and Responses (`text.format`)."""
    from agents import (Agent, OpenAIChatCompletionsModel, OpenAIResponsesModel, ModelSettings,
                        Runner, set_tracing_disabled)
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=qwen.url + "/v1", api_key="unused", max_retries=0)
    model = (OpenAIChatCompletionsModel if api == "chat" else OpenAIResponsesModel)(
        model="m", openai_client=client)
    agent = Agent(name="extractor", instructions="Extract the person the user describes.",
                  output_type=Person, model=model,
                  model_settings=ModelSettings(temperature=0, max_tokens=100))
    result = Runner.run_sync(agent, "Ada is 36 and speaks English and French.")
    assert isinstance(result.final_output, Person), result.final_output


def test_grammar_plugin_params(qwen):
    """`plugin_params.grammar` reaches the plugin: flexible whitespace is accepted, an unknown
    parameter is a 400 naming it."""
    base = {"messages": [{"role": "user", "content": "Give a JSON object with a key a."}],
            "max_tokens": 40, "temperature": 0, "response_format": {"type": "json_object"}}
    with qwen.http() as http:
        r = http.post("/v1/chat/completions", json={
            **base, "plugin_params": {"grammar": {"whitespace_flexible": True}}})
        assert r.status_code == 200, r.text
        r = http.post("/v1/chat/completions", json={
            **base, "plugin_params": {"grammar": {"indent": 2}}})
        assert r.status_code == 400, r.text
        assert "`indent`" in r.json()["error"]["message"], r.text
        r = http.post("/v1/chat/completions", json={
            "messages": base["messages"], "max_tokens": 5,
            "plugin_params": {"grammar": {"whitespace_flexible": True}}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "plugin_params", r.text
