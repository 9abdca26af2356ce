//! Native unit tests of the request parser and the renderers.
//!
//! Run them on the host (not wasm32), with the default rustup toolchain; the
//! `--target` overrides `plugins/.cargo/config.toml`'s wasm32 target and
//! stable cargo ignores its `[unstable] build-std`:
//!
//!     cd plugins/openai && cargo test --target x86_64-unknown-linux-gnu

use mlxhost_plugin_sdk::v2::adapter::exports::mlxhost::plugin::api_adapter::{
    self as api, Action, GenerationUpdate, HttpRequest, RequestContext, Usage,
};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::request::{
    ContentPart, GenerationRequest, Prompt, ToolChoice,
};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::types::{
    FinishReason, GenerationEvent as E, ToolCallDelta, ToolCallStart,
};
use serde_json::{json, Value};

use crate::render;
use crate::request::{self, RenderOptions};

fn parse(body: Value) -> GenerationRequest {
    match request::parse(body.to_string().as_bytes()) {
        Ok((r, _)) => r,
        Err(e) => panic!("rejected: {e:?}\nbody: {body}"),
    }
}

fn param_of(body: Value) -> String {
    match request::parse(body.to_string().as_bytes()) {
        Ok(_) => panic!("accepted: {body}"),
        Err(e) => e.param.unwrap_or_default(),
    }
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

fn weather_tool() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        "strict": true,
    }})
}

fn time_tool() -> Value {
    json!({"type": "function", "function": {"name": "get-time"}})
}

/// A conversation that called two tools and got their results.
fn round_trip() -> Value {
    json!({
        "model": "any",
        "messages": [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [
                {"type": "text", "text": "Weather in Paris "},
                {"type": "text", "text": "and the time?"},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
            ], "name": "ann"},
            {"role": "assistant", "content": null, "reasoning_content": "Two calls.", "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                {"id": "call_2", "function": {"name": "get-time", "arguments": "{}"}},
            ]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
            {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "12:00"}]},
            {"role": "assistant", "content": "It is 18C at 12:00.", "reasoning": "Done."},
            user("Thanks"),
        ],
        "tools": [weather_tool(), time_tool()],
    })
}

#[test]
fn tool_round_trip_history_parses() {
    let r = parse(round_trip());
    let Prompt::Messages(m) = &r.prompt else {
        panic!("prompt is not messages")
    };
    assert_eq!(m.len(), 7);
    assert_eq!(m[0].role, "system");
    assert_eq!(m[1].name.as_deref(), Some("ann"));
    assert!(matches!(
        m[1].content.as_slice(),
        [ContentPart::Text(a), ContentPart::Text(b), ContentPart::ImageUrl(u)]
            if a == "Weather in Paris " && b == "and the time?" && u.starts_with("data:image/png")
    ));
    let a = &m[2];
    assert_eq!(a.role, "assistant");
    assert!(a.content.is_empty());
    assert_eq!(a.reasoning.as_deref(), Some("Two calls."));
    assert_eq!(a.tool_calls.len(), 2);
    assert_eq!(
        (
            a.tool_calls[0].id.as_str(),
            a.tool_calls[0].name.as_str(),
            a.tool_calls[0].arguments.as_str()
        ),
        ("call_1", "get_weather", "{\"city\": \"Paris\"}")
    );
    assert_eq!(
        (a.tool_calls[1].id.as_str(), a.tool_calls[1].name.as_str()),
        ("call_2", "get-time")
    );
    assert_eq!(m[3].role, "tool");
    assert_eq!(m[3].tool_call_id.as_deref(), Some("call_1"));
    assert!(matches!(m[3].content.as_slice(), [ContentPart::Text(t)] if t == "18C"));
    assert_eq!(m[4].tool_call_id.as_deref(), Some("call_2"));
    assert_eq!(m[5].reasoning.as_deref(), Some("Done."));
    assert!(m[5].tool_calls.is_empty() && m[5].tool_call_id.is_none());

    assert_eq!(r.tools.len(), 2);
    assert_eq!(r.tools[0].name, "get_weather");
    assert_eq!(r.tools[0].description, "Current weather");
    let schema: Value = serde_json::from_str(&r.tools[0].parameters_json).unwrap();
    assert_eq!(schema["properties"]["city"]["type"], "string");
    assert_eq!(r.tools[1].parameters_json, "{}");
    assert_eq!(r.tools[1].description, "");
    assert!(matches!(r.tool_choice, ToolChoice::Auto));
    assert!(r.parallel_tool_calls);
    assert_eq!(r.chat_template_kwargs, "{}");
    assert_eq!(r.plugin_params, "{}");
    assert!(r.tool_parser.is_none() && r.reasoning_parser.is_none());
    assert!(r.previous_response_id.is_none());
}

