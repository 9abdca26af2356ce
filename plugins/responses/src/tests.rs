//! Unit tests of the Responses adapter's parsing and rendering (natively:
//! nothing here calls the host's imports).

use mlxhost_plugin_sdk::v2::adapter::exports::mlxhost::plugin::api_adapter::{
    ApiError, ErrorKind, GenerationUpdate, RequestContext, Usage,
};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::request::{
    ContentPart, Message, Prompt, ToolCall, ToolChoice,
};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::types::{
    FinishReason, GenerationEvent, ToolCallDelta, ToolCallStart,
};
use serde_json::{json, Value};

use crate::render;
use crate::request::{parse, text_message, Options};
use crate::stored::Stored;

fn ctx() -> RequestContext {
    RequestContext {
        request_id: "r1".into(),
        created: 1_700_000_000,
        model_id: "m".into(),
    }
}

fn no_store(_: &str) -> Option<Vec<Message>> {
    None
}

fn ok(
    body: Value,
) -> (
    mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::request::GenerationRequest,
    Options,
) {
    parse(body.to_string().as_bytes(), &no_store, false).expect("valid request")
}

fn messages(body: Value) -> Vec<Message> {
    match ok(body).0.prompt {
        Prompt::Messages(m) => m,
        other => panic!("not messages: {other:?}"),
    }
}

fn text(m: &Message) -> String {
    m.content
        .iter()
        .map(|p| match p {
            ContentPart::Text(t) => t.clone(),
            ContentPart::ImageUrl(u) => u.clone(),
        })
        .collect()
}

fn param_of(body: Value) -> (u16, Option<String>) {
    let e = parse(body.to_string().as_bytes(), &no_store, false).expect_err("rejected");
    (e.status, e.param)
}

#[test]
fn string_input_and_instructions() {
    let m = messages(json!({"input": "Hi", "instructions": "Be brief."}));
    assert_eq!(m.len(), 2);
    assert_eq!(
        (m[0].role.as_str(), text(&m[0]).as_str()),
        ("system", "Be brief.")
    );
    assert_eq!((m[1].role.as_str(), text(&m[1]).as_str()), ("user", "Hi"));
}

#[test]
fn items_become_the_conversation() {
    let m = messages(json!({"input": [
        {"type": "message", "role": "developer", "content": "Rules."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "Need a tool."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]},
    ]}));
    let roles: Vec<&str> = m.iter().map(|x| x.role.as_str()).collect();
    assert_eq!(roles, ["system", "user", "assistant", "tool", "tool"]);
    let a = &m[2];
    assert_eq!(text(a), "Checking.");
    assert_eq!(a.reasoning.as_deref(), Some("Need a tool."));
    let ids: Vec<&str> = a.tool_calls.iter().map(|c| c.id.as_str()).collect();
    assert_eq!(ids, ["c1", "c2"]);
    assert_eq!(m[3].tool_call_id.as_deref(), Some("c1"));
    assert_eq!(text(&m[4]), "noon");
}

#[test]
fn a_call_after_a_tool_result_starts_a_new_assistant_turn() {
    let m = messages(json!({"input": [
        {"role": "user", "content": "go"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "1"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "again"}]},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
    ]}));
    let roles: Vec<&str> = m.iter().map(|x| x.role.as_str()).collect();
    assert_eq!(roles, ["user", "assistant", "tool", "assistant"]);
    assert_eq!(m[3].reasoning.as_deref(), Some("again"));
    assert_eq!(m[3].tool_calls[0].id, "c2");
}

