//! Canonical results -> OpenAI Responses JSON: the `response` object, its
//! output items and the streamed events, as in OpenAI's API reference
//! ("The response object", "Streaming events").
//!
//! Generation events become output items in order (the SDK's `blocks`):
//! reasoning -> a `reasoning` item (`content` `reasoning_text`, plus a
//! `summary_text` when `reasoning.summary` asked for one), text and
//! invalid-call text -> a `message` item with one `output_text` part, each
//! tool call -> a `function_call` item. The stream's final
//! `response.completed` carries the same object the non-streamed request
//! returns: both are built by [`response`] from the same events.

use mlxhost_plugin_sdk::v2::adapter::exports::mlxhost::plugin::api_adapter::{
    ApiError, ErrorKind, GenerationUpdate, RequestContext, TokenLogprob, Usage,
};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::request::{ContentPart, Message, ToolCall};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::types::{FinishReason, GenerationEvent};
use mlxhost_plugin_sdk::v2::blocks::{fold, Blocks, Built, Delta, Start, Step};
use std::collections::BTreeMap;

use serde_json::{json, Map, Value};

use crate::request::Options;

/// The response id of a request.
pub fn response_id(ctx: &RequestContext) -> String {
    format!("resp_{}", ctx.request_id)
}

fn item_id(ctx: &RequestContext, prefix: &str, index: u32) -> String {
    format!("{prefix}_{}_{index}", ctx.request_id)
}

/// OpenAI's `usage` of a response.
pub fn usage(u: Option<&Usage>) -> Value {
    match u {
        None => Value::Null,
        Some(u) => json!({
            "input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens,
        }),
    }
}

fn logprob_json(l: &TokenLogprob) -> Value {
    json!({
        "token": l.token,
        "bytes": l.bytes,
        "logprob": l.logprob,
        "top_logprobs": l.top.iter().map(|t| json!({
            "token": t.token, "bytes": t.bytes, "logprob": t.logprob,
        })).collect::<Vec<_>>(),
    })
}

fn reasoning_item(id: String, text: &str, summary: bool, status: Option<&str>) -> Value {
    let mut item = json!({
        "id": id,
        "type": "reasoning",
        "summary": if summary { json!([{"type": "summary_text", "text": text}]) } else { json!([]) },
        "content": [{"type": "reasoning_text", "text": text}],
    });
    if let Some(s) = status {
        item["status"] = json!(s);
    }
    item
}