#[test]
fn tool_choice_and_extension_fields() {
    let with = |extra: Value| {
        let mut b = json!({"messages": [user("hi")], "tools": [weather_tool(), time_tool()]});
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        parse(b)
    };
    assert!(matches!(
        with(json!({"tool_choice": "none"})).tool_choice,
        ToolChoice::None
    ));
    assert!(matches!(
        with(json!({"tool_choice": "auto"})).tool_choice,
        ToolChoice::Auto
    ));
    assert!(matches!(
        with(json!({"tool_choice": "required"})).tool_choice,
        ToolChoice::Required
    ));
    assert!(matches!(
        with(json!({"tool_choice": {"type": "function", "function": {"name": "get-time"}}})).tool_choice,
        ToolChoice::Named(n) if n == "get-time"
    ));
    // No tools: the default (and an explicit "auto") is none.
    assert!(matches!(
        parse(json!({"messages": [user("hi")]})).tool_choice,
        ToolChoice::None
    ));
    assert!(matches!(
        parse(json!({"messages": [user("hi")], "tool_choice": "auto", "tools": []})).tool_choice,
        ToolChoice::None
    ));
    let r = with(json!({
        "parallel_tool_calls": false,
        "tool_parser": "hermes",
        "reasoning_parser": "none",
        "chat_template_kwargs": {"enable_thinking": false},
        "response_format": {"type": "text"},
        "sampler": "standard",
        "logits_processors": ["dry"],
        "plugin_params": {"dry": {"multiplier": 0.8}},
        "stream": true,
        "stream_options": {"include_usage": true},
        "user": "ignored",
    }));
    assert!(!r.parallel_tool_calls);
    assert_eq!(r.tool_parser.as_deref(), Some("hermes"));
    assert_eq!(r.reasoning_parser.as_deref(), Some("none"));
    assert_eq!(
        serde_json::from_str::<Value>(&r.chat_template_kwargs).unwrap(),
        json!({"enable_thinking": false})
    );
    assert_eq!(r.sampler.as_deref(), Some("standard"));
    assert_eq!(r.logits_processors, vec!["dry".to_string()]);
    assert!(r.stream && r.include_usage);
}