#[test]
fn previous_response_id_prepends_the_stored_conversation() {
    let stored = vec![
        text_message("user", "Q1".into()),
        text_message("assistant", "A1".into()),
    ];
    let resolve = |id: &str| (id == "resp_1").then(|| stored.clone());
    let body = json!({"input": "Q2", "instructions": "Now.", "previous_response_id": "resp_1"});
    let (g, opts) = parse(body.to_string().as_bytes(), &resolve, false).unwrap();
    let Prompt::Messages(m) = g.prompt else {
        panic!()
    };
    let texts: Vec<String> = m.iter().map(text).collect();
    assert_eq!(texts, ["Now.", "Q1", "A1", "Q2"]);
    // What a continuation stores: without this request's instructions.
    let stored_texts: Vec<String> = opts.conversation.iter().map(text).collect();
    assert_eq!(stored_texts, ["Q1", "A1", "Q2"]);
    assert_eq!(opts.echo["previous_response_id"], "resp_1");

    let body = json!({"input": "Q2", "previous_response_id": "resp_gone"});
    let e = parse(body.to_string().as_bytes(), &resolve, false).unwrap_err();
    assert_eq!(e.status, 404);
    assert_eq!(e.code, Some("previous_response_not_found"));
    assert_eq!(e.param.as_deref(), Some("previous_response_id"));
}

#[test]
fn only_function_tools_are_offered() {
    let (g, opts) = ok(json!({"input": "x", "tools": [
        {"type": "web_search"},
        {"type": "namespace", "name": "mcp__x", "tools": [{"type": "function", "name": "inner"}]},
        {"type": "custom", "name": "apply_patch", "format": {"type": "grammar"}},
        {"type": "function", "name": "shell", "parameters": {"type": "object"}, "strict": false},
    ], "tool_choice": "required", "parallel_tool_calls": false}));
    let names: Vec<&str> = g.tools.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["shell"]);
    assert!(matches!(g.tool_choice, ToolChoice::Required));
    assert!(!g.parallel_tool_calls);
    assert_eq!(opts.echo["tools"][0]["name"], "shell");
    assert_eq!(opts.echo["tools"].as_array().unwrap().len(), 1);
    // Without tools, auto means none.
    assert!(matches!(
        ok(json!({"input": "x"})).0.tool_choice,
        ToolChoice::None
    ));
}

#[test]
fn fields_codex_sends_are_accepted() {
    let (g, opts) = ok(json!({
        "model": "m", "instructions": "You are Codex.", "input": [{"type": "message", "role": "user",
        "content": [{"type": "input_text", "text": "hi"}]}], "tools": [], "tool_choice": "auto",
        "parallel_tool_calls": false, "reasoning": {"effort": "medium", "summary": "auto"},
        "store": false, "stream": true, "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "abc", "text": {"verbosity": "low"}, "service_tier": null,
    }));
    assert!(g.stream && !opts.store && opts.reasoning_summary);
    assert!(g.clamp_max_tokens && g.max_tokens.is_none());
    assert_eq!(opts.echo["text"]["format"]["type"], "text");
}

#[test]
fn malformed_requests_name_the_field() {
    for (body, status, param) in [
        (json!({"input": 5}), 400, "input"),
        (json!({"input": [{"type": "bogus"}]}), 400, "input[0].type"),
        (json!({"input": [{"foo": 1}]}), 400, "input[0].type"),
        (
            json!({"input": [{"role": "robot", "content": "x"}]}),
            400,
            "input[0].role",
        ),
        (
            json!({"input": [{"role": "user"}]}),
            400,
            "input[0].content",
        ),
        (
            json!({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}),
            400,
            "input[0].content[0].type",
        ),
        (
            json!({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}),
            400,
            "input[0].arguments",
        ),
        (
            json!({"input": [{"type": "item_reference", "id": "x"}]}),
            400,
            "input[0].type",
        ),
        (
            json!({"input": "x", "tools": [{"name": "f"}]}),
            400,
            "tools[0].type",
        ),
        (
            json!({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}),
            400,
            "tools[0].name",
        ),
        (
            json!({"input": "x", "tool_choice": "sometimes"}),
            400,
            "tool_choice",
        ),
        (
            json!({"input": "x", "reasoning": {"summary": "long"}}),
            400,
            "reasoning.summary",
        ),
        (
            json!({"input": "x", "top_logprobs": 21}),
            400,
            "top_logprobs",
        ),
        (
            json!({"input": "x", "conversation": "conv_1"}),
            400,
            "conversation",
        ),
        (json!({"input": []}), 400, "input"),
        (
            json!({"input": "x", "tool_choice": {"type": "web_search_preview"}}),
            400,
            "tool_choice.type",
        ),
        (
            json!({"input": "x", "metadata": {"k": 1}}),
            400,
            "metadata.k",
        ),
        (
            json!({"input": "x", "metadata": {"k": "v".repeat(513)}}),
            400,
            "metadata.k",
        ),
        (
            json!({"input": "x", "metadata": (0..17).map(|i| (format!("k{i}"), json!("v"))).collect::<serde_json::Map<_, _>>()}),
            400,
            "metadata",
        ),
    ] {
        assert_eq!(
            param_of(body.clone()),
            (status, Some(param.to_string())),
            "{body}"
        );
    }
}

