//! Native unit tests of the request parser and the renderers.
//!
//! Run them on the host (not wasm32), with the default rustup toolchain; the
//! `--target` overrides `plugins/.cargo/config.toml`'s wasm32 target and
//! stable cargo ignores its `[unstable] build-std`:
//!
//!     cd plugins/anthropic && cargo test --target x86_64-unknown-linux-gnu

use mlxhost_plugin_sdk::v2::adapter::exports::mlxhost::plugin::api_adapter::{
    self as api, Action, ApiError, ErrorKind, GenerationUpdate, HttpRequest, RequestContext, Usage,
};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::request::{
    ContentPart, GenerationRequest, Message, Prompt, ToolChoice,
};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::types::{
    FinishReason, GenerationEvent as E, ToolCallDelta, ToolCallStart,
};
use serde_json::{json, Value};

use crate::render;
use crate::request;

fn parse(body: Value) -> GenerationRequest {
    match request::parse(body.to_string().as_bytes(), request::Normalize::default()) {
        Ok(r) => r,
        Err(e) => panic!("rejected: {e:?}\nbody: {body}"),
    }
}

fn rejected(body: Value) -> request::Invalid {
    match request::parse(body.to_string().as_bytes(), request::Normalize::default()) {
        Ok(_) => panic!("accepted: {body}"),
        Err(e) => e,
    }
}

fn messages(r: &GenerationRequest) -> &[Message] {
    match &r.prompt {
        Prompt::Messages(m) => m,
        _ => panic!("prompt is not messages"),
    }
}

/// The text of a message's parts, joined.
fn text(m: &Message) -> String {
    m.content
        .iter()
        .map(|p| match p {
            ContentPart::Text(t) => t.as_str(),
            ContentPart::ImageUrl(_) => panic!("image part"),
        })
        .collect()
}

fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

/// A body with the required fields and `extra` merged in.
fn body(extra: Value) -> Value {
    let mut b = json!({"model": "claude-x", "max_tokens": 100, "messages": [user("hi")]});
    for (k, v) in extra.as_object().unwrap() {
        b[k] = v.clone();
    }
    b
}

fn weather_tool() -> Value {
    json!({
        "name": "get_weather",
        "description": "Current weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        "cache_control": {"type": "ephemeral"},
    })
}

fn time_tool() -> Value {
    json!({"type": "custom", "name": "get-time", "input_schema": {"type": "object"}})
}

/// A conversation that called two tools (one failed) and got their results.
fn round_trip() -> Value {
    json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": 1024,
        "system": [
            {"type": "text", "text": "You are terse. ", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Use tools."},
        ],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Weather in Paris and the time?", "cache_control": {"type": "ephemeral"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "Two calls.", "signature": "sig"},
                {"type": "redacted_thinking", "data": "xyz"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                {"type": "tool_use", "id": "toolu_2", "name": "get-time", "input": {}},
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": true,
                 "content": [{"type": "text", "text": "clock "}, {"type": "text", "text": "broken"}]},
                {"type": "text", "text": "Go on."},
            ]},
            {"role": "assistant", "content": "It is 18C; the time is unknown."},
            {"role": "system", "content": "Reminder: be brief."},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3"}]},
            user("Thanks"),
        ],
        "tools": [weather_tool(), time_tool(), {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}],
        "metadata": {"user_id": "u"},
        "thinking": {"type": "enabled", "budget_tokens": 2000},
        "context_management": {"edits": []},
        "service_tier": "auto",
        "container": "c",
        "mcp_servers": [],
        "output_config": {"effort": "low"},
        "some_future_field": [1, 2],
    })
}

#[test]
fn tool_round_trip_history_parses() {
    let r = parse(round_trip());
    let m = messages(&r);
    let roles: Vec<&str> = m.iter().map(|m| m.role.as_str()).collect();
    assert_eq!(
        roles,
        [
            "system",
            "user",
            "assistant",
            "tool",
            "tool",
            "user",
            "assistant",
            "system",
            "tool",
            "user"
        ]
    );
    // `system` blocks, in parts; cache_control ignored.
    assert_eq!(m[0].content.len(), 2);
    assert_eq!(text(&m[0]), "You are terse. Use tools.");
    assert_eq!(text(&m[1]), "Weather in Paris and the time?");
    let a = &m[2];
    assert_eq!(text(a), "Checking.");
    assert_eq!(a.reasoning.as_deref(), Some("Two calls."));
    assert_eq!(a.tool_calls.len(), 2);
    assert_eq!(
        (a.tool_calls[0].id.as_str(), a.tool_calls[0].name.as_str()),
        ("toolu_1", "get_weather")
    );
    assert_eq!(
        serde_json::from_str::<Value>(&a.tool_calls[0].arguments).unwrap(),
        json!({"city": "Paris"})
    );
    assert_eq!(a.tool_calls[1].arguments, "{}");
    // tool_result blocks: one tool message each, then the user's text.
    assert_eq!(m[3].tool_call_id.as_deref(), Some("toolu_1"));
    assert_eq!(text(&m[3]), "18C");
    assert_eq!(m[4].tool_call_id.as_deref(), Some("toolu_2"));
    assert_eq!(text(&m[4]), "Error: clock broken");
    assert_eq!(text(&m[5]), "Go on.");
    assert!(m[5].tool_call_id.is_none() && m[5].tool_calls.is_empty());
    assert_eq!(text(&m[6]), "It is 18C; the time is unknown.");
    assert!(m[6].reasoning.is_none());
    // A system message mid-conversation stays in place.
    assert_eq!(text(&m[7]), "Reminder: be brief.");
    // A result without content is an empty tool message.
    assert_eq!(m[8].tool_call_id.as_deref(), Some("toolu_3"));
    assert!(m[8].content.is_empty());
    assert!(m.iter().all(|m| m.name.is_none()));

    // Custom tools only (the server tool is left out).
    let names: Vec<&str> = r.tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["get_weather", "get-time"]);
    assert_eq!(r.tools[0].description, "Current weather");
    let schema: Value = serde_json::from_str(&r.tools[0].parameters_json).unwrap();
    assert_eq!(schema["properties"]["city"]["type"], "string");
    assert_eq!(r.tools[1].description, "");
    assert!(matches!(r.tool_choice, ToolChoice::Auto));
    assert!(r.parallel_tool_calls);
    assert_eq!(r.max_tokens, Some(1024));
    assert!(!r.stream && !r.logprobs);
    assert!(r.stop.is_empty());
    assert_eq!(r.chat_template_kwargs, "{}");
    assert_eq!(r.plugin_params, "{}");
    assert!(r.tool_parser.is_none() && r.reasoning_parser.is_none() && r.sampler.is_none());
    assert!(r.logits_processors.is_empty() && r.previous_response_id.is_none());
    assert!(
        r.sampling.temperature.is_none()
            && r.sampling.top_p.is_none()
            && r.sampling.top_k.is_none()
    );
}