fn text_part(text: &str, logprobs: &[Value]) -> Value {
    json!({"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs})
}

fn message_item(id: String, status: &str, content: Vec<Value>) -> Value {
    json!({"id": id, "type": "message", "status": status, "role": "assistant", "content": content})
}

fn call_item(id: String, status: &str, call_id: &str, name: &str, arguments: &str) -> Value {
    json!({"id": id, "type": "function_call", "status": status, "call_id": call_id,
           "name": name, "arguments": arguments})
}

/// The output items of a whole generation.
pub fn output_items(
    ctx: &RequestContext,
    opts: &Options,
    events: &[GenerationEvent],
    logprobs: &[TokenLogprob],
    streamed_logprobs: Option<&BTreeMap<u32, Vec<Value>>>,
    truncated: bool,
) -> Vec<Value> {
    let logprobs: Vec<Value> = logprobs.iter().map(logprob_json).collect();
    let mut logprobs_used = false;
    let built = fold(events);
    let last = built.len().saturating_sub(1);
    built
        .into_iter()
        .enumerate()
        .map(|(k, b)| {
            let index = k as u32;
            // The item the token limit cut is `incomplete`, as OpenAI marks it.
            let status = if k == last && truncated {
                "incomplete"
            } else {
                "completed"
            };
            match b {
                Built::Thinking(text) => reasoning_item(
                    item_id(ctx, "rs", index),
                    &text,
                    opts.reasoning_summary,
                    None,
                ),
                Built::Text(text) => {
                    // Streamed: the logprobs the item's deltas carried.
                    // Otherwise the whole reply's token logprobs go on the
                    // first text part.
                    let lp = match streamed_logprobs {
                        Some(m) => m.get(&index).map(Vec::as_slice).unwrap_or(&[]),
                        None if logprobs_used => &[][..],
                        None => &logprobs[..],
                    };
                    logprobs_used = true;
                    message_item(
                        item_id(ctx, "msg", index),
                        status,
                        vec![text_part(&text, lp)],
                    )
                }
                Built::ToolUse {
                    id,
                    name,
                    arguments,
                } => call_item(item_id(ctx, "fc", index), status, &id, &name, &arguments),
            }
        })
        .collect()
}

/// The assistant turn a generation adds to the conversation.
pub fn assistant_turn(events: &[GenerationEvent]) -> Message {
    let mut m = Message {
        role: "assistant".into(),
        content: Vec::new(),
        name: None,
        tool_calls: Vec::new(),
        tool_call_id: None,
        reasoning: None,
    };
    let mut text = String::new();
    for b in fold(events) {
        match b {
            Built::Text(t) => text.push_str(&t),
            Built::Thinking(r) => {
                let pending = m.reasoning.get_or_insert_with(String::new);
                if !pending.is_empty() {
                    pending.push('\n');
                }
                pending.push_str(&r);
            }
            Built::ToolUse {
                id,
                name,
                arguments,
            } => m.tool_calls.push(ToolCall {
                id,
                name,
                arguments,
            }),
        }
    }
    if !text.is_empty() {
        m.content.push(ContentPart::Text(text));
    }
    m
}

/// The `response` object with `status`, `output` and `usage` as given and
/// the request's echoed fields.
pub fn response_object(
    ctx: &RequestContext,
    opts: &Options,
    status: &str,
    output: Vec<Value>,
    usage: Value,
    finish: Option<FinishReason>,
    error: Value,
) -> Value {
    let mut o = Map::new();
    o.insert("id".into(), json!(response_id(ctx)));
    o.insert("object".into(), json!("response"));
    o.insert("created_at".into(), json!(ctx.created));
    o.insert("status".into(), json!(status));
    o.insert("background".into(), json!(false));
    o.insert("error".into(), error);
    let incomplete = match finish {
        Some(FinishReason::Length) => json!({"reason": "max_output_tokens"}),
        _ => Value::Null,
    };
    o.insert("incomplete_details".into(), incomplete);
    o.insert("model".into(), json!(ctx.model_id));
    o.insert("output".into(), Value::Array(output));
    for (k, v) in &opts.echo {
        o.insert(k.clone(), v.clone());
    }
    o.insert("usage".into(), usage);
    Value::Object(o)
}

/// `completed`, or `incomplete` when the generation hit its token limit.
fn final_status(finish: Option<FinishReason>) -> &'static str {
    match finish {
        Some(FinishReason::Length) => "incomplete",
        _ => "completed",
    }
}

/// The whole `response` object of a finished generation.
pub fn response(ctx: &RequestContext, opts: &Options, update: &GenerationUpdate) -> Value {
    streamed_response(ctx, opts, update, None)
}

/// [`response`], with each text item's logprobs as its streamed deltas
/// carried them (`None`: not streamed).
fn streamed_response(
    ctx: &RequestContext,
    opts: &Options,
    update: &GenerationUpdate,
    streamed_logprobs: Option<&BTreeMap<u32, Vec<Value>>>,
) -> Value {
    response_object(
        ctx,
        opts,
        final_status(update.finish),
        output_items(
            ctx,
            opts,
            &update.events,
            &update.logprobs,
            streamed_logprobs,
            update.finish == Some(FinishReason::Length),
        ),
        usage(update.usage.as_ref()),
        update.finish,
        Value::Null,
    )
}

/// `param` and `code` of a host error in this dialect: the host names the
/// prompt `messages` (its canonical request), which is `input` here; a
/// prompt over the model's context is `context_length_exceeded`, as
/// OpenAI codes it.
pub fn host_error_fields(error: &ApiError) -> (Option<String>, Option<&'static str>) {
    let param = match error.param.as_deref() {
        Some("messages") => Some("input".to_string()),
        Some("max_tokens") => Some("max_output_tokens".to_string()),
        other => other.map(str::to_string),
    };
    let code = match error.kind {
        ErrorKind::Plugin | ErrorKind::Server => Some("server_error"),
        ErrorKind::InvalidRequest
            if error
                .message
                .starts_with("this model's maximum context length") =>
        {
            Some("context_length_exceeded")
        }
        _ => None,
    };
    (param, code)
}

/// A stream's state across `render-stream` calls (one request).
#[derive(Debug, Default)]
pub struct Stream {
    started: bool,
    sequence: u64,
    blocks: Blocks,
    /// Every event so far: the final `response` is built from them.
    events: Vec<GenerationEvent>,
    logprobs: Vec<TokenLogprob>,
    /// The open item's text so far (for its `.done` events).
    text: String,
    /// Logprobs sent on each text item's deltas, by output index.
    text_logprobs: BTreeMap<u32, Vec<Value>>,
    /// The open tool call's (call id, name).
    call: Option<(String, String)>,
    /// The kind of the open item.
    open_kind: Option<Start>,
    /// The whole generation and its `response`, once finished (for the
    /// response store).
    pub finished: Option<(GenerationUpdate, Value)>,
}

impl Stream {
    fn event(&mut self, out: &mut Vec<(String, String)>, kind: &str, mut data: Value) {
        data["type"] = json!(kind);
        data["sequence_number"] = json!(self.sequence);
        self.sequence += 1;
        // `type` and `sequence_number` first, as OpenAI sends them.
        let mut ordered = Map::new();
        ordered.insert("type".into(), data["type"].take());
        ordered.insert("sequence_number".into(), data["sequence_number"].take());
        if let Value::Object(rest) = data {
            for (k, v) in rest {
                if k != "type" && k != "sequence_number" {
                    ordered.insert(k, v);
                }
            }
        }
        out.push((kind.to_string(), Value::Object(ordered).to_string()));
    }
}

/// The events of one streamed update, as (event name, data).
pub fn stream_events(
    ctx: &RequestContext,
    opts: &Options,
    state: &mut Stream,
    update: &GenerationUpdate,
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    if !state.started {
        state.started = true;
        let base = response_object(
            ctx,
            opts,
            "in_progress",
            Vec::new(),
            Value::Null,
            None,
            Value::Null,
        );
        state.event(
            &mut out,
            "response.created",
            json!({"response": base.clone()}),
        );
        state.event(&mut out, "response.in_progress", json!({"response": base}));
    }
    state.events.extend(update.events.iter().cloned());
    state.logprobs.extend(update.logprobs.iter().cloned());
    let mut steps = Vec::new();
    state.blocks.feed(&update.events, &mut steps);
    if update.finish.is_some() {
        state.blocks.finish(&mut steps);
    }
    // This update's token logprobs go on its first text delta.
    let mut delta_logprobs: Vec<Value> = update.logprobs.iter().map(logprob_json).collect();
    let truncated = update.finish == Some(FinishReason::Length);
    let last_stop = steps.iter().rev().find_map(|s| match s {
        Step::Stop(i) => Some(*i),
        _ => None,
    });
    for step in steps {
        match step {
            Step::Start(index, start) => {
                state.text.clear();
                let item = match &start {
                    Start::Thinking => {
                        json!({"id": item_id(ctx, "rs", index), "type": "reasoning", "summary": []})
                    }
                    Start::Text => {
                        message_item(item_id(ctx, "msg", index), "in_progress", Vec::new())
                    }
                    Start::ToolUse { id, name } => {
                        state.call = Some((id.clone(), name.clone()));
                        call_item(item_id(ctx, "fc", index), "in_progress", id, name, "")
                    }
                };
                state.event(
                    &mut out,
                    "response.output_item.added",
                    json!({"output_index": index, "item": item}),
                );
                match &start {
                    Start::Text => state.event(
                        &mut out,
                        "response.content_part.added",
                        json!({"item_id": item_id(ctx, "msg", index), "output_index": index,
                               "content_index": 0, "part": text_part("", &[])}),
                    ),
                    Start::Thinking if opts.reasoning_summary => state.event(
                        &mut out,
                        "response.reasoning_summary_part.added",
                        json!({"item_id": item_id(ctx, "rs", index), "output_index": index,
                               "summary_index": 0, "part": {"type": "summary_text", "text": ""}}),
                    ),
                    _ => {}
                }
                state.open_kind = Some(start);
            }
            Step::Delta(index, delta) => match delta {
                Delta::Text(d) => {
                    state.text.push_str(&d);
                    let lp = std::mem::take(&mut delta_logprobs);
                    state
                        .text_logprobs
                        .entry(index)
                        .or_default()
                        .extend(lp.iter().cloned());
                    state.event(
                        &mut out,
                        "response.output_text.delta",
                        json!({"item_id": item_id(ctx, "msg", index), "output_index": index,
                               "content_index": 0, "delta": d, "logprobs": lp}),
                    );
                }
                Delta::Thinking(d) => {
                    state.text.push_str(&d);
                    let id = item_id(ctx, "rs", index);
                    if opts.reasoning_summary {
                        state.event(
                            &mut out,
                            "response.reasoning_summary_text.delta",
                            json!({"item_id": id, "output_index": index, "summary_index": 0, "delta": d}),
                        );
                    }
                    state.event(
                        &mut out,
                        "response.reasoning_text.delta",
                        json!({"item_id": id, "output_index": index, "content_index": 0, "delta": d}),
                    );
                }
                Delta::Json(d) => {
                    state.text.push_str(&d);
                    state.event(
                        &mut out,
                        "response.function_call_arguments.delta",
                        json!({"item_id": item_id(ctx, "fc", index), "output_index": index, "delta": d}),
                    );
                }
            },
            Step::Stop(index) => {
                let text = std::mem::take(&mut state.text);
                // The item the token limit cut is `incomplete`, as in the
                // final response: the last one closed by the last update.
                let status = if truncated && Some(index) == last_stop {
                    "incomplete"
                } else {
                    "completed"
                };
                match state.open_kind.take() {
                    Some(Start::Thinking) => {
                        let id = item_id(ctx, "rs", index);
                        state.event(
                            &mut out,
                            "response.reasoning_text.done",
                            json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                        );
                        if opts.reasoning_summary {
                            state.event(
                                &mut out,
                                "response.reasoning_summary_text.done",
                                json!({"item_id": id, "output_index": index, "summary_index": 0, "text": text}),
                            );
                            state.event(
                                &mut out,
                                "response.reasoning_summary_part.done",
                                json!({"item_id": id, "output_index": index, "summary_index": 0,
                                       "part": {"type": "summary_text", "text": text}}),
                            );
                        }
                        let item = reasoning_item(id, &text, opts.reasoning_summary, None);
                        state.event(
                            &mut out,
                            "response.output_item.done",
                            json!({"output_index": index, "item": item}),
                        );
                    }
                    Some(Start::Text) => {
                        let id = item_id(ctx, "msg", index);
                        let lp = state.text_logprobs.get(&index).cloned().unwrap_or_default();
                        state.event(
                            &mut out,
                            "response.output_text.done",
                            json!({"item_id": id, "output_index": index, "content_index": 0,
                                   "text": text, "logprobs": lp}),
                        );
                        state.event(
                            &mut out,
                            "response.content_part.done",
                            json!({"item_id": id, "output_index": index, "content_index": 0,
                                   "part": text_part(&text, &lp)}),
                        );
                        let item = message_item(id, status, vec![text_part(&text, &lp)]);
                        state.event(
                            &mut out,
                            "response.output_item.done",
                            json!({"output_index": index, "item": item}),
                        );
                    }
                    Some(Start::ToolUse { .. }) | None => {
                        let (call_id, name) = state.call.take().unwrap_or_default();
                        let id = item_id(ctx, "fc", index);
                        state.event(
                            &mut out,
                            "response.function_call_arguments.done",
                            json!({"item_id": id, "output_index": index, "name": name, "arguments": text}),
                        );
                        let item = call_item(id, status, &call_id, &name, &text);
                        state.event(
                            &mut out,
                            "response.output_item.done",
                            json!({"output_index": index, "item": item}),
                        );
                    }
                }
            }
        }
    }
    if update.finish.is_some() {
        let whole = GenerationUpdate {
            sequence: update.sequence,
            events: std::mem::take(&mut state.events),
            logprobs: std::mem::take(&mut state.logprobs),
            finish: update.finish,
            stop_sequence: update.stop_sequence.clone(),
            usage: update.usage,
        };
        let final_kind = match final_status(update.finish) {
            "incomplete" => "response.incomplete",
            _ => "response.completed",
        };
        let body = streamed_response(ctx, opts, &whole, Some(&state.text_logprobs));
        state.event(&mut out, final_kind, json!({"response": body.clone()}));
        state.finished = Some((whole, body));
    }
    out
}

/// The events of a failure after the stream began: `response.created`
/// first if nothing was sent yet, then `response.failed` with the error.
pub fn stream_failed(
    ctx: &RequestContext,
    opts: &Options,
    state: &mut Stream,
    error: &ApiError,
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    if !state.started {
        state.started = true;
        let base = response_object(
            ctx,
            opts,
            "in_progress",
            Vec::new(),
            Value::Null,
            None,
            Value::Null,
        );
        state.event(&mut out, "response.created", json!({"response": base}));
    }
    let code = host_error_fields(error).1.unwrap_or("invalid_request");
    let failed = response_object(
        ctx,
        opts,
        "failed",
        output_items(
            ctx,
            opts,
            &state.events,
            &state.logprobs,
            Some(&state.text_logprobs),
            true,
        ),
        Value::Null,
        None,
        json!({"code": code, "message": error.message}),
    );
    state.event(&mut out, "response.failed", json!({"response": failed}));
    out
}