#[test]
fn each_rejection_names_its_param() {
    let base = |messages: Value| json!({"messages": messages});
    let tools = |t: Value| json!({"messages": [user("hi")], "tools": t});
    let choice =
        |c: Value| json!({"messages": [user("hi")], "tools": [weather_tool()], "tool_choice": c});
    let call = |c: Value| {
        base(json!([user("hi"), {"role": "assistant", "content": null, "tool_calls": [c]}]))
    };
    let cases: Vec<(Value, &str)> = vec![
        // messages (as before)
        (json!({}), "messages"),
        (base(json!([])), "messages"),
        (base(json!("hello")), "messages"),
        (
            base(json!([{"role": "wizard", "content": "x"}])),
            "messages[0].role",
        ),
        (base(json!([{"role": "user"}])), "messages[0].content"),
        (
            base(json!([{"role": "user", "content": 5}])),
            "messages[0].content",
        ),
        // content parts
        (
            base(
                json!([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]),
            ),
            "messages[0].content[0].type",
        ),
        (
            base(json!([{"role": "user", "content": [{"text": "x"}]}])),
            "messages[0].content[0].type",
        ),
        (
            base(json!([{"role": "user", "content": [{"type": "text"}]}])),
            "messages[0].content[0].text",
        ),
        (
            base(json!([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}])),
            "messages[0].content[0].image_url",
        ),
        (
            base(
                json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 1}}]}]),
            ),
            "messages[0].content[0].image_url.url",
        ),
        (
            base(
                json!([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            ),
            "messages[0].content[0].type",
        ),
        (
            base(json!([{"role": "user", "content": "x", "name": 3}])),
            "messages[0].name",
        ),
        // assistant tool calls
        (
            call(json!({"type": "function", "function": {"name": "f", "arguments": "{}"}})),
            "messages[1].tool_calls[0].id",
        ),
        (
            call(json!({"id": 7, "function": {"name": "f", "arguments": "{}"}})),
            "messages[1].tool_calls[0].id",
        ),
        (
            call(
                json!({"id": "c", "type": "custom", "function": {"name": "f", "arguments": "{}"}}),
            ),
            "messages[1].tool_calls[0].type",
        ),
        (
            call(json!({"id": "c", "type": "function"})),
            "messages[1].tool_calls[0].function",
        ),
        (
            call(json!({"id": "c", "function": {"arguments": "{}"}})),
            "messages[1].tool_calls[0].function.name",
        ),
        (
            call(json!({"id": "c", "function": {"name": "f", "arguments": {"a": 1}}})),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            call(json!({"id": "c", "function": {"name": "f", "arguments": "{not json"}})),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            call(json!({"id": "c", "function": {"name": "f", "arguments": "[1]"}})),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            call(json!({"id": "c", "function": {"name": "f"}})),
            "messages[1].tool_calls[0].function.arguments",
        ),
        (call(json!("call")), "messages[1].tool_calls[0]"),
        (
            base(json!([{"role": "assistant", "content": "x", "tool_calls": {}}])),
            "messages[0].tool_calls",
        ),
        (
            base(json!([{"role": "user", "content": "x", "tool_calls": [{"id": "c"}]}])),
            "messages[0].tool_calls",
        ),
        (
            base(json!([{"role": "assistant", "content": "x", "reasoning_content": 1}])),
            "messages[0].reasoning_content",
        ),
        // tool messages
        (
            base(json!([user("hi"), {"role": "tool", "content": "18C"}])),
            "messages[1].tool_call_id",
        ),
        (
            base(json!([user("hi"), {"role": "tool", "content": "18C", "tool_call_id": 1}])),
            "messages[1].tool_call_id",
        ),
        (
            base(json!([{"role": "user", "content": "x", "tool_call_id": "c"}])),
            "messages[0].tool_call_id",
        ),
        (
            base(json!([user("hi"), {"role": "tool", "tool_call_id": "c"}])),
            "messages[1].content",
        ),
        // tools
        (tools(json!({})), "tools"),
        (tools(json!(["f"])), "tools[0]"),
        (
            tools(json!([{"type": "code_interpreter", "function": {"name": "f"}}])),
            "tools[0].type",
        ),
        (tools(json!([{"type": "function"}])), "tools[0].function"),
        (
            tools(json!([{"type": "function", "function": {}}])),
            "tools[0].function.name",
        ),
        (
            tools(json!([{"type": "function", "function": {"name": ""}}])),
            "tools[0].function.name",
        ),
        (
            tools(json!([{"type": "function", "function": {"name": "get weather"}}])),
            "tools[0].function.name",
        ),
        (
            tools(json!([{"type": "function", "function": {"name": "x".repeat(65)}}])),
            "tools[0].function.name",
        ),
        (
            tools(
                json!([weather_tool(), {"type": "function", "function": {"name": "f", "parameters": "{}"}}]),
            ),
            "tools[1].function.parameters",
        ),
        (
            tools(json!([{"type": "function", "function": {"name": "f", "description": 1}}])),
            "tools[0].function.description",
        ),
        (
            tools(json!([{"type": "function", "function": {"name": "f", "strict": "yes"}}])),
            "tools[0].function.strict",
        ),
        (
            tools(json!([weather_tool(), time_tool(), weather_tool()])),
            "tools[2].function.name",
        ),
        // tool_choice
        (choice(json!("sometimes")), "tool_choice"),
        (choice(json!(1)), "tool_choice"),
        (
            choice(json!({"type": "function", "function": {"name": "nope"}})),
            "tool_choice",
        ),
        (choice(json!({"type": "function"})), "tool_choice"),
        (
            choice(json!({"type": "allowed_tools", "allowed_tools": {}})),
            "tool_choice",
        ),
        (
            json!({"messages": [user("hi")], "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            json!({"messages": [user("hi")], "tools": [], "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            json!({"messages": [user("hi")], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
            "tool_choice",
        ),
        // other fields
        (
            json!({"messages": [user("hi")], "parallel_tool_calls": "yes"}),
            "parallel_tool_calls",
        ),
        (
            json!({"messages": [user("hi")], "tool_parser": 1}),
            "tool_parser",
        ),
        (
            json!({"messages": [user("hi")], "reasoning_parser": ""}),
            "reasoning_parser",
        ),
        (
            json!({"messages": [user("hi")], "chat_template_kwargs": "enable_thinking"}),
            "chat_template_kwargs",
        ),
        (
            json!({"messages": [user("hi")], "response_format": {"type": "yaml"}}),
            "response_format.type",
        ),
        (
            json!({"messages": [user("hi")], "response_format": {"type": "json_schema", "json_schema": {}}}),
            "response_format.json_schema.name",
        ),
        (
            json!({"messages": [user("hi")], "response_format": {"type": "json_object"}, "guided_regex": "a"}),
            "guided_regex",
        ),
        (
            json!({"messages": [user("hi")], "response_format": "json"}),
            "response_format",
        ),
        (json!({"messages": [user("hi")], "n": 2}), "n"),
        (
            json!({"messages": [user("hi")], "top_logprobs": 2}),
            "top_logprobs",
        ),
    ];
    let mut wrong = Vec::new();
    for (body, param) in &cases {
        let got = param_of(body.clone());
        if got != *param {
            wrong.push(format!("{body}\n  expected param {param}, got {got}"));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

#[test]
fn a_rejection_is_an_openai_error_body() {
    let ctx = ctx();
    let body = json!({"messages": [user("hi")], "tools": [weather_tool()], "tool_choice": {"type": "function", "function": {"name": "nope"}}});
    let action = <crate::Adapter as api::Guest>::handle(
        ctx,
        HttpRequest {
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            headers: Vec::new(),
            body: body.to_string().into_bytes(),
        },
    );
    let Action::Respond(r) = action else {
        panic!("not a response")
    };
    assert_eq!(r.status, 400);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["param"], "tool_choice");
    assert_eq!(v["error"]["code"], Value::Null);
    assert!(v["error"]["message"].as_str().unwrap().contains("nope"));
}

fn ctx() -> RequestContext {
    RequestContext {
        request_id: "r1".into(),
        created: 1_700_000_000,
        model_id: "m".into(),
    }
}

fn start(index: u32, id: &str, name: &str) -> E {
    E::ToolCallStart(ToolCallStart {
        index,
        id: id.into(),
        name: name.into(),
    })
}

fn args(index: u32, arguments: &str) -> E {
    E::ToolCallArgumentsDelta(ToolCallDelta {
        index,
        arguments: arguments.into(),
    })
}

/// Reasoning, a sentence, then two calls whose arguments arrive in pieces.
fn two_calls() -> Vec<E> {
    vec![
        E::Reasoning("Need ".into()),
        E::Reasoning("both.".into()),
        E::Text("Checking.".into()),
        start(0, "call_a", "get_weather"),
        args(0, "{\"city\": "),
        args(0, "\"Paris\"}"),
        E::ToolCallEnd(0),
        start(1, "call_b", "get-time"),
        args(1, "{"),
        args(1, "}"),
        E::ToolCallEnd(1),
    ]
}

fn update(sequence: u32, events: Vec<E>, finish: Option<FinishReason>) -> GenerationUpdate {
    GenerationUpdate {
        sequence,
        events,
        logprobs: Vec::new(),
        finish,
        stop_sequence: None,
        usage: finish.map(|_| Usage {
            prompt_tokens: 10,
            completion_tokens: 20,
            cached_tokens: 4,
        }),
    }
}

#[test]
fn non_streamed_two_tool_calls() {
    let opts = RenderOptions::default();
    let v = render::completion(
        &ctx(),
        &opts,
        &update(0, two_calls(), Some(FinishReason::ToolCalls)),
    );
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    let m = &choice["message"];
    assert_eq!(m["role"], "assistant");
    assert_eq!(m["content"], "Checking.");
    assert_eq!(m["reasoning_content"], "Need both.");
    assert_eq!(
        m["tool_calls"],
        json!([
            {"id": "call_a", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "call_b", "type": "function", "function": {"name": "get-time", "arguments": "{}"}},
        ])
    );
    assert_eq!(v["usage"]["total_tokens"], 30);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 4);

    // Only calls: content is null (as OpenAI); no reasoning key.
    let only_calls: Vec<E> = two_calls().into_iter().skip(3).collect();
    let m = render::message(&only_calls);
    assert_eq!(m["content"], Value::Null);
    assert!(m.get("reasoning_content").is_none());
    assert_eq!(m["tool_calls"].as_array().unwrap().len(), 2);

    // No calls: content is a string (empty when nothing), no tool_calls key;
    // an invalid call is shown as content, in order.
    let m = render::message(&[]);
    assert_eq!(m["content"], "");
    assert!(m.get("tool_calls").is_none());
    let m = render::message(&[
        E::Text("a ".into()),
        E::InvalidCall("<tool_call>{bad".into()),
        E::Error("parser: bad JSON".into()),
        E::Text(" b".into()),
    ]);
    assert_eq!(m["content"], "a <tool_call>{bad b");
    assert!(m.get("tool_calls").is_none());

    let stop = render::completion(
        &ctx(),
        &opts,
        &update(0, vec![E::Text("x".into())], Some(FinishReason::Stop)),
    );
    assert_eq!(stop["choices"][0]["finish_reason"], "stop");
    let length = render::completion(
        &ctx(),
        &opts,
        &update(0, vec![E::Text("x".into())], Some(FinishReason::Length)),
    );
    assert_eq!(length["choices"][0]["finish_reason"], "length");
}

/// The streamed chunks of `updates`, parsed (`[DONE]` kept as a string).
fn stream(opts: &RenderOptions, updates: &[GenerationUpdate]) -> Vec<Value> {
    updates
        .iter()
        .flat_map(|u| render::stream_chunks(&ctx(), opts, u))
        .map(|data| serde_json::from_str(&data).unwrap_or(Value::String(data)))
        .collect()
}

/// Checks the stream's shape and folds it back into (content, reasoning,
/// calls as (id, name, arguments)) and the finish reason.
fn fold(chunks: &[Value]) -> (String, String, Vec<(String, String, String)>, String) {
    assert_eq!(chunks.last().unwrap(), "[DONE]");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let (mut content, mut reasoning, mut calls, mut finish) = (
        String::new(),
        String::new(),
        Vec::<(String, String, String)>::new(),
        String::new(),
    );
    for (k, c) in chunks[..chunks.len() - 1].iter().enumerate() {
        assert_eq!(c["object"], "chat.completion.chunk");
        let Some(choice) = c["choices"].get(0) else {
            continue; // the usage chunk
        };
        let delta = choice["delta"].as_object().unwrap();
        if let Some(f) = choice["finish_reason"].as_str() {
            assert!(delta.is_empty(), "finish chunk with a delta: {c}");
            finish = f.into();
            continue;
        }
        assert!(!delta.is_empty(), "empty delta in chunk {k}: {c}");
        if k > 0 {
            assert!(delta.get("role").is_none());
        }
        content += delta.get("content").and_then(Value::as_str).unwrap_or("");
        reasoning += delta
            .get("reasoning_content")
            .and_then(Value::as_str)
            .unwrap_or("");
        for t in delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let index = t["index"].as_u64().unwrap() as usize;
            let f = &t["function"];
            if index == calls.len() {
                // A call's first delta: id, type and name, arguments "".
                assert_eq!(t["type"], "function");
                assert_eq!(f["arguments"], "");
                calls.push((
                    t["id"].as_str().unwrap().into(),
                    f["name"].as_str().unwrap().into(),
                    String::new(),
                ));
            } else {
                // Later deltas: arguments only, never id or name again.
                assert!(
                    t.get("id").is_none() && t.get("type").is_none() && f.get("name").is_none(),
                    "{t}"
                );
                calls[index].2 += f["arguments"].as_str().unwrap();
            }
        }
    }
    (content, reasoning, calls, finish)
}

#[test]
fn streamed_two_tool_calls_one_event_per_update() {
    let opts = RenderOptions {
        include_usage: true,
        ..Default::default()
    };
    let events = two_calls();
    let n = events.len() as u32;
    let mut updates: Vec<GenerationUpdate> = events
        .into_iter()
        .enumerate()
        .map(|(i, e)| update(i as u32, vec![e], None))
        .collect();
    updates.push(update(n, Vec::new(), Some(FinishReason::ToolCalls)));
    let chunks = stream(&opts, &updates);
    let (content, reasoning, calls, finish) = fold(&chunks);
    assert_eq!(content, "Checking.");
    assert_eq!(reasoning, "Need both.");
    assert_eq!(
        calls,
        vec![
            (
                "call_a".into(),
                "get_weather".into(),
                "{\"city\": \"Paris\"}".into()
            ),
            ("call_b".into(), "get-time".into(), "{}".into()),
        ]
    );
    assert_eq!(finish, "tool_calls");
    // role, 2 reasoning, 1 content, 2 x (start + 2 fragments), finish, usage, [DONE]
    assert_eq!(chunks.len(), 1 + 2 + 1 + 6 + 1 + 1 + 1);
    let fragments: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0)?["delta"]["tool_calls"].get(0))
        .filter(|t| t.get("id").is_none())
        .collect();
    assert_eq!(
        fragments[0],
        &json!({"index": 0, "function": {"arguments": "{\"city\": "}})
    );
    assert_eq!(
        fragments[3],
        &json!({"index": 1, "function": {"arguments": "}"}})
    );
    let usage = &chunks[chunks.len() - 2];
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 20);
}

#[test]
fn streamed_two_tool_calls_in_one_update_match_non_streamed() {
    let opts = RenderOptions::default();
    let chunks = stream(
        &opts,
        &[update(0, two_calls(), Some(FinishReason::ToolCalls))],
    );
    let (content, reasoning, calls, finish) = fold(&chunks);
    let whole = render::message(&two_calls());
    assert_eq!(content, whole["content"].as_str().unwrap());
    assert_eq!(reasoning, whole["reasoning_content"].as_str().unwrap());
    let whole_calls: Vec<(String, String, String)> = whole["tool_calls"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| {
            (
                t["id"].as_str().unwrap().into(),
                t["function"]["name"].as_str().unwrap().into(),
                t["function"]["arguments"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(calls, whole_calls);
    assert_eq!(finish, "tool_calls");
    // Adjacent pieces merge: role, reasoning, content, start 0, args 0,
    // start 1, args 1, finish, [DONE]; no usage chunk when not asked.
    assert_eq!(chunks.len(), 9);
    assert!(chunks.iter().all(|c| c.get("usage").is_none()));
}

#[test]
fn streamed_text_and_invalid_calls_are_content() {
    let opts = RenderOptions::default();
    let chunks = stream(
        &opts,
        &[
            update(0, vec![E::Text("Hel".into())], None),
            update(1, vec![E::Text(String::new())], None),
            update(
                2,
                vec![E::Text("lo ".into()), E::InvalidCall("<tool_call>{".into())],
                None,
            ),
            update(
                3,
                vec![E::Error("bad call".into()), E::ToolCallEnd(0)],
                Some(FinishReason::Stop),
            ),
        ],
    );
    let (content, reasoning, calls, finish) = fold(&chunks);
    assert_eq!(content, "Hello <tool_call>{");
    assert!(reasoning.is_empty() && calls.is_empty());
    assert_eq!(finish, "stop");
    // role, "Hel", "lo <tool_call>{", finish, [DONE]
    assert_eq!(chunks.len(), 5);
}

#[test]
fn streamed_logprobs_ride_on_the_first_chunk_of_an_update() {
    use mlxhost_plugin_sdk::v2::adapter::exports::mlxhost::plugin::api_adapter::TokenLogprob;
    let opts = RenderOptions {
        logprobs: true,
        ..Default::default()
    };
    let token = |t: &str, id: u32| TokenLogprob {
        token: t.into(),
        bytes: t.as_bytes().to_vec(),
        id,
        logprob: -0.5,
        top: Vec::new(),
    };
    let mut held = update(1, Vec::new(), None);
    held.logprobs = vec![token("<tool_call>", 7)];
    let mut both = update(2, vec![E::Text("a".into()), start(0, "c", "f")], None);
    both.logprobs = vec![token("a", 1), token("{", 2)];
    let chunks = stream(&opts, &[update(0, Vec::new(), None), held, both]);
    // role; held-back tokens on an empty content delta; "a" with both
    // logprobs; the call start without logprobs.
    assert_eq!(chunks.len(), 4);
    assert_eq!(chunks[0]["choices"][0]["logprobs"], Value::Null);
    assert_eq!(chunks[1]["choices"][0]["delta"], json!({"content": ""}));
    assert_eq!(
        chunks[1]["choices"][0]["logprobs"]["content"][0]["token"],
        "<tool_call>"
    );
    assert_eq!(chunks[2]["choices"][0]["delta"], json!({"content": "a"}));
    assert_eq!(
        chunks[2]["choices"][0]["logprobs"]["content"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    assert_eq!(chunks[3]["choices"][0]["logprobs"], Value::Null);
    assert_eq!(chunks[3]["choices"][0]["delta"]["tool_calls"][0]["id"], "c");
}

#[test]
fn structured_output_fields_become_the_constraint() {
    use mlxhost_plugin_sdk::structured::Grammar;
    let constraint = |body: Value| {
        request::parse(body.to_string().as_bytes())
            .expect("valid")
            .1
            .constraint
    };
    assert!(constraint(json!({"messages": [user("hi")]})).is_none());
    let c = constraint(
        json!({"messages": [user("hi")], "response_format": {"type": "json_schema",
        "json_schema": {"name": "r", "strict": true, "schema": {"type": "object"}}}}),
    )
    .expect("constraint");
    assert_eq!(c.field, "response_format");
    assert_eq!(
        c.grammar,
        Grammar::JsonSchema(r#"{"type":"object"}"#.into())
    );
    let c = constraint(json!({"messages": [user("hi")], "guided_choice": ["yes", "no"]}))
        .expect("constraint");
    assert_eq!(c.field, "guided_choice");
}

#[test]
fn strict_tools_are_named_for_the_host() {
    let tool = |name: &str, strict: Value| json!({"type": "function", "function": {"name": name, "parameters": {"type": "object"}, "strict": strict}});
    let body = json!({"messages": [user("hi")], "tools": [tool("a", json!(true)), tool("b", json!(false)), tool("c", Value::Null)]});
    let opts = request::parse(body.to_string().as_bytes())
        .expect("valid")
        .1;
    assert_eq!(opts.strict_tools, vec!["a".to_string()]);
}