#[test]
fn tool_names_up_to_128_of_anthropics_characters_are_accepted() {
    let long = "m".repeat(128);
    let r = parse(json!({
        "model": "m", "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [
            {"name": "mcp__files__read_file", "input_schema": {"type": "object"}},
            {"name": "Get-Time_2", "input_schema": {"type": "object"}},
            {"name": long, "input_schema": {"type": "object"}},
        ],
    }));
    let names: Vec<&str> = r.tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(
        names,
        ["mcp__files__read_file", "Get-Time_2", long.as_str()]
    );
}

#[test]
fn claude_codes_billing_block_is_dropped_unless_kept() {
    // Two sessions of Claude Code differ only in the block's suffix: the
    // rendered system message must be the same for both.
    let system = |suffix: &str, keep: bool| {
        let b = body(json!({"system": [
            {"type": "text", "text": format!("x-anthropic-billing-header: cc_version=2.1.197.{suffix}; cc_entrypoint=sdk-cli;")},
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
        ]}));
        let norm = request::Normalize {
            keep_metadata: keep,
        };
        match request::parse(b.to_string().as_bytes(), norm) {
            Ok(r) => text(&messages(&r)[0]),
            Err(e) => panic!("rejected: {e:?}"),
        }
    };
    assert_eq!(system("3af", false), "You are Claude Code.");
    assert_eq!(system("3af", false), system("b1a", false));
    assert_eq!(
        system("3af", true),
        "x-anthropic-billing-header: cc_version=2.1.197.3af; cc_entrypoint=sdk-cli;You are Claude Code."
    );
    // Only a whole block is metadata: text that mentions it stays.
    let r = parse(body(
        json!({"system": "x-anthropic-billing-header: a\nBe brief."}),
    ));
    assert!(text(&messages(&r)[0]).starts_with("x-anthropic-billing-header"));
    // A system of nothing but the block leaves no system message.
    let r = parse(body(json!({"system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cc_entrypoint=cli;"}
    ]})));
    assert_eq!(messages(&r)[0].role, "user");
}

