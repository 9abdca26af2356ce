"""Speculative decoding over HTTP (docs/speculative.md): the real binary, model and plugins,
a server whose default drafter is `prompt-lookup`. Replies with drafts equal replies without
(`"speculative": false`): text, finish reason, logprobs, stop strings, tool calls, streamed and
not; `/stats` and `/metrics` count drafts; a bad `speculative` field is a 400; a drafter that
traps fails nothing. (Token-level equality on ten prompts per model, seeded sampling and the
stateful plugins, batched rows: tests/tests/speculative.rs.)
"""

import json

import pytest

from conftest import Server, chat, plugin_folder

FUNCTION = (
    "def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
    "        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n"
    "    return subtotal + tax\n"
)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    plugins = plugin_folder(
        tmp_path_factory.mktemp("spec"),
        "openai",
        "standard",
        "scripted",
        "hermes",
        "prompt-lookup",
        "bad-drafter",
    )
    s = Server("--drafter", "prompt-lookup", "--draft-max", "6", "--batch", "4", plugins=plugins)
    yield s
    s.stop()


def post(http, body):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(http, body):
    """The streamed reply's content, finish reason and tool calls, merged."""
    content, finish, calls = "", None, {}
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for c in chunk.get("choices", []):
                d = c.get("delta", {})
                content += d.get("content") or ""
                for t in d.get("tool_calls") or []:
                    call = calls.setdefault(t["index"], {"name": "", "arguments": ""})
                    f = t.get("function", {})
                    call["name"] += f.get("name") or ""
                    call["arguments"] += f.get("arguments") or ""
                finish = c.get("finish_reason") or finish
    return content, finish, [calls[i] for i in sorted(calls)]


def spec_counts(http):
    s = http.get("/stats").json()["batch"]["speculative"]
    return s["drafted"], s["accepted"]


def test_replies_with_drafts_equal_replies_without_and_stats_count_them(spec_server):
    with spec_server.http() as http:
        d0, a0 = spec_counts(http)
        for prompt in [f"Repeat this code exactly:\n\n{FUNCTION}", "Write one sentence about the sea."]:
            body = {
                "messages": chat(prompt),
                "max_tokens": 48,
                "temperature": 0,
                "logprobs": True,
                "top_logprobs": 2,
            }
            without = post(http, {**body, "speculative": False})["choices"][0]
            drafted = post(http, body)["choices"][0]
            explicit = post(http, {**body, "speculative": {"drafter": "prompt-lookup", "n_max": 3}})["choices"][0]
            for got in [drafted, explicit]:
                assert got["message"]["content"] == without["message"]["content"]
                assert got["finish_reason"] == without["finish_reason"]
                want_lp = without["logprobs"]["content"]
                got_lp = got["logprobs"]["content"]
                assert [t["token"] for t in got_lp] == [t["token"] for t in want_lp]
                for a, b in zip(got_lp, want_lp):
                    assert abs(a["logprob"] - b["logprob"]) < 1e-3, (a, b)
            content, finish, _ = streamed(http, body)
            assert (content, finish) == (without["message"]["content"], without["finish_reason"])
        d1, a1 = spec_counts(http)
        assert d1 > d0 and a1 > a0, (d0, a0, d1, a1)
        stats = http.get("/stats").json()["batch"]["speculative"]
        assert 0 < stats["acceptance_rate"] <= 1
        metrics = http.get("/metrics").text
        for name in ["spec_draft_tokens", "spec_accepted_tokens", "spec_acceptance_rate"]:
            assert f"mlxhost_{name}" in metrics, name


