//! Canonical results -> Anthropic Messages JSON: the `message` object,
//! the streamed events (`message_start`, `ping`, `content_block_start` /
//! `_delta` / `_stop`, `message_delta`, `message_stop`) and error bodies.
//!
//! Events (`mlxhost:plugin@0.2.0` `generation-event`) become content blocks
//! in order: `reasoning` -> a `thinking` block, `text` and `invalid-call`
//! -> a `text` block (an invalid call is shown as the text the model
//! wrote), each tool call -> a `tool_use` block; a change of kind starts a
//! new block; `error` is not rendered (the host counts it). One state
//! machine (`Blocks`) cuts blocks for both responses, so a stream folds to
//! exactly the non-streamed message.

use mlxhost_plugin_sdk::v2::adapter::exports::mlxhost::plugin::api_adapter::{
    ApiError, ErrorKind, GenerationUpdate, RequestContext, Usage,
};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::types::{FinishReason, GenerationEvent};
pub use mlxhost_plugin_sdk::v2::blocks::{fold, Blocks, Built, Delta, Start, Step};
use serde::Serialize;
use serde_json::value::RawValue;
use serde_json::{json, Value};

/// `stop_reason` as Anthropic spells it.
pub fn stop_reason(finish: Option<FinishReason>, stop_sequence: Option<&str>) -> &'static str {
    match finish {
        Some(FinishReason::ToolCalls) => "tool_use",
        Some(FinishReason::Length) => "max_tokens",
        Some(FinishReason::Stop) if stop_sequence.is_some() => "stop_sequence",
        // Cancelled and error never reach a normal render: the host reports
        // them as errors.
        _ => "end_turn",
    }
}

/// The `stop_sequence` field: the matched string, only with `stop_sequence`.
fn stop_sequence(update: &GenerationUpdate) -> Option<&str> {
    match update.finish {
        Some(FinishReason::Stop) => update.stop_sequence.as_deref(),
        _ => None,
    }
}

/// Anthropic-style tool-use ids: the host's `call_X` becomes `toolu_X` (in
/// both responses; the client echoes it in `tool_result`, and the id only
/// reaches the chat template, so it is never mapped back).
pub fn tool_use_id(id: &str) -> String {
    format!("toolu_{}", id.strip_prefix("call_").unwrap_or(id))
}

pub fn message_id(ctx: &RequestContext) -> String {
    format!("msg_{}", ctx.request_id)
}

/// Anthropic's usage: `input_tokens` excludes cache reads (the total input
/// is `input_tokens + cache_creation_input_tokens + cache_read_input_tokens`).
pub fn usage(u: Option<&Usage>, output: bool) -> Value {
    let (prompt, cached, completion) = u
        .map(|u| (u.prompt_tokens, u.cached_tokens, u.completion_tokens))
        .unwrap_or((0, 0, 0));
    json!({
        "input_tokens": prompt.saturating_sub(cached),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": if output { completion } else { 0 },
    })
}

/// A content block of the non-streamed message.
#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Block {
    Text {
        text: String,
    },
    Thinking {
        thinking: String,
        /// Anthropic's signature of the thinking; this server signs nothing.
        signature: String,
    },
    ToolUse {
        id: String,
        name: String,
        /// The arguments as the model wrote them (key order kept).
        input: Box<RawValue>,
    },
}

/// The arguments' JSON text as an `input` object (`{}` when empty; the host
/// checks that a complete call's arguments are one JSON object).
fn input(arguments: &str) -> Box<RawValue> {
    match serde_json::from_str::<Value>(arguments) {
        Ok(Value::Object(_)) => RawValue::from_string(arguments.trim().to_string()),
        _ => RawValue::from_string("{}".into()),
    }
    .expect("valid JSON")
}

/// The non-streamed message's content blocks.
fn blocks(events: &[GenerationEvent]) -> Vec<Block> {
    fold(events)
        .into_iter()
        .map(|b| match b {
            Built::Text(text) => Block::Text { text },
            Built::Thinking(thinking) => Block::Thinking {
                thinking,
                signature: String::new(),
            },
            Built::ToolUse {
                id,
                name,
                arguments,
            } => Block::ToolUse {
                id: tool_use_id(&id),
                name,
                input: input(&arguments),
            },
        })
        .collect()
}

#[derive(Serialize)]
struct MessageBody<'a> {
    id: String,
    #[serde(rename = "type")]
    kind: &'static str,
    role: &'static str,
    model: &'a str,
    content: Vec<Block>,
    stop_reason: &'static str,
    stop_sequence: Option<&'a str>,
    usage: Value,
}