#[test]
fn system_forms() {
    let system = |s: Value| {
        let r = parse(body(json!({"system": s})));
        messages(&r).to_vec()
    };
    let m = system(json!("Be kind."));
    assert_eq!(
        (m[0].role.as_str(), text(&m[0]).as_str()),
        ("system", "Be kind.")
    );
    assert_eq!(m[1].role, "user");
    let m = system(
        json!([{"type": "text", "text": "A"}, {"type": "text", "text": "B", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]),
    );
    assert_eq!(text(&m[0]), "AB");
    // Empty or absent: no system message (the server's default applies).
    for empty in [json!(""), json!([]), Value::Null] {
        let m = system(empty.clone());
        assert_eq!(m.len(), 1, "{empty}");
        assert_eq!(m[0].role, "user");
    }
    // role "system" inside messages, string or blocks, in place.
    let r = parse(body(json!({"system": "top", "messages": [
        user("a"),
        {"role": "assistant", "content": "b"},
        {"role": "system", "content": [{"type": "text", "text": "mid"}]},
        user("c"),
    ]})));
    let m = messages(&r);
    let got: Vec<(String, String)> = m.iter().map(|m| (m.role.clone(), text(m))).collect();
    let want: Vec<(String, String)> = [
        ("system", "top"),
        ("user", "a"),
        ("assistant", "b"),
        ("system", "mid"),
        ("user", "c"),
    ]
    .iter()
    .map(|(r, t)| (r.to_string(), t.to_string()))
    .collect();
    assert_eq!(got, want);
}

#[test]
fn tool_choice_sampling_and_extension_fields() {
    let tools = json!([weather_tool(), time_tool()]);
    let choice = |c: Value| {
        let r = parse(body(json!({"tools": tools, "tool_choice": c})));
        (r.tool_choice, r.parallel_tool_calls)
    };
    assert!(matches!(
        choice(json!({"type": "auto"})),
        (ToolChoice::Auto, true)
    ));
    assert!(matches!(
        choice(json!({"type": "any"})),
        (ToolChoice::Required, true)
    ));
    assert!(matches!(
        choice(json!({"type": "none"})),
        (ToolChoice::None, true)
    ));
    assert!(matches!(
        choice(json!({"type": "tool", "name": "get-time", "disable_parallel_tool_use": true})),
        (ToolChoice::Named(n), false) if n == "get-time"
    ));
    assert!(matches!(
        choice(json!({"type": "auto", "disable_parallel_tool_use": true})),
        (ToolChoice::Auto, false)
    ));
    assert!(matches!(
        choice(json!({"type": "any", "disable_parallel_tool_use": false})),
        (ToolChoice::Required, true)
    ));
    // No (custom) tools: none, also for an explicit auto.
    assert!(matches!(
        parse(body(json!({}))).tool_choice,
        ToolChoice::None
    ));
    assert!(matches!(
        parse(body(json!({"tools": [], "tool_choice": {"type": "auto"}}))).tool_choice,
        ToolChoice::None
    ));
    assert!(matches!(
        parse(body(
            json!({"tools": [{"type": "bash_20250124", "name": "bash"}]})
        ))
        .tool_choice,
        ToolChoice::None
    ));

    let r = parse(body(json!({
        "stream": true,
        "temperature": 1,
        "top_p": 0.9,
        "top_k": 40,
        "stop_sequences": ["END", "\n\nHuman:"],
        "sampler": "scripted",
        "logits_processors": ["dry"],
        "plugin_params": {"scripted": {"text": "hi"}},
        "tool_parser": "hermes",
        "reasoning_parser": "none",
        "chat_template_kwargs": {"enable_thinking": false},
    })));
    assert!(r.stream && r.include_usage);
    assert_eq!(r.sampling.temperature, Some(1.0));
    assert_eq!(r.sampling.top_p, Some(0.9));
    assert_eq!(r.sampling.top_k, Some(40));
    assert_eq!(r.stop, vec!["END".to_string(), "\n\nHuman:".to_string()]);
    assert_eq!(r.sampler.as_deref(), Some("scripted"));
    assert_eq!(r.logits_processors, vec!["dry".to_string()]);
    assert_eq!(
        serde_json::from_str::<Value>(&r.plugin_params).unwrap(),
        json!({"scripted": {"text": "hi"}})
    );
    assert_eq!(r.tool_parser.as_deref(), Some("hermes"));
    assert_eq!(r.reasoning_parser.as_deref(), Some("none"));
    assert_eq!(
        serde_json::from_str::<Value>(&r.chat_template_kwargs).unwrap(),
        json!({"enable_thinking": false})
    );
    // `model` may be absent; null counts as absent for optional fields.
    let mut b = body(
        json!({"temperature": null, "stop_sequences": null, "tools": null, "tool_choice": null}),
    );
    b.as_object_mut().unwrap().remove("model");
    let r = parse(b);
    assert!(r.sampling.temperature.is_none() && r.stop.is_empty() && r.tools.is_empty());
}

#[test]
fn each_rejection_names_its_param() {
    let msgs = |m: Value| body(json!({"messages": m}));
    let one = |content: Value| msgs(json!([{"role": "user", "content": content}]));
    let asst =
        |content: Value| msgs(json!([user("hi"), {"role": "assistant", "content": content}]));
    let result = |r: Value| one(json!([r]));
    let tools = |t: Value| body(json!({"tools": t}));
    let choice = |c: Value| body(json!({"tools": [weather_tool()], "tool_choice": c}));
    let mut no_max = body(json!({}));
    no_max.as_object_mut().unwrap().remove("max_tokens");
    let mut no_messages = body(json!({}));
    no_messages.as_object_mut().unwrap().remove("messages");
    let cases: Vec<(Value, &str)> = vec![
        // top level
        (no_max, "max_tokens"),
        (body(json!({"max_tokens": 0})), "max_tokens"),
        (body(json!({"max_tokens": "100"})), "max_tokens"),
        (body(json!({"max_tokens": 1.5})), "max_tokens"),
        (body(json!({"max_tokens": -1})), "max_tokens"),
        (body(json!({"model": 3})), "model"),
        (no_messages, "messages"),
        (msgs(json!([])), "messages"),
        (msgs(json!("hi")), "messages"),
        (body(json!({"stream": "yes"})), "stream"),
        (body(json!({"temperature": 1.5})), "temperature"),
        (body(json!({"temperature": "hot"})), "temperature"),
        (body(json!({"top_p": -0.1})), "top_p"),
        (body(json!({"top_k": -1})), "top_k"),
        (body(json!({"stop_sequences": "END"})), "stop_sequences"),
        (
            body(json!({"stop_sequences": ["a", 1]})),
            "stop_sequences[1]",
        ),
        (body(json!({"stop_sequences": [""]})), "stop_sequences[0]"),
        (body(json!({"sampler": ""})), "sampler"),
        (
            body(json!({"logits_processors": "dry"})),
            "logits_processors",
        ),
        (
            body(json!({"plugin_params": {"dry": 1}})),
            "plugin_params.dry",
        ),
        (body(json!({"plugin_params": []})), "plugin_params"),
        (body(json!({"tool_parser": 1})), "tool_parser"),
        (body(json!({"reasoning_parser": ""})), "reasoning_parser"),
        (
            body(json!({"chat_template_kwargs": "x"})),
            "chat_template_kwargs",
        ),
        // system
        (body(json!({"system": 1})), "system"),
        (
            body(json!({"system": [{"type": "image", "source": {}}]})),
            "system[0]",
        ),
        (
            body(json!({"system": [{"type": "document"}]})),
            "system[0].type",
        ),
        (body(json!({"system": [{"text": "x"}]})), "system[0].type"),
        (
            body(json!({"system": [{"type": "text"}]})),
            "system[0].text",
        ),
        // messages
        (msgs(json!(["hi"])), "messages[0]"),
        (msgs(json!([{"content": "x"}])), "messages[0].role"),
        (
            msgs(json!([{"role": "tool", "content": "x"}])),
            "messages[0].role",
        ),
        (msgs(json!([{"role": "user"}])), "messages[0].content"),
        (one(json!(5)), "messages[0].content"),
        (one(json!("")), "messages[0].content"),
        (one(json!([])), "messages[0].content"),
        (one(json!(["x"])), "messages[0].content[0]"),
        (
            one(json!([{"type": "text", "text": 1}])),
            "messages[0].content[0].text",
        ),
        (
            one(
                json!([{"type": "text", "text": "see"}, {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]),
            ),
            "messages[0].content[1]",
        ),
        (
            one(json!([{"type": "document", "source": {}}])),
            "messages[0].content[0].type",
        ),
        (
            one(json!([{"type": "search_result"}])),
            "messages[0].content[0].type",
        ),
        (
            one(json!([{"type": "tool_use", "id": "t", "name": "f", "input": {}}])),
            "messages[0].content[0].type",
        ),
        (
            one(json!([{"type": "thinking", "thinking": "x"}])),
            "messages[0].content[0].type",
        ),
        (
            msgs(json!([{"role": "system", "content": [{"type": "image"}]}])),
            "messages[0].content[0]",
        ),
        (
            msgs(json!([{"role": "system", "content": 1}])),
            "messages[0].content",
        ),
        // tool_result
        (
            result(json!({"type": "tool_result"})),
            "messages[0].content[0].tool_use_id",
        ),
        (
            result(json!({"type": "tool_result", "tool_use_id": 1})),
            "messages[0].content[0].tool_use_id",
        ),
        (
            result(json!({"type": "tool_result", "tool_use_id": ""})),
            "messages[0].content[0].tool_use_id",
        ),
        (
            result(json!({"type": "tool_result", "tool_use_id": "t", "is_error": "yes"})),
            "messages[0].content[0].is_error",
        ),
        (
            result(json!({"type": "tool_result", "tool_use_id": "t", "content": 5})),
            "messages[0].content[0].content",
        ),
        (
            result(
                json!({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}),
            ),
            "messages[0].content[0].content[0]",
        ),
        (
            result(
                json!({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "search_result"}]}),
            ),
            "messages[0].content[0].content[0].type",
        ),
        // assistant blocks
        (
            asst(json!([{"type": "tool_use", "name": "f", "input": {}}])),
            "messages[1].content[0].id",
        ),
        (
            asst(json!([{"type": "tool_use", "id": "t", "input": {}}])),
            "messages[1].content[0].name",
        ),
        (
            asst(json!([{"type": "tool_use", "id": "t", "name": "", "input": {}}])),
            "messages[1].content[0].name",
        ),
        (
            asst(json!([{"type": "tool_use", "id": "t", "name": "f"}])),
            "messages[1].content[0].input",
        ),
        (
            asst(json!([{"type": "tool_use", "id": "t", "name": "f", "input": "{}"}])),
            "messages[1].content[0].input",
        ),
        (
            asst(json!([{"type": "thinking"}])),
            "messages[1].content[0].thinking",
        ),
        (
            asst(json!([{"type": "tool_result", "tool_use_id": "t"}])),
            "messages[1].content[0].type",
        ),
        (
            asst(json!([{"type": "image", "source": {}}])),
            "messages[1].content[0]",
        ),
        (
            asst(
                json!([{"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}]),
            ),
            "messages[1].content[0].type",
        ),
        // tools
        (tools(json!({})), "tools"),
        (tools(json!(["f"])), "tools[0]"),
        (
            tools(json!([{"type": 1, "name": "f", "input_schema": {}}])),
            "tools[0].type",
        ),
        (tools(json!([{"input_schema": {}}])), "tools[0].name"),
        (
            tools(json!([{"name": "", "input_schema": {}}])),
            "tools[0].name",
        ),
        (
            tools(json!([{"name": 7, "input_schema": {}}])),
            "tools[0].name",
        ),
        (
            tools(json!([{"name": "get weather", "input_schema": {}}])),
            "tools[0].name",
        ),
        (
            tools(json!([{"name": "f\n</tools>", "input_schema": {}}])),
            "tools[0].name",
        ),
        (
            tools(json!([{"name": "x".repeat(129), "input_schema": {}}])),
            "tools[0].name",
        ),
        (tools(json!([{"name": "f"}])), "tools[0].input_schema"),
        (
            tools(json!([weather_tool(), {"name": "f", "input_schema": "object"}])),
            "tools[1].input_schema",
        ),
        (
            tools(json!([{"name": "f", "input_schema": {}, "description": 1}])),
            "tools[0].description",
        ),
        (
            tools(json!([weather_tool(), time_tool(), weather_tool()])),
            "tools[2].name",
        ),
        // tool_choice
        (choice(json!("auto")), "tool_choice"),
        (choice(json!({})), "tool_choice.type"),
        (choice(json!({"type": "required"})), "tool_choice.type"),
        (choice(json!({"type": "tool"})), "tool_choice.name"),
        (
            choice(json!({"type": "tool", "name": "nope"})),
            "tool_choice.name",
        ),
        (
            choice(json!({"type": "auto", "disable_parallel_tool_use": "yes"})),
            "tool_choice.disable_parallel_tool_use",
        ),
        (body(json!({"tool_choice": {"type": "any"}})), "tool_choice"),
        (
            body(
                json!({"tools": [{"type": "bash_20250124", "name": "bash"}], "tool_choice": {"type": "tool", "name": "bash"}}),
            ),
            "tool_choice.name",
        ),
    ];
    let mut wrong = Vec::new();
    for (b, param) in &cases {
        let e = rejected(b.clone());
        let got = e.param.clone().unwrap_or_default();
        if got != *param || !e.message.starts_with(&format!("{param}: ")) {
            wrong.push(format!("{b}\n  expected {param}, got {got}: {}", e.message));
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // The messages say why.
    let e = rejected(one(json!([{"type": "image", "source": {}}])));
    assert_eq!(
        e.message,
        "messages[0].content[0]: image content is not supported: this model takes text only"
    );
    let e = rejected(one(json!([{"type": "document", "source": {}}])));
    assert!(e.message.contains("`document`"), "{}", e.message);
    // Not JSON, not an object: no param.
    for bad in [&b"{"[..], b"[1]"] {
        let e = request::parse(bad, request::Normalize::default()).unwrap_err();
        assert!(e.param.is_none(), "{e:?}");
    }
}

fn ctx() -> RequestContext {
    RequestContext {
        request_id: "r1".into(),
        created: 1_700_000_000,
        model_id: "m".into(),
    }
}

fn handle(method: &str, path: &str, body: Value) -> api::HttpResponse {
    let action = <crate::Adapter as api::Guest>::handle(
        ctx(),
        HttpRequest {
            method: method.into(),
            path: path.into(),
            headers: vec![
                ("x-api-key".into(), "sk-ant-unused".into()),
                ("anthropic-version".into(), "2023-06-01".into()),
                ("anthropic-beta".into(), "prompt-caching-2024-07-31".into()),
            ],
            body: body.to_string().into_bytes(),
        },
    );
    match action {
        Action::Respond(r) => r,
        Action::Generate(_) => panic!("generate, not a response"),
    }
}

#[test]
fn routes_and_direct_responses() {
    let routes: Vec<(String, String)> = <crate::Adapter as api::Guest>::routes()
        .into_iter()
        .map(|r| (r.method, r.path))
        .collect();
    assert_eq!(
        routes,
        [
            ("POST".to_string(), "/v1/messages".to_string()),
            ("POST".to_string(), "/v1/messages/count_tokens".to_string()),
        ]
    );
    let action = <crate::Adapter as api::Guest>::handle(
        ctx(),
        HttpRequest {
            method: "POST".into(),
            path: "/v1/messages".into(),
            headers: Vec::new(),
            body: body(json!({})).to_string().into_bytes(),
        },
    );
    assert!(matches!(action, Action::Generate(_)));

    let r = handle(
        "POST",
        "/v1/messages",
        body(json!({"tools": [weather_tool()], "tool_choice": {"type": "tool", "name": "nope"}})),
    );
    assert_eq!(r.status, 400);
    assert_eq!(r.content_type, "application/json");
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("tool_choice.name: "),
        "{v}"
    );
    assert!(v["error"]["message"].as_str().unwrap().contains("nope"));
    assert_eq!(v["request_id"], "r1");

    // count_tokens takes the same body without `max_tokens`; a bad one is
    // a 400 before the host is asked to count.
    let r = handle(
        "POST",
        "/v1/messages/count_tokens",
        json!({"model": "m", "messages": []}),
    );
    assert_eq!(r.status, 400);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("messages: "));
    let counted = crate::request::parse_count(
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            .to_string()
            .as_bytes(),
        request::Normalize::default(),
    )
    .unwrap();
    assert_eq!(counted.max_tokens, None);
    assert!(crate::request::parse(
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
            .to_string()
            .as_bytes(),
        request::Normalize::default(),
    )
    .is_err());

    let r = handle("GET", "/v1/messages", json!({}));
    assert_eq!(r.status, 404);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(v["error"]["type"], "not_found_error");
}

#[test]
fn host_errors_render_in_anthropic_shape() {
    let err = |status: u16, kind: ErrorKind, param: Option<&str>| {
        let r = <crate::Adapter as api::Guest>::render_error(
            ctx(),
            ApiError {
                status,
                kind,
                message: "went wrong".into(),
                param: param.map(str::to_string),
            },
        );
        assert_eq!(r.status, status);
        let v: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["type"], "error");
        assert_eq!(v["request_id"], "r1");
        (
            v["error"]["type"].as_str().unwrap().to_string(),
            v["error"]["message"].as_str().unwrap().to_string(),
        )
    };
    assert_eq!(
        err(400, ErrorKind::InvalidRequest, Some("tool_parser")),
        (
            "invalid_request_error".into(),
            "tool_parser: went wrong".into()
        )
    );
    // The host's canonical `stop` is this dialect's `stop_sequences`.
    assert_eq!(
        err(400, ErrorKind::InvalidRequest, Some("stop")).1,
        "stop_sequences: went wrong"
    );
    // A message the host already led with the field is not prefixed twice.
    let message = |message: &str| {
        let e = ApiError {
            status: 400,
            kind: ErrorKind::InvalidRequest,
            message: message.into(),
            param: Some("max_tokens".into()),
        };
        render::error(&ctx(), &e)["error"]["message"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!(message("max_tokens: too big"), "max_tokens: too big");
    assert_eq!(
        message("max_tokens is 9000"),
        "max_tokens: max_tokens is 9000"
    );
    assert_eq!(err(404, ErrorKind::NotFound, None).0, "not_found_error");
    assert_eq!(err(413, ErrorKind::TooLarge, None).0, "request_too_large");
    assert_eq!(
        err(500, ErrorKind::Plugin, None),
        ("api_error".into(), "went wrong".into())
    );
    assert_eq!(err(500, ErrorKind::Server, None).0, "api_error");
    assert_eq!(err(503, ErrorKind::Server, None).0, "overloaded_error");
    assert_eq!(
        err(422, ErrorKind::InvalidRequest, None).0,
        "invalid_request_error"
    );
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
        args(0, "{\"unit\": \"C\", "),
        args(0, "\"city\": \"Paris\"}"),
        E::ToolCallEnd(0),
        start(1, "call_b", "get-time"),
        args(1, "{"),
        args(1, "}"),
        E::ToolCallEnd(1),
    ]
}

fn usage() -> Usage {
    Usage {
        prompt_tokens: 10,
        completion_tokens: 20,
        cached_tokens: 4,
    }
}

fn update(sequence: u32, events: Vec<E>, finish: Option<FinishReason>) -> GenerationUpdate {
    GenerationUpdate {
        sequence,
        events,
        logprobs: Vec::new(),
        finish,
        stop_sequence: None,
        usage: finish.map(|_| usage()),
    }
}

fn rendered(u: &GenerationUpdate) -> (String, Value) {
    let r = <crate::Adapter as api::Guest>::render(ctx(), u.clone());
    assert_eq!(
        (r.status, r.content_type.as_str()),
        (200, "application/json")
    );
    let text = String::from_utf8(r.body).unwrap();
    let v = serde_json::from_str(&text).unwrap();
    (text, v)
}

#[test]
fn non_streamed_blocks_in_order() {
    let (text, v) = rendered(&update(0, two_calls(), Some(FinishReason::ToolCalls)));
    assert_eq!(
        v,
        json!({
            "id": "msg_r1",
            "type": "message",
            "role": "assistant",
            "model": "m",
            "content": [
                {"type": "thinking", "thinking": "Need both.", "signature": ""},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {"unit": "C", "city": "Paris"}},
                {"type": "tool_use", "id": "toolu_b", "name": "get-time", "input": {}},
            ],
            "stop_reason": "tool_use",
            "stop_sequence": null,
            "usage": {"input_tokens": 6, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4, "output_tokens": 20},
        })
    );
    // The input is the model's JSON as written: key order kept.
    assert!(
        text.contains(r#""input":{"unit": "C", "city": "Paris"}"#),
        "{text}"
    );

    // Text, an invalid call and more text are one text block; errors are
    // not rendered; no events give no blocks.
    let (_, v) = rendered(&update(
        0,
        vec![
            E::Text("a ".into()),
            E::InvalidCall("<tool_call>{bad".into()),
            E::Error("parser: bad JSON".into()),
            E::Text(" b".into()),
        ],
        Some(FinishReason::Stop),
    ));
    assert_eq!(
        v["content"],
        json!([{"type": "text", "text": "a <tool_call>{bad b"}])
    );
    assert_eq!(v["stop_reason"], "end_turn");
    let (_, v) = rendered(&update(0, Vec::new(), Some(FinishReason::Stop)));
    assert_eq!(v["content"], json!([]));
}

#[test]
fn stop_reason_mapping() {
    let with = |finish: FinishReason, stop: Option<&str>| {
        let mut u = update(0, vec![E::Text("x".into())], Some(finish));
        u.stop_sequence = stop.map(str::to_string);
        let (_, v) = rendered(&u);
        (v["stop_reason"].clone(), v["stop_sequence"].clone())
    };
    assert_eq!(
        with(FinishReason::Stop, None),
        (json!("end_turn"), Value::Null)
    );
    assert_eq!(
        with(FinishReason::Stop, Some("END")),
        (json!("stop_sequence"), json!("END"))
    );
    assert_eq!(
        with(FinishReason::Length, None),
        (json!("max_tokens"), Value::Null)
    );
    assert_eq!(
        with(FinishReason::ToolCalls, None),
        (json!("tool_use"), Value::Null)
    );
    assert_eq!(
        with(FinishReason::ToolCalls, Some("END")),
        (json!("tool_use"), Value::Null)
    );
}

/// The streamed events of `updates` as (name, parsed data); the name
/// always equals the data's `type`.
fn stream(updates: &[GenerationUpdate]) -> Vec<(String, Value)> {
    crate::STREAM.with(|s| *s.borrow_mut() = render::Stream::default());
    updates
        .iter()
        .flat_map(|u| <crate::Adapter as api::Guest>::render_stream(ctx(), u.clone()))
        .map(|e| {
            let v: Value = serde_json::from_str(&e.data).unwrap();
            assert_eq!(v["type"], e.event.as_str(), "{}", e.data);
            (e.event, v)
        })
        .collect()
}

fn names(events: &[(String, Value)]) -> Vec<&str> {
    events.iter().map(|(n, _)| n.as_str()).collect()
}

/// Checks the stream's grammar and folds it back into a message, as the
/// Anthropic SDK accumulates one.
fn fold(events: &[(String, Value)]) -> Value {
    assert_eq!(events[0].0, "message_start");
    assert_eq!(events[1].0, "ping");
    assert_eq!(events.last().unwrap().0, "message_stop");
    let mut message = events[0].1["message"].clone();
    assert_eq!(message["content"], json!([]));
    assert_eq!(message["stop_reason"], Value::Null);
    let mut content: Vec<Value> = Vec::new();
    let mut json_bufs: Vec<String> = Vec::new();
    let mut open: Option<usize> = None;
    for (name, v) in &events[2..events.len() - 1] {
        match name.as_str() {
            "content_block_start" => {
                assert!(open.is_none(), "a block starts while {open:?} is open");
                let index = v["index"].as_u64().unwrap() as usize;
                assert_eq!(index, content.len(), "indexes count up from 0");
                content.push(v["content_block"].clone());
                json_bufs.push(String::new());
                open = Some(index);
            }
            "content_block_delta" => {
                let index = v["index"].as_u64().unwrap() as usize;
                assert_eq!(open, Some(index), "a delta for a block that is not open");
                let d = &v["delta"];
                let block = &mut content[index];
                match (d["type"].as_str().unwrap(), block["type"].as_str().unwrap()) {
                    ("text_delta", "text") => {
                        let t = block["text"].as_str().unwrap().to_string()
                            + d["text"].as_str().unwrap();
                        block["text"] = t.into();
                    }
                    ("thinking_delta", "thinking") => {
                        let t = block["thinking"].as_str().unwrap().to_string()
                            + d["thinking"].as_str().unwrap();
                        block["thinking"] = t.into();
                    }
                    ("input_json_delta", "tool_use") => {
                        json_bufs[index] += d["partial_json"].as_str().unwrap();
                    }
                    other => panic!("delta {other:?}"),
                }
                for key in ["text", "thinking", "partial_json"] {
                    if let Some(s) = d.get(key) {
                        assert!(!s.as_str().unwrap().is_empty(), "empty delta {v}");
                    }
                }
            }
            "content_block_stop" => {
                let index = v["index"].as_u64().unwrap() as usize;
                assert_eq!(open, Some(index));
                if !json_bufs[index].is_empty() {
                    content[index]["input"] = serde_json::from_str(&json_bufs[index]).unwrap();
                }
                open = None;
            }
            "message_delta" => {
                assert!(open.is_none(), "message_delta with block {open:?} open");
                message["stop_reason"] = v["delta"]["stop_reason"].clone();
                message["stop_sequence"] = v["delta"]["stop_sequence"].clone();
                for (k, n) in v["usage"].as_object().unwrap() {
                    message["usage"][k] = n.clone();
                }
            }
            other => panic!("unexpected event {other}"),
        }
    }
    assert_eq!(events[events.len() - 2].0, "message_delta");
    message["content"] = Value::Array(content);
    message
}

#[test]
fn streamed_text_exact_events() {
    let mut last = update(2, vec![E::Text("lo".into())], Some(FinishReason::Stop));
    last.stop_sequence = Some("END".into());
    let events = stream(&[
        update(0, Vec::new(), None),
        update(1, vec![E::Text("Hel".into()), E::Text(String::new())], None),
        last,
    ]);
    let data: Vec<Value> = events.iter().map(|(_, v)| v.clone()).collect();
    assert_eq!(
        data,
        vec![
            json!({"type": "message_start", "message": {
                "id": "msg_r1", "type": "message", "role": "assistant", "model": "m",
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": {"input_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0, "output_tokens": 0},
            }}),
            json!({"type": "ping"}),
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "lo"}}),
            json!({"type": "content_block_stop", "index": 0}),
            json!({"type": "message_delta",
                   "delta": {"stop_reason": "stop_sequence", "stop_sequence": "END"},
                   "usage": {"input_tokens": 6, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4, "output_tokens": 20}}),
            json!({"type": "message_stop"}),
        ]
    );
}