def test_stop_strings_and_tool_calls_are_unchanged(spec_server):
    with spec_server.http() as http:
        body = {
            "messages": chat(f"Repeat this code exactly:\n\n{FUNCTION}"),
            "max_tokens": 64,
            "temperature": 0,
            "stop": ["tax"],
        }
        without = post(http, {**body, "speculative": False})["choices"][0]
        assert without["finish_reason"] == "stop"
        got = post(http, body)["choices"][0]
        assert (got["message"]["content"], got["finish_reason"]) == (
            without["message"]["content"],
            "stop",
        )
        # A tool call that repeats the prompt's text (prompt lookup drafts it, unless the
        # server's measured costs pause the row); the scripted sampler makes the model say it.
        tools = {
            "messages": chat(f"Call exactly this:\n{CALL}"),
            "tools": [WEATHER],
            "tool_parser": "hermes",
            "max_tokens": 64,
            "sampler": "scripted",
            "plugin_params": {"scripted": {"text": CALL}},
        }
        want = post(http, {**tools, "speculative": False})["choices"][0]
        assert want["finish_reason"] == "tool_calls", want
        got = post(http, tools)["choices"][0]
        assert got["finish_reason"] == "tool_calls"
        strip = lambda calls: [(c["function"]["name"], c["function"]["arguments"]) for c in calls]  # noqa: E731
        assert strip(got["message"]["tool_calls"]) == strip(want["message"]["tool_calls"])
        _, finish, calls = streamed(http, tools)
        assert finish == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls] == strip(want["message"]["tool_calls"])


@pytest.mark.parametrize(
    "field, param",
    [
        ({"drafter": "no-such-drafter"}, "speculative"),
        ({"n_max": 65}, "speculative.n_max"),
        ({"k": 3}, "speculative.k"),
        ("yes", "speculative"),
    ],
)
def test_a_bad_speculative_field_is_a_400_naming_it(spec_server, field, param):
    with spec_server.http() as http:
        r = http.post(
            "/v1/chat/completions",
            json={"messages": chat("Hi"), "max_tokens": 4, "speculative": field},
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
def test_a_hostile_drafter_fails_nothing(spec_server, mode):
    """Wrong drafts, a trap in `draft` or `create`, ids outside the vocabulary: the reply is
    the one without drafts, and the server stays healthy."""
    with spec_server.http() as http:
        body = {"messages": chat(f"Repeat this code exactly:\n\n{FUNCTION}"), "max_tokens": 24, "temperature": 0}
        want = post(http, {**body, "speculative": False})["choices"][0]["message"]["content"]
        bad = {
            **body,
            "speculative": {"drafter": "bad-drafter"},
            "plugin_params": {"bad-drafter": {"mode": mode}},
        }
        assert post(http, bad)["choices"][0]["message"]["content"] == want
        assert http.get("/health").json()["status"] == "ok"


@pytest.fixture(scope="module")
def draft_server(tmp_path_factory):
    """A server whose default drafter is the draft model: SmolLM2 drafting for itself."""
    plugins = plugin_folder(tmp_path_factory.mktemp("draft"), "openai", "standard", "prompt-lookup")
    model = str(Server.default_model())
    s = Server("--draft-model", model, "--drafter", "draft-model", "--batch", "4", plugins=plugins)
    yield s
    s.stop()


def test_the_draft_model_changes_no_reply_and_is_chosen_like_a_plugin(draft_server):
    with draft_server.http() as http:
        d0, a0 = spec_counts(http)
        body = {
            "messages": chat("Write one sentence about the sea."),
            "max_tokens": 40,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        }
        without = post(http, {**body, "speculative": False})["choices"][0]
        for spec in [None, {"drafter": "draft-model", "n_max": 4}, {"drafter": "prompt-lookup"}]:
            got = post(http, body if spec is None else {**body, "speculative": spec})["choices"][0]
            assert got["message"]["content"] == without["message"]["content"], spec
            assert got["finish_reason"] == without["finish_reason"]
            got_lp, want_lp = got["logprobs"]["content"], without["logprobs"]["content"]
            assert [t["token"] for t in got_lp] == [t["token"] for t in want_lp]
        content, finish = streamed(http, body)[:2]
        assert (content, finish) == (without["message"]["content"], without["finish_reason"])
        d1, a1 = spec_counts(http)
        assert d1 > d0 and a1 > a0, (d0, a0, d1, a1)
        assert http.get("/stats").json()["batch"]["speculative"]["draft_model_ms"] > 0


def test_without_a_draft_model_the_draft_model_drafter_is_a_400(spec_server):
    with spec_server.http() as http:
        r = http.post(
            "/v1/chat/completions",
            json={"messages": chat("Hi"), "max_tokens": 4, "speculative": {"drafter": "draft-model"}},
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "speculative", r.text