fn update(
    sequence: u32,
    events: Vec<GenerationEvent>,
    finish: Option<FinishReason>,
) -> GenerationUpdate {
    GenerationUpdate {
        sequence,
        events,
        logprobs: Vec::new(),
        finish,
        stop_sequence: None,
        usage: finish.map(|_| Usage {
            prompt_tokens: 10,
            completion_tokens: 5,
            cached_tokens: 2,
        }),
    }
}

fn call_events() -> Vec<GenerationEvent> {
    vec![
        GenerationEvent::Reasoning("Think.".into()),
        GenerationEvent::Text("Let me check.".into()),
        GenerationEvent::ToolCallStart(ToolCallStart {
            index: 0,
            id: "call_1".into(),
            name: "get_weather".into(),
        }),
        GenerationEvent::ToolCallArgumentsDelta(ToolCallDelta {
            index: 0,
            arguments: "{\"city\":".into(),
        }),
        GenerationEvent::ToolCallArgumentsDelta(ToolCallDelta {
            index: 0,
            arguments: " \"Paris\"}".into(),
        }),
        GenerationEvent::ToolCallEnd(0),
    ]
}

#[test]
fn output_items_in_order() {
    let (_, opts) = ok(json!({"input": "x"}));
    let whole = update(0, call_events(), Some(FinishReason::ToolCalls));
    let r = render::response(&ctx(), &opts, &whole);
    assert_eq!(r["id"], "resp_r1");
    assert_eq!(r["status"], "completed");
    let kinds: Vec<&str> = r["output"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["type"].as_str().unwrap())
        .collect();
    assert_eq!(kinds, ["reasoning", "message", "function_call"]);
    assert_eq!(r["output"][0]["content"][0]["text"], "Think.");
    assert_eq!(r["output"][0]["summary"], json!([]));
    assert_eq!(r["output"][1]["content"][0]["text"], "Let me check.");
    assert_eq!(r["output"][2]["call_id"], "call_1");
    assert_eq!(r["output"][2]["arguments"], "{\"city\": \"Paris\"}");
    assert_eq!(r["usage"]["input_tokens"], 10);
    assert_eq!(r["usage"]["input_tokens_details"]["cached_tokens"], 2);
    assert_eq!(r["usage"]["total_tokens"], 15);

    let turn = render::assistant_turn(&whole.events);
    assert_eq!(turn.reasoning.as_deref(), Some("Think."));
    assert_eq!(text(&turn), "Let me check.");
    let call = &turn.tool_calls[0];
    assert_eq!(turn.tool_calls.len(), 1);
    assert_eq!(
        (call.id.as_str(), call.name.as_str()),
        ("call_1", "get_weather")
    );
    assert_eq!(call.arguments, "{\"city\": \"Paris\"}");
}

