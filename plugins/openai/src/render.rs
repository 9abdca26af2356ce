//! Canonical results -> OpenAI Chat Completions JSON (`chat.completion`,
//! `chat.completion.chunk`, error bodies), as in the OpenAI API reference.
//!
//! Events (`mlxhost:plugin@0.2.0` `generation-event`) map to a message as:
//! `text` and `invalid-call` -> `content` (an invalid call is shown as the
//! text the model wrote); `reasoning` -> `reasoning_content` (vLLM's name;
//! OpenAI's Chat Completions has no reasoning field); `tool-call-*` ->
//! `tool_calls`; `error` is not rendered (the host counts it).

use mlxhost_plugin_sdk::v2::adapter::exports::mlxhost::plugin::api_adapter::{
    ApiError, ErrorKind, GenerationUpdate, RequestContext, TokenLogprob, Usage,
};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::types::{FinishReason, GenerationEvent};
use serde_json::{json, Value};

use crate::request::RenderOptions;

/// `finish_reason` as OpenAI spells it.
pub fn finish_reason(f: FinishReason) -> &'static str {
    match f {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::ToolCalls => "tool_calls",
        // Never rendered as a normal finish: the host reports these as errors.
        FinishReason::Cancelled | FinishReason::Error => "stop",
    }
}

/// A tool call assembled from its events.
#[derive(Debug, Default, PartialEq)]
pub struct Call {
    pub index: u32,
    pub id: String,
    pub name: String,
    /// The argument fragments joined.
    pub arguments: String,
}

/// A whole assistant message assembled from events.
#[derive(Debug, Default, PartialEq)]
pub struct Assembled {
    /// `text` and `invalid-call` texts, in order.
    pub content: String,
    /// `reasoning` texts joined; none when there were none.
    pub reasoning: Option<String>,
    /// The calls, in the order they began.
    pub tool_calls: Vec<Call>,
}

/// Folds a whole generation's events into one message.
pub fn assemble(events: &[GenerationEvent]) -> Assembled {
    let mut out = Assembled::default();
    fn call(calls: &mut Vec<Call>, index: u32) -> &mut Call {
        // Arguments before their start never come from the host; if they
        // did, the start still fills in the id and name.
        match calls.iter().position(|c| c.index == index) {
            Some(k) => &mut calls[k],
            None => {
                calls.push(Call {
                    index,
                    ..Call::default()
                });
                calls.last_mut().unwrap()
            }
        }
    }
    for e in events {
        match e {
            GenerationEvent::Text(t) | GenerationEvent::InvalidCall(t) => out.content.push_str(t),
            GenerationEvent::Reasoning(r) => {
                out.reasoning.get_or_insert_with(String::new).push_str(r)
            }
            GenerationEvent::ToolCallStart(s) => {
                let c = call(&mut out.tool_calls, s.index);
                c.id = s.id.clone();
                c.name = s.name.clone();
            }
            GenerationEvent::ToolCallArgumentsDelta(d) => call(&mut out.tool_calls, d.index)
                .arguments
                .push_str(&d.arguments),
            GenerationEvent::ToolCallEnd(_) | GenerationEvent::Error(_) => {}
        }
    }
    out
}

/// The `message` of a non-streamed choice. As OpenAI: `content` is null when
/// the reply is only tool calls; `tool_calls` is left out when there are none.
pub fn message(events: &[GenerationEvent]) -> Value {
    let a = assemble(events);
    let content = if a.content.is_empty() && !a.tool_calls.is_empty() {
        Value::Null
    } else {
        Value::String(a.content)
    };
    let mut m = json!({ "role": "assistant", "content": content, "refusal": null });
    if let Some(r) = a.reasoning {
        m["reasoning_content"] = Value::String(r);
    }
    if !a.tool_calls.is_empty() {
        m["tool_calls"] = a
            .tool_calls
            .into_iter()
            .map(|c| {
                json!({
                    "id": c.id,
                    "type": "function",
                    "function": { "name": c.name, "arguments": c.arguments },
                })
            })
            .collect();
    }
    m
}

/// The deltas of one streamed update, in event order: adjacent content
/// (`text`, `invalid-call`) merges into one delta, adjacent reasoning into
/// one, adjacent argument fragments of one call into one; a call's start
/// carries its id, type and name (once), later fragments only `index` and
/// `arguments`. Empty texts give nothing.
pub fn deltas(events: &[GenerationEvent]) -> Vec<Value> {
    enum Delta {
        Content(String),
        Reasoning(String),
        Start(u32, String, String),
        Arguments(u32, String),
    }
    let mut out: Vec<Delta> = Vec::new();
    for e in events {
        match e {
            GenerationEvent::Text(t) | GenerationEvent::InvalidCall(t) if !t.is_empty() => {
                match out.last_mut() {
                    Some(Delta::Content(c)) => c.push_str(t),
                    _ => out.push(Delta::Content(t.clone())),
                }
            }
            GenerationEvent::Reasoning(r) if !r.is_empty() => match out.last_mut() {
                Some(Delta::Reasoning(c)) => c.push_str(r),
                _ => out.push(Delta::Reasoning(r.clone())),
            },
            GenerationEvent::ToolCallStart(s) => {
                out.push(Delta::Start(s.index, s.id.clone(), s.name.clone()))
            }
            GenerationEvent::ToolCallArgumentsDelta(d) if !d.arguments.is_empty() => {
                match out.last_mut() {
                    Some(Delta::Arguments(i, a)) if *i == d.index => a.push_str(&d.arguments),
                    _ => out.push(Delta::Arguments(d.index, d.arguments.clone())),
                }
            }
            _ => {}
        }
    }
    out.into_iter()
        .map(|d| match d {
            Delta::Content(c) => json!({ "content": c }),
            Delta::Reasoning(r) => json!({ "reasoning_content": r }),
            Delta::Start(index, id, name) => json!({ "tool_calls": [{
                "index": index,
                "id": id,
                "type": "function",
                "function": { "name": name, "arguments": "" },
            }] }),
            Delta::Arguments(index, arguments) => json!({ "tool_calls": [{
                "index": index,
                "function": { "arguments": arguments },
            }] }),
        })
        .collect()
}

