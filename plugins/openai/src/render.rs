//! Canonical results -> OpenAI Chat Completions JSON (`chat.completion`,
//! `chat.completion.chunk`, error bodies), as in the OpenAI API reference.

use mlxhost_plugin_sdk::adapter::exports::mlxhost::plugin::api_adapter::{
    ApiError, ErrorKind, GenerationUpdate, RequestContext, TokenLogprob, Usage,
};
use mlxhost_plugin_sdk::adapter::mlxhost::plugin::types::{FinishReason, GenerationEvent};
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

/// The visible text of some events.
pub fn text_of(events: &[GenerationEvent]) -> String {
    events
        .iter()
        .filter_map(|e| match e {
            GenerationEvent::Text(t) => Some(t.as_str()),
            _ => None,
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
            "message": { "role": "assistant", "content": text_of(&update.events), "refusal": null },
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
/// content with its logprobs, then on the last update the finish chunk, the
/// usage chunk (when asked) and `[DONE]`.
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
    let text = text_of(&update.events);
    if !text.is_empty() || (opts.logprobs && !update.logprobs.is_empty()) {
        out.push(
            chunk(
                ctx,
                opts,
                json!({ "content": text }),
                logprobs(opts, &update.logprobs),
                Value::Null,
            )
            .to_string(),
        );
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
pub fn error(e: &ApiError) -> Value {
    let (kind, code) = match e.kind {
        ErrorKind::InvalidRequest => ("invalid_request_error", Value::Null),
        ErrorKind::NotFound => ("invalid_request_error", json!("not_found")),
        ErrorKind::TooLarge => ("invalid_request_error", json!("request_too_large")),
        ErrorKind::Plugin => ("server_error", json!("plugin_error")),
        ErrorKind::Server => ("server_error", Value::Null),
    };
    json!({ "error": { "message": e.message, "type": kind, "param": e.param, "code": code } })
}