#[test]
fn a_stream_is_a_sequence_that_ends_in_the_non_streamed_response() {
    let (_, opts) = ok(json!({"input": "x", "stream": true, "reasoning": {"summary": "auto"}}));
    let events = call_events();
    let mut state = render::Stream::default();
    let mut out = Vec::new();
    // One event per update, as a stream delivers them.
    for (k, e) in events.iter().enumerate() {
        out.extend(render::stream_events(
            &ctx(),
            &opts,
            &mut state,
            &update(k as u32, vec![e.clone()], None),
        ));
    }
    out.extend(render::stream_events(
        &ctx(),
        &opts,
        &mut state,
        &update(
            events.len() as u32,
            Vec::new(),
            Some(FinishReason::ToolCalls),
        ),
    ));
    let parsed: Vec<Value> = out
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    for (k, (name, _)) in out.iter().enumerate() {
        assert_eq!(parsed[k]["type"], name.as_str());
        assert_eq!(parsed[k]["sequence_number"], k);
    }
    let names: Vec<&str> = out.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.reasoning_summary_part.added",
            "response.reasoning_summary_text.delta",
            "response.reasoning_text.delta",
            "response.reasoning_text.done",
            "response.reasoning_summary_text.done",
            "response.reasoning_summary_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
            "response.completed",
        ]
    );
    let whole = update(0, events, Some(FinishReason::ToolCalls));
    assert_eq!(
        parsed.last().unwrap()["response"],
        render::response(&ctx(), &opts, &whole)
    );
    // Each item's `.done` equals the final response's item.
    let done: Vec<&Value> = parsed
        .iter()
        .filter(|e| e["type"] == "response.output_item.done")
        .map(|e| &e["item"])
        .collect();
    let final_items = parsed.last().unwrap()["response"]["output"]
        .as_array()
        .unwrap()
        .clone();
    assert_eq!(done.into_iter().cloned().collect::<Vec<_>>(), final_items);
    let (whole, _) = state.finished.expect("kept for the store");
    assert_eq!(whole.events.len(), 6);
}

#[test]
fn a_failure_mid_stream_ends_in_response_failed() {
    let (_, opts) = ok(json!({"input": "x", "stream": true}));
    let mut state = render::Stream::default();
    let mut out = render::stream_events(
        &ctx(),
        &opts,
        &mut state,
        &update(0, vec![GenerationEvent::Text("partial".into())], None),
    );
    out.extend(render::stream_failed(
        &ctx(),
        &opts,
        &mut state,
        &ApiError {
            status: 500,
            kind: ErrorKind::Plugin,
            message: "plugin `trap` failed".into(),
            param: None,
        },
    ));
    let (name, data) = out.last().unwrap();
    assert_eq!(name, "response.failed");
    let v: Value = serde_json::from_str(data).unwrap();
    assert_eq!(v["response"]["status"], "failed");
    assert_eq!(v["response"]["error"]["code"], "server_error");
    assert_eq!(v["response"]["output"][0]["content"][0]["text"], "partial");
}

#[test]
fn stored_documents_round_trip() {
    let mut assistant = text_message("assistant", "A".into());
    // Parts are kept as parts (joining them would change the prompt).
    assistant.content.push(ContentPart::Text("B".into()));
    assistant.reasoning = Some("R".into());
    assistant.tool_calls.push(ToolCall {
        id: "c".into(),
        name: "f".into(),
        arguments: "{}".into(),
    });
    let mut tool = text_message("tool", "out".into());
    tool.tool_call_id = Some("c".into());
    let s = Stored {
        response: json!({"id": "resp_1"}),
        conversation: vec![text_message("user", "Q".into()), assistant, tool],
        input_items: vec![json!({"type": "message"})],
    };
    let back = Stored::from_bytes(&s.to_bytes()).unwrap();
    assert_eq!(back.response, s.response);
    assert_eq!(
        format!("{:?}", back.conversation),
        format!("{:?}", s.conversation)
    );
    assert_eq!(back.input_items, s.input_items);
    assert!(Stored::from_bytes(b"not json").is_none());
}