#[test]
fn message_start_uses_usage_when_the_first_update_has_it() {
    let mut first = update(0, Vec::new(), None);
    first.usage = Some(Usage {
        prompt_tokens: 50,
        completion_tokens: 0,
        cached_tokens: 32,
    });
    let events = stream(&[
        first,
        update(1, vec![E::Text("x".into())], Some(FinishReason::Length)),
    ]);
    assert_eq!(
        events[0].1["message"]["usage"],
        json!({"input_tokens": 18, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 32, "output_tokens": 0})
    );
    let m = fold(&events);
    assert_eq!(m["stop_reason"], "max_tokens");
    assert_eq!(m["usage"]["output_tokens"], 20);
}

#[test]
fn streamed_tool_use_exact_events() {
    let events = stream(&[
        update(0, vec![start(0, "call_x", "get_weather")], None),
        update(1, vec![args(0, "{\"city\": "), args(0, "\"Oslo\"}")], None),
        update(2, vec![E::ToolCallEnd(0)], Some(FinishReason::ToolCalls)),
    ]);
    let data: Vec<Value> = events.iter().skip(2).map(|(_, v)| v.clone()).collect();
    assert_eq!(
        data,
        vec![
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "tool_use", "id": "toolu_x", "name": "get_weather", "input": {}}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": "{\"city\": "}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": "\"Oslo\"}"}}),
            json!({"type": "content_block_stop", "index": 0}),
            json!({"type": "message_delta",
                   "delta": {"stop_reason": "tool_use", "stop_sequence": null},
                   "usage": {"input_tokens": 6, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 4, "output_tokens": 20}}),
            json!({"type": "message_stop"}),
        ]
    );
}