/// The whole non-streamed `message` object, as JSON text.
pub fn message(ctx: &RequestContext, update: &GenerationUpdate) -> String {
    let stop_sequence = stop_sequence(update);
    let body = MessageBody {
        id: message_id(ctx),
        kind: "message",
        role: "assistant",
        model: &ctx.model_id,
        content: blocks(&update.events),
        stop_reason: stop_reason(update.finish, stop_sequence),
        stop_sequence,
        usage: usage(update.usage.as_ref(), true),
    };
    serde_json::to_string(&body).expect("serializable")
}

/// A stream's state across `render-stream` calls (one request).
#[derive(Debug, Default)]
pub struct Stream {
    started: bool,
    blocks: Blocks,
}

fn step_event(step: Step) -> (&'static str, Value) {
    match step {
        Step::Start(index, start) => {
            let block = match start {
                Start::Text => json!({"type": "text", "text": ""}),
                Start::Thinking => json!({"type": "thinking", "thinking": "", "signature": ""}),
                Start::ToolUse { id, name } => {
                    json!({"type": "tool_use", "id": tool_use_id(&id), "name": name, "input": {}})
                }
            };
            (
                "content_block_start",
                json!({"type": "content_block_start", "index": index, "content_block": block}),
            )
        }
        Step::Delta(index, delta) => {
            let delta = match delta {
                Delta::Text(text) => json!({"type": "text_delta", "text": text}),
                Delta::Thinking(thinking) => {
                    json!({"type": "thinking_delta", "thinking": thinking})
                }
                Delta::Json(partial_json) => {
                    json!({"type": "input_json_delta", "partial_json": partial_json})
                }
            };
            (
                "content_block_delta",
                json!({"type": "content_block_delta", "index": index, "delta": delta}),
            )
        }
        Step::Stop(index) => (
            "content_block_stop",
            json!({"type": "content_block_stop", "index": index}),
        ),
    }
}

/// The events of one streamed update, as (event name, data): on the first
/// update `message_start` (its usage from the update when the host sends
/// it there, else zeros: see docs/anthropic.md) and `ping`; the update's
/// block steps; on the last update the open block's stop, `message_delta`
/// (stop reason, matched stop sequence, cumulative usage) and
/// `message_stop`.
pub fn stream_events(
    ctx: &RequestContext,
    state: &mut Stream,
    update: &GenerationUpdate,
) -> Vec<(&'static str, String)> {
    let mut out: Vec<(&'static str, Value)> = Vec::new();
    if !state.started {
        state.started = true;
        out.push((
            "message_start",
            json!({"type": "message_start", "message": {
                "id": message_id(ctx),
                "type": "message",
                "role": "assistant",
                "model": ctx.model_id,
                "content": [],
                "stop_reason": null,
                "stop_sequence": null,
                "usage": usage(update.usage.as_ref(), false),
            }}),
        ));
        out.push(("ping", json!({"type": "ping"})));
    }
    let mut steps = Vec::new();
    state.blocks.feed(&update.events, &mut steps);
    if update.finish.is_some() {
        state.blocks.finish(&mut steps);
    }
    out.extend(steps.into_iter().map(step_event));
    if update.finish.is_some() {
        let stop_sequence = stop_sequence(update);
        out.push((
            "message_delta",
            json!({
                "type": "message_delta",
                "delta": {
                    "stop_reason": stop_reason(update.finish, stop_sequence),
                    "stop_sequence": stop_sequence,
                },
                "usage": usage(update.usage.as_ref(), true),
            }),
        ));
        out.push(("message_stop", json!({"type": "message_stop"})));
    }
    out.into_iter()
        .map(|(name, data)| (name, data.to_string()))
        .collect()
}

/// Anthropic's error `type` for a status (the host's kind when the status
/// has no type of its own).
pub fn error_type(e: &ApiError) -> &'static str {
    match e.status {
        400 => "invalid_request_error",
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 | 529 => "overloaded_error",
        500..=599 => "api_error",
        _ => match e.kind {
            ErrorKind::InvalidRequest => "invalid_request_error",
            ErrorKind::NotFound => "not_found_error",
            ErrorKind::TooLarge => "request_too_large",
            ErrorKind::Plugin | ErrorKind::Server => "api_error",
        },
    }
}

/// An Anthropic error body: `{"type": "error", "error": {"type",
/// "message"}, "request_id"}`. Anthropic has no `param`: the field leads
/// the message (`"tool_choice.name: ..."`), named as in this dialect.
pub fn error(ctx: &RequestContext, e: &ApiError) -> Value {
    let message = match e.param.as_deref() {
        Some(p) => {
            // The host names the canonical field; this dialect spells it so.
            let p = if p == "stop" { "stop_sequences" } else { p };
            if e.message.starts_with(&format!("{p}: ")) {
                e.message.clone()
            } else {
                format!("{p}: {}", e.message)
            }
        }
        None => e.message.clone(),
    };
    json!({
        "type": "error",
        "error": { "type": error_type(e), "message": message },
        "request_id": ctx.request_id,
    })
}