#[test]
fn counting_takes_instructions_alone_but_a_generation_needs_input() {
    let body = json!({"instructions": "Be brief."}).to_string();
    assert!(parse(body.as_bytes(), &no_store, true).is_ok());
    let e = parse(body.as_bytes(), &no_store, false).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("input"));
}

#[test]
fn a_truncated_stream_with_logprobs_agrees_with_its_final_response() {
    use mlxhost_plugin_sdk::v2::adapter::exports::mlxhost::plugin::api_adapter::TokenLogprob;
    let (_, opts) = ok(json!({"input": "x", "stream": true, "top_logprobs": 1}));
    let lp = |t: &str| TokenLogprob {
        id: 1,
        token: t.into(),
        bytes: t.as_bytes().to_vec(),
        logprob: -0.5,
        top: Vec::new(),
    };
    let mut state = render::Stream::default();
    let mut out = Vec::new();
    for (k, t) in ["Hel", "lo"].into_iter().enumerate() {
        let mut u = update(k as u32, vec![GenerationEvent::Text(t.into())], None);
        u.logprobs = vec![lp(t)];
        out.extend(render::stream_events(&ctx(), &opts, &mut state, &u));
    }
    out.extend(render::stream_events(
        &ctx(),
        &opts,
        &mut state,
        &update(2, Vec::new(), Some(FinishReason::Length)),
    ));
    let parsed: Vec<Value> = out
        .iter()
        .map(|(_, d)| serde_json::from_str(d).unwrap())
        .collect();
    let last = parsed.last().unwrap();
    assert_eq!(last["type"], "response.incomplete");
    let done = parsed
        .iter()
        .find(|e| e["type"] == "response.output_item.done")
        .unwrap();
    assert_eq!(done["item"]["status"], "incomplete");
    assert_eq!(done["item"], last["response"]["output"][0]);
    assert_eq!(
        done["item"]["content"][0]["logprobs"]
            .as_array()
            .unwrap()
            .len(),
        2
    );
    let text_done = parsed
        .iter()
        .find(|e| e["type"] == "response.output_text.done")
        .unwrap();
    assert_eq!(
        text_done["logprobs"],
        done["item"]["content"][0]["logprobs"]
    );
}

#[test]
fn seed_is_a_signed_64_bit_integer_as_in_chat_completions() {
    let seed = |s: Value| ok(json!({"input": "Hi", "seed": s})).0.sampling.seed;
    assert_eq!(seed(json!(7)), Some(7));
    assert_eq!(seed(json!(-1)), Some(u64::MAX));
    assert_eq!(seed(json!(i64::MAX)), Some(i64::MAX as u64));
    for bad in [json!(9223372036854775808u64), json!(1.5), json!("7")] {
        let e = parse(
            json!({"input": "Hi", "seed": bad}).to_string().as_bytes(),
            &no_store,
            false,
        )
        .expect_err("rejected");
        assert_eq!(e.param.as_deref(), Some("seed"));
        assert!(e.message.contains("-2^63 to 2^63-1"), "{}", e.message);
    }
}

#[test]
fn text_format_json_schema_becomes_the_constraint_and_is_echoed() {
    use mlxhost_plugin_sdk::structured::Grammar;
    let body = json!({"input": "hi", "text": {"format": {"type": "json_schema", "name": "r",
        "strict": true, "schema": {"type": "object"}}}});
    let none = |_: &str| None;
    let (_, opts) =
        crate::request::parse(body.to_string().as_bytes(), &none, false).expect("valid");
    let c = opts.constraint.expect("constraint");
    assert_eq!(c.field, "text.format");
    assert_eq!(
        c.grammar,
        Grammar::JsonSchema(r#"{"type":"object"}"#.into())
    );
    assert_eq!(opts.echo["text"]["format"]["type"], json!("json_schema"));
    let bad = json!({"input": "hi", "text": {"format": {"type": "json_schema", "name": "r"}}});
    let e = crate::request::parse(bad.to_string().as_bytes(), &none, false).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("text.format.schema"));
}