#[test]
fn streamed_thinking_then_text_exact_events() {
    let events = stream(&[
        update(0, Vec::new(), None),
        update(1, vec![E::Reasoning("Hmm".into())], None),
        update(
            2,
            vec![E::Reasoning(".".into()), E::Text("Hi".into())],
            None,
        ),
        update(3, Vec::new(), Some(FinishReason::Stop)),
    ]);
    assert_eq!(
        names(&events),
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta",
            "content_block_delta",
            "content_block_stop",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        ]
    );
    let data: Vec<Value> = events
        .iter()
        .skip(2)
        .take(7)
        .map(|(_, v)| v.clone())
        .collect();
    assert_eq!(
        data,
        vec![
            json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Hmm"}}),
            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "."}}),
            json!({"type": "content_block_stop", "index": 0}),
            json!({"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}}),
            json!({"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Hi"}}),
            json!({"type": "content_block_stop", "index": 1}),
        ]
    );
    assert_eq!(events[9].1["delta"]["stop_reason"], "end_turn");
}

#[test]
fn streamed_folds_to_the_non_streamed_message() {
    let (_, whole) = rendered(&update(0, two_calls(), Some(FinishReason::ToolCalls)));
    // One event per update.
    let events = two_calls();
    let n = events.len() as u32;
    let mut updates: Vec<GenerationUpdate> = vec![update(0, Vec::new(), None)];
    updates.extend(
        events
            .into_iter()
            .enumerate()
            .map(|(i, e)| update(i as u32 + 1, vec![e], None)),
    );
    updates.push(update(n + 1, Vec::new(), Some(FinishReason::ToolCalls)));
    let streamed = stream(&updates);
    let folded = fold(&streamed);
    assert_eq!(folded["content"], whole["content"]);
    assert_eq!(
        (&folded["stop_reason"], &folded["stop_sequence"]),
        (&whole["stop_reason"], &whole["stop_sequence"])
    );
    assert_eq!(folded["usage"], whole["usage"]);
    assert_eq!(
        (&folded["id"], &folded["model"]),
        (&whole["id"], &whole["model"])
    );
    // message_start, ping, thinking (start, 2 deltas, stop), text (3),
    // 2 calls x (start, 2 deltas, stop), message_delta, message_stop.
    assert_eq!(streamed.len(), 2 + 4 + 3 + 8 + 2);

    // Everything in the one (first and last) update.
    let streamed = stream(&[update(0, two_calls(), Some(FinishReason::ToolCalls))]);
    assert_eq!(fold(&streamed)["content"], whole["content"]);

    // Invalid calls are text, between calls too; a call that starts right
    // after another one's text starts a new block.
    let events = vec![
        E::Text("a".into()),
        E::InvalidCall("<tool_call>{".into()),
        start(0, "call_1", "f"),
        args(0, "{}"),
        E::ToolCallEnd(0),
        E::Text("b".into()),
        start(1, "call_2", "g"),
        E::ToolCallEnd(1),
    ];
    let (_, whole) = rendered(&update(0, events.clone(), Some(FinishReason::ToolCalls)));
    assert_eq!(
        whole["content"],
        json!([
            {"type": "text", "text": "a<tool_call>{"},
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}},
            {"type": "text", "text": "b"},
            {"type": "tool_use", "id": "toolu_2", "name": "g", "input": {}},
        ])
    );
    let mut updates: Vec<GenerationUpdate> = events
        .into_iter()
        .enumerate()
        .map(|(i, e)| update(i as u32, vec![e], None))
        .collect();
    updates.push(update(99, Vec::new(), Some(FinishReason::ToolCalls)));
    assert_eq!(fold(&stream(&updates))["content"], whole["content"]);
}

#[test]
fn tool_use_ids() {
    assert_eq!(render::tool_use_id("call_abc"), "toolu_abc");
    assert_eq!(render::tool_use_id("xyz"), "toolu_xyz");
}

#[test]
fn output_config_format_becomes_the_constraint() {
    use mlxhost_plugin_sdk::structured::Grammar;
    let body = json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}],
        "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}}});
    let (_, c) =
        request::parse_with_constraint(body.to_string().as_bytes(), request::Normalize::default())
            .expect("valid");
    let c = c.expect("constraint");
    assert_eq!(
        (c.field.as_str(), c.grammar),
        (
            "output_config.format",
            Grammar::JsonSchema(r#"{"type":"object"}"#.into())
        )
    );
    let bad = json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}],
        "output_format": {"type": "json_schema"}});
    let e =
        request::parse_with_constraint(bad.to_string().as_bytes(), request::Normalize::default())
            .unwrap_err();
    assert_eq!(e.param.as_deref(), Some("output_format.schema"));
    assert!(
        e.message.starts_with("output_format.schema: "),
        "{}",
        e.message
    );
}