/// The `logprobs` object of a choice (`null` when not requested).
pub fn logprobs(opts: &RenderOptions, tokens: &[TokenLogprob]) -> Value {
    if !opts.logprobs {
        return Value::Null;
    }
    let name = |token: &str, id: u32| {
        if opts.tokens_as_ids {
            format!("token_id:{id}")
        } else {
            token.to_string()
        }
    };
    let content: Vec<Value> = tokens
        .iter()
        .map(|t| {
            json!({
                "token": name(&t.token, t.id),
                "logprob": t.logprob,
                "bytes": t.bytes,
                "top_logprobs": t.top.iter().map(|a| json!({
                    "token": name(&a.token, a.id),
                    "logprob": a.logprob,
                    "bytes": a.bytes,
                })).collect::<Vec<_>>(),
            })
        })
        .collect();
    json!({ "content": content, "refusal": null })
}

pub fn usage(u: &Usage) -> Value {
    json!({
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": u.cached_tokens },
    })
}

fn completion_id(ctx: &RequestContext) -> String {
    format!("chatcmpl-{}", ctx.request_id)
}

/// A whole `chat.completion` object.
pub fn completion(ctx: &RequestContext, opts: &RenderOptions, update: &GenerationUpdate) -> Value {
    json!({
        "id": completion_id(ctx),
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.model_id,
        "system_fingerprint": null,
        "choices": [{
            "index": 0,
            "message": message(&update.events),
            "logprobs": logprobs(opts, &update.logprobs),
            "finish_reason": update.finish.map(finish_reason).unwrap_or("stop"),
        }],
        "usage": update.usage.as_ref().map(usage).unwrap_or(Value::Null),
    })
}

/// One `chat.completion.chunk` with a single choice.
fn chunk(
    ctx: &RequestContext,
    opts: &RenderOptions,
    delta: Value,
    logprobs: Value,
    finish: Value,
) -> Value {
    let mut c = json!({
        "id": completion_id(ctx),
        "object": "chat.completion.chunk",
        "created": ctx.created,
        "model": ctx.model_id,
        "system_fingerprint": null,
        "choices": [{ "index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish }],
    });
    if opts.include_usage {
        // OpenAI sends `usage: null` on every chunk but the last when asked.
        c["usage"] = Value::Null;
    }
    c
}

/// The chunks for one update, in order: the role chunk first (sequence 0),
/// the event deltas (`deltas`, the first with the update's logprobs), then
/// on the last update the finish chunk, the usage chunk (when asked) and
/// `[DONE]`.
pub fn stream_chunks(
    ctx: &RequestContext,
    opts: &RenderOptions,
    update: &GenerationUpdate,
) -> Vec<String> {
    let mut out = Vec::new();
    if update.sequence == 0 {
        out.push(
            chunk(
                ctx,
                opts,
                json!({ "role": "assistant", "content": "" }),
                Value::Null,
                Value::Null,
            )
            .to_string(),
        );
    }
    // The update's logprobs ride on its first chunk; an update with
    // logprobs and no visible delta (tokens a parser holds back) still
    // reports them, on an empty `content` delta.
    let mut deltas = deltas(&update.events);
    if deltas.is_empty() && opts.logprobs && !update.logprobs.is_empty() {
        deltas.push(json!({ "content": "" }));
    }
    for (k, delta) in deltas.into_iter().enumerate() {
        let lp = if k == 0 {
            logprobs(opts, &update.logprobs)
        } else {
            Value::Null
        };
        out.push(chunk(ctx, opts, delta, lp, Value::Null).to_string());
    }
    if let Some(f) = update.finish {
        out.push(chunk(ctx, opts, json!({}), Value::Null, json!(finish_reason(f))).to_string());
        if opts.include_usage {
            if let Some(u) = &update.usage {
                out.push(
                    json!({
                        "id": completion_id(ctx),
                        "object": "chat.completion.chunk",
                        "created": ctx.created,
                        "model": ctx.model_id,
                        "system_fingerprint": null,
                        "choices": [],
                        "usage": usage(u),
                    })
                    .to_string(),
                );
            }
        }
        out.push("[DONE]".into());
    }
    out
}

/// An OpenAI error body: `{"error": {"message", "type", "param", "code"}}`.
/// Whether a host error is the prompt exceeding the model's context (the
/// host's message for it; OpenAI's code is `context_length_exceeded`).
pub fn context_overflow(message: &str) -> bool {
    message.starts_with("this model's maximum context length")
}

pub fn error(e: &ApiError) -> Value {
    let (kind, code) = match e.kind {
        ErrorKind::InvalidRequest if context_overflow(&e.message) => {
            ("invalid_request_error", json!("context_length_exceeded"))
        }
        ErrorKind::InvalidRequest => ("invalid_request_error", Value::Null),
        ErrorKind::NotFound => ("invalid_request_error", json!("not_found")),
        ErrorKind::TooLarge => ("invalid_request_error", json!("request_too_large")),
        ErrorKind::Plugin => ("server_error", json!("plugin_error")),
        ErrorKind::Server => ("server_error", Value::Null),
    };
    json!({ "error": { "message": e.message, "type": kind, "param": e.param, "code": code } })
}
