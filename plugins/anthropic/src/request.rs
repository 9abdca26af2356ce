//! `POST /v1/messages` request body -> canonical generation request
//! (`mlxhost:plugin@0.2.0`, interface `request`).
//!
//! Field names, types and ranges follow Anthropic's Messages API reference
//! ("Create a Message"). Every rejection names the field at fault, with the
//! path spelled `messages[2].content[0].tool_use_id`; Anthropic's error
//! bodies have no `param` key, so the path leads the message
//! (`"messages[2].content[0]: ..."`, as Anthropic writes `messages.2...`).
//!
//! Conversation mapping:
//! - `system` (a string or text blocks) -> the first message, role `system`;
//!   a `role: "system"` message inside `messages` (Claude Code sends one
//!   mid-conversation) -> a system message in place;
//! - `text` blocks -> text parts; `image` blocks -> 400 (text-only model);
//! - assistant `tool_use` blocks -> the message's `tool-calls` (arguments =
//!   the JSON text of `input`); `thinking` -> its `reasoning`;
//!   `redacted_thinking` is dropped;
//! - user `tool_result` blocks -> one `tool` message each (`tool-call-id` =
//!   `tool_use_id`, content text, `Error: ` first when `is_error`); the
//!   user's text blocks follow as a user message;
//! - every other block type (`document`, `search_result`, server tool
//!   blocks, ...) -> 400 naming the type.
//!
//! Structured output: `output_config.format` (`{"type": "json_schema",
//! "schema"}`), or the beta's top-level `output_format` of the same shape,
//! becomes an output constraint ([`parse_with_constraint`]) that `handle`
//! hands to the host's `structured-output` service (WIT 0.3.0).
//!
//! Ignored fields (accepted, no effect): `metadata`, `thinking`,
//! `context_management`, `output_config` other than `format` (`effort`), `service_tier`, `container`,
//! `mcp_servers` and every field this adapter does not know; `cache_control`
//! and `citations` inside blocks; server tools (a `tools[]` entry whose
//! `type` is not `custom`, e.g. `web_search_20250305`, `bash_20250124`).
//!
//! mlxhost extension fields (not in Anthropic's API; as the `openai`
//! adapter): `sampler`, `logits_processors`, `plugin_params`,
//! `tool_parser`, `reasoning_parser` (a plugin name or `"none"`), and
//! `chat_template_kwargs` (an object of extra chat template variables).

use std::collections::HashSet;

use mlxhost_plugin_sdk::structured::{self, OutputConstraint};

use mlxhost_plugin_sdk::fields::valid_tool_name;
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::request::{
    ContentPart, GenerationRequest, Message, Prompt, SamplingRequest, ToolCall, ToolChoice,
};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::types::ToolDefinition;
use serde_json::{Map, Value};

/// A rejected request: the field at fault and the whole message
/// (`"<param>: <why>"`).
#[derive(Debug)]
pub struct Invalid {
    pub message: String,
    pub param: Option<String>,
}

fn invalid(param: &str, why: impl AsRef<str>) -> Invalid {
    Invalid {
        message: format!("{param}: {}", why.as_ref()),
        param: Some(param.to_string()),
    }
}

fn body_error(why: impl Into<String>) -> Invalid {
    Invalid {
        message: why.into(),
        param: None,
    }
}

/// How the request's text reaches the prompt.
#[derive(Debug, Clone, Copy, Default)]
pub struct Normalize {
    /// Keep client metadata blocks in `system` verbatim (the host's
    /// `--keep-prompt-metadata`, or the request's `x-mlxhost-keep-metadata:
    /// true` header); by default they are dropped (see [`is_client_metadata`]).
    pub keep_metadata: bool,
}

/// Parses and validates a `/v1/messages` body.
#[cfg(test)]
pub fn parse(body: &[u8], norm: Normalize) -> Result<GenerationRequest, Invalid> {
    parse_with_constraint(body, norm).map(|(g, _)| g)
}

/// [`parse`], with the output constraint `output_config.format` (or
/// `output_format`) asks for.
pub fn parse_with_constraint(
    body: &[u8],
    norm: Normalize,
) -> Result<(GenerationRequest, Option<OutputConstraint>), Invalid> {
    let g = parse_body(body, false, norm)?;
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| body_error(format!("the request body is not valid JSON: {e}")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| body_error("the request body must be a JSON object"))?;
    let c = structured::anthropic_output_format(obj).map_err(|e| Invalid {
        message: match &e.param {
            Some(p) => format!("{p}: {}", e.message),
            None => e.message,
        },
        param: e.param,
    })?;
    Ok((g, c))
}

/// Parses and validates a `/v1/messages/count_tokens` body: the same
/// fields, with `max_tokens` optional (Anthropic's count_tokens takes none).
pub fn parse_count(body: &[u8], norm: Normalize) -> Result<GenerationRequest, Invalid> {
    parse_body(body, true, norm)
}

/// Whether a `system` text block is client metadata rather than an
/// instruction to the model: Claude Code's attribution block
/// `x-anthropic-billing-header: cc_version=2.1.197.3af; cc_entrypoint=sdk-cli;`.
/// Its 3-hex suffix changes with every session and it comes first, so kept
/// in the prompt it defeats prefix reuse of everything after it (the whole
/// ~19k-token system prompt) across sessions, subagents and side requests.
/// Anthropic's API strips it server-side before the model sees it.
pub fn is_client_metadata(text: &str) -> bool {
    let t = text.trim();
    t.starts_with("x-anthropic-billing-header:") && !t.contains('\n')
}

fn parse_body(body: &[u8], counting: bool, norm: Normalize) -> Result<GenerationRequest, Invalid> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| body_error(format!("the request body is not valid JSON: {e}")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| body_error("the request body must be a JSON object"))?;
    let f = Fields(obj);
    // Required by Anthropic; any model name is served by the loaded model.
    f.string("model")?;
    let max_tokens = match f.get("max_tokens") {
        None if counting => None,
        None => return Err(invalid("max_tokens", "field required (an integer >= 1)")),
        Some(_) => match f.uint("max_tokens")? {
            Some(0) => return Err(invalid("max_tokens", "must be at least 1")),
            n => n,
        },
    };
    let mut messages = parse_system(obj.get("system"), norm)?;
    messages.extend(parse_messages(obj.get("messages"))?);
    let stream = f.bool("stream")?.unwrap_or(false);
    let sampling = SamplingRequest {
        temperature: f.ranged("temperature", 0.0, 1.0)?,
        top_p: f.ranged("top_p", 0.0, 1.0)?,
        top_k: f.uint("top_k")?,
        min_p: None,
        xtc_probability: None,
        xtc_threshold: None,
        seed: None,
        repetition_penalty: None,
        repetition_context_size: None,
        presence_penalty: None,
        frequency_penalty: None,
        logit_bias: Vec::new(),
    };
    let stop = match f.get("stop_sequences") {
        None => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(k, v)| match v {
                Value::String(s) if !s.is_empty() => Ok(s.clone()),
                Value::String(_) => Err(invalid(
                    &format!("stop_sequences[{k}]"),
                    "stop sequences must not be empty",
                )),
                _ => Err(invalid(&format!("stop_sequences[{k}]"), "must be a string")),
            })
            .collect::<Result<_, _>>()?,
        Some(_) => return Err(invalid("stop_sequences", "must be an array of strings")),
    };
    let tools = parse_tools(obj.get("tools"))?;
    let (tool_choice, parallel_tool_calls) = parse_tool_choice(obj.get("tool_choice"), &tools)?;
    let sampler = f.non_empty_string("sampler")?;
    let logits_processors = match f.get("logits_processors") {
        None => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str()
                    .map(str::to_string)
                    .ok_or_else(|| invalid("logits_processors", "must be an array of plugin names"))
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(invalid(
                "logits_processors",
                "must be an array of plugin names",
            ))
        }
    };
    let plugin_params = match f.get("plugin_params") {
        None => "{}".to_string(),
        Some(v @ Value::Object(m)) => {
            if let Some((k, _)) = m.iter().find(|(_, v)| !v.is_object()) {
                return Err(invalid(
                    &format!("plugin_params.{k}"),
                    "must be an object of that plugin's parameters",
                ));
            }
            v.to_string()
        }
        Some(_) => {
            return Err(invalid(
                "plugin_params",
                "must be an object keyed by plugin name",
            ))
        }
    };
    let tool_parser = f.non_empty_string("tool_parser")?;
    let reasoning_parser = f.non_empty_string("reasoning_parser")?;
    let chat_template_kwargs = match f.get("chat_template_kwargs") {
        None => "{}".to_string(),
        Some(v @ Value::Object(_)) => v.to_string(),
        Some(_) => {
            return Err(invalid(
                "chat_template_kwargs",
                "must be an object of chat template variables",
            ))
        }
    };
    Ok(GenerationRequest {
        prompt: Prompt::Messages(messages),
        sampling,
        max_tokens,
        // Anthropic clients send large fixed `max_tokens` (Claude Code:
        // 32000): an upper bound, not a demand the context must fit.
        clamp_max_tokens: true,
        stop,
        stream,
        logprobs: false,
        top_logprobs: 0,
        tools,
        tool_choice,
        parallel_tool_calls,
        tool_parser,
        reasoning_parser,
        chat_template_kwargs,
        sampler,
        logits_processors,
        plugin_params,
        // Usage is always rendered (`usage`, `message_delta.usage`).
        include_usage: true,
        previous_response_id: None,
    })
}

/// Typed access to optional fields; `null` counts as absent.
struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }
    fn string(&self, key: &str) -> Result<Option<String>, Invalid> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(invalid(key, "must be a string")),
        }
    }
    fn non_empty_string(&self, key: &str) -> Result<Option<String>, Invalid> {
        match self.string(key)? {
            Some(s) if s.is_empty() => Err(invalid(key, "must not be empty")),
            s => Ok(s),
        }
    }
    fn bool(&self, key: &str) -> Result<Option<bool>, Invalid> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(invalid(key, "must be a boolean")),
        }
    }
    fn ranged(&self, key: &str, lo: f64, hi: f64) -> Result<Option<f32>, Invalid> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => match n.as_f64() {
                Some(x) if (lo..=hi).contains(&x) => Ok(Some(x as f32)),
                _ => Err(invalid(
                    key,
                    format!("must be a number in [{lo}, {hi}], got {n}"),
                )),
            },
            Some(_) => Err(invalid(key, format!("must be a number in [{lo}, {hi}]"))),
        }
    }
    fn uint(&self, key: &str) -> Result<Option<u32>, Invalid> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => match n.as_u64() {
                Some(x) => u32::try_from(x)
                    .map(Some)
                    .map_err(|_| invalid(key, format!("must be below 2^32, got {x}"))),
                None => Err(invalid(
                    key,
                    format!("must be a non-negative integer, got {n}"),
                )),
            },
            Some(_) => Err(invalid(key, "must be a non-negative integer")),
        }
    }
}

fn text_message(role: &str, content: Vec<ContentPart>) -> Message {
    Message {
        role: role.into(),
        content,
        name: None,
        tool_calls: Vec::new(),
        tool_call_id: None,
        reasoning: None,
    }
}

/// The type of block `b` (an object with a string `type`), or the error
/// naming `at`.
fn block_type<'a>(b: &'a Value, at: &str) -> Result<(&'a Map<String, Value>, &'a str), Invalid> {
    let o = b
        .as_object()
        .ok_or_else(|| invalid(at, "must be a content block object"))?;
    match o.get("type") {
        Some(Value::String(t)) => Ok((o, t.as_str())),
        Some(_) => Err(invalid(&format!("{at}.type"), "must be a string")),
        None => Err(invalid(&format!("{at}.type"), "field required")),
    }
}

/// A `text` block's text.
fn block_text(o: &Map<String, Value>, at: &str) -> Result<String, Invalid> {
    match o.get("text") {
        Some(Value::String(t)) => Ok(t.clone()),
        Some(_) => Err(invalid(&format!("{at}.text"), "must be a string")),
        None => Err(invalid(&format!("{at}.text"), "field required")),
    }
}

fn image_rejected(at: &str) -> Invalid {
    invalid(
        at,
        "image content is not supported: this model takes text only",
    )
}

fn unsupported_block(at: &str, t: &str, role: &str) -> Invalid {
    let why = match t {
        "tool_use" | "thinking" | "redacted_thinking" => {
            format!("`{t}` blocks are only allowed in assistant messages, not {role}")
        }
        "tool_result" => {
            format!("`tool_result` blocks are only allowed in user messages, not {role}")
        }
        _ => format!("content block type `{t}` is not supported by this server"),
    };
    invalid(&format!("{at}.type"), why)
}

/// Text-only content (`system`, system messages, tool results): a string,
/// or `text` blocks (images rejected, other types named).
fn text_blocks(value: &Value, at: &str, role: &str) -> Result<Vec<ContentPart>, Invalid> {
    match value {
        Value::String(s) => Ok(vec![ContentPart::Text(s.clone())]),
        Value::Array(blocks) => blocks
            .iter()
            .enumerate()
            .map(|(k, b)| {
                let at = format!("{at}[{k}]");
                match block_type(b, &at)? {
                    (o, "text") => Ok(ContentPart::Text(block_text(o, &at)?)),
                    (_, "image") => Err(image_rejected(&at)),
                    (_, t) => Err(unsupported_block(&at, t, role)),
                }
            })
            .collect(),
        _ => Err(invalid(at, "must be a string or an array of text blocks")),
    }
}

/// `system`: a string or `[{"type": "text", "text"}]` -> the first message,
/// less client metadata blocks unless `norm.keep_metadata`.
fn parse_system(value: Option<&Value>, norm: Normalize) -> Result<Vec<Message>, Invalid> {
    let mut parts = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(v) => text_blocks(v, "system", "system")?,
    };
    if !norm.keep_metadata {
        parts.retain(|p| !matches!(p, ContentPart::Text(t) if is_client_metadata(t)));
    }
    let empty = parts
        .iter()
        .all(|p| matches!(p, ContentPart::Text(t) if t.is_empty()));
    Ok(if empty {
        Vec::new()
    } else {
        vec![text_message("system", parts)]
    })
}

fn parse_messages(value: Option<&Value>) -> Result<Vec<Message>, Invalid> {
    let items = match value {
        None | Some(Value::Null) => return Err(invalid("messages", "field required")),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(invalid("messages", "must be an array of messages")),
    };
    if items.is_empty() {
        return Err(invalid("messages", "must contain at least one message"));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        parse_message(i, m, &mut out)?;
    }
    Ok(out)
}

/// One Anthropic message -> one or more canonical messages, appended to `out`.
fn parse_message(i: usize, m: &Value, out: &mut Vec<Message>) -> Result<(), Invalid> {
    let here = format!("messages[{i}]");
    let at = |field: &str| format!("{here}.{field}");
    let m = m
        .as_object()
        .ok_or_else(|| invalid(&here, "must be a message object"))?;
    let role = match m.get("role") {
        Some(Value::String(r)) => r.as_str(),
        Some(_) => return Err(invalid(&at("role"), "must be a string")),
        None => return Err(invalid(&at("role"), "field required")),
    };
    if !matches!(role, "user" | "assistant" | "system") {
        return Err(invalid(
            &at("role"),
            format!("unknown role `{role}`: expected user or assistant (or system)"),
        ));
    }
    let content_at = at("content");
    let content = match m.get("content") {
        None | Some(Value::Null) => return Err(invalid(&content_at, "field required")),
        Some(c @ (Value::String(_) | Value::Array(_))) => c,
        Some(_) => {
            return Err(invalid(
                &content_at,
                "must be a string or an array of content blocks",
            ))
        }
    };
    let empty = match content {
        Value::String(s) => s.is_empty(),
        Value::Array(a) => a.is_empty(),
        _ => false,
    };
    if role == "user" && empty {
        return Err(invalid(&content_at, "user messages must not be empty"));
    }
    match role {
        "system" => out.push(text_message(
            "system",
            text_blocks(content, &content_at, role)?,
        )),
        "user" => user_message(content, &content_at, out)?,
        _ => out.push(assistant_message(content, &content_at)?),
    }
    Ok(())
}

/// A user turn: its `tool_result` blocks become `tool` messages, in order,
/// followed by one user message with its text blocks (when it has any).
fn user_message(content: &Value, at: &str, out: &mut Vec<Message>) -> Result<(), Invalid> {
    let blocks = match content {
        Value::String(s) => {
            out.push(text_message("user", vec![ContentPart::Text(s.clone())]));
            return Ok(());
        }
        Value::Array(blocks) => blocks,
        _ => unreachable!("checked by the caller"),
    };
    let mut text = Vec::new();
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{at}[{j}]");
        match block_type(b, &at)? {
            (o, "text") => text.push(ContentPart::Text(block_text(o, &at)?)),
            (_, "image") => return Err(image_rejected(&at)),
            (o, "tool_result") => out.push(tool_result(o, &at)?),
            (_, t) => return Err(unsupported_block(&at, t, "user")),
        }
    }
    if !text.is_empty() {
        out.push(text_message("user", text));
    }
    Ok(())
}

/// `{"type": "tool_result", "tool_use_id", "content"?, "is_error"?}` -> a
/// `tool` message.
fn tool_result(o: &Map<String, Value>, at: &str) -> Result<Message, Invalid> {
    let id = match o.get("tool_use_id") {
        Some(Value::String(id)) if !id.is_empty() => id.clone(),
        Some(Value::String(_)) => {
            return Err(invalid(&format!("{at}.tool_use_id"), "must not be empty"))
        }
        Some(_) => return Err(invalid(&format!("{at}.tool_use_id"), "must be a string")),
        None => return Err(invalid(&format!("{at}.tool_use_id"), "field required")),
    };
    let is_error = match o.get("is_error") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(invalid(&format!("{at}.is_error"), "must be a boolean")),
    };
    let mut content = match o.get("content") {
        None | Some(Value::Null) => Vec::new(),
        Some(c) => text_blocks(c, &format!("{at}.content"), "tool_result")?,
    };
    if is_error {
        content.insert(0, ContentPart::Text("Error: ".into()));
    }
    Ok(Message {
        role: "tool".into(),
        content,
        name: None,
        tool_calls: Vec::new(),
        tool_call_id: Some(id),
        reasoning: None,
    })
}

/// An assistant turn: text, `tool_use` (-> tool calls), `thinking` (->
/// reasoning), `redacted_thinking` (dropped).
fn assistant_message(content: &Value, at: &str) -> Result<Message, Invalid> {
    let blocks = match content {
        Value::String(s) => {
            return Ok(text_message(
                "assistant",
                vec![ContentPart::Text(s.clone())],
            ))
        }
        Value::Array(blocks) => blocks,
        _ => unreachable!("checked by the caller"),
    };
    let mut m = text_message("assistant", Vec::new());
    for (j, b) in blocks.iter().enumerate() {
        let at = format!("{at}[{j}]");
        match block_type(b, &at)? {
            (o, "text") => m.content.push(ContentPart::Text(block_text(o, &at)?)),
            (o, "tool_use") => m.tool_calls.push(tool_use(o, &at)?),
            (o, "thinking") => {
                let thinking = match o.get("thinking") {
                    Some(Value::String(t)) => t,
                    Some(_) => return Err(invalid(&format!("{at}.thinking"), "must be a string")),
                    None => return Err(invalid(&format!("{at}.thinking"), "field required")),
                };
                match &mut m.reasoning {
                    Some(r) => {
                        r.push('\n');
                        r.push_str(thinking);
                    }
                    None => m.reasoning = Some(thinking.clone()),
                }
            }
            (_, "redacted_thinking") => {}
            (_, "image") => return Err(image_rejected(&at)),
            (_, t) => return Err(unsupported_block(&at, t, "assistant")),
        }
    }
    Ok(m)
}

/// `{"type": "tool_use", "id", "name", "input": {...}}` -> a tool call.
fn tool_use(o: &Map<String, Value>, at: &str) -> Result<ToolCall, Invalid> {
    let string = |key: &str| match o.get(key) {
        Some(Value::String(s)) if !s.is_empty() => Ok(s.clone()),
        Some(Value::String(_)) => Err(invalid(&format!("{at}.{key}"), "must not be empty")),
        Some(_) => Err(invalid(&format!("{at}.{key}"), "must be a string")),
        None => Err(invalid(&format!("{at}.{key}"), "field required")),
    };
    let id = string("id")?;
    let name = string("name")?;
    let arguments = match o.get("input") {
        Some(v @ Value::Object(_)) => v.to_string(),
        Some(_) => return Err(invalid(&format!("{at}.input"), "must be an object")),
        None => return Err(invalid(&format!("{at}.input"), "field required")),
    };
    Ok(ToolCall {
        id,
        name,
        arguments,
    })
}

/// The longest tool name Anthropic's Messages API accepts (its rule is
/// `^[a-zA-Z0-9_-]{1,128}$`; MCP tools such as `mcp__server__tool` run long).
const MAX_TOOL_NAME_LEN: usize = 128;

/// `tools: [{"name", "description"?, "input_schema", "type"?: "custom"}]`.
/// Entries with another `type` are Anthropic's server tools (web search,
/// bash, text editor, ...): this server runs none, so they are left out.
fn parse_tools(value: Option<&Value>) -> Result<Vec<ToolDefinition>, Invalid> {
    let items = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(invalid("tools", "must be an array of tools")),
    };
    let mut names = HashSet::new();
    let mut out = Vec::with_capacity(items.len());
    for (i, t) in items.iter().enumerate() {
        let here = format!("tools[{i}]");
        let at = |field: &str| format!("{here}.{field}");
        let t = t
            .as_object()
            .ok_or_else(|| invalid(&here, "must be a tool object"))?;
        match t.get("type") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) if s == "custom" => {}
            Some(Value::String(_)) => continue,
            Some(_) => return Err(invalid(&at("type"), "must be a string")),
        }
        let name = match t.get("name") {
            Some(Value::String(n)) if !n.is_empty() => n,
            Some(Value::String(_)) => return Err(invalid(&at("name"), "must not be empty")),
            Some(_) => return Err(invalid(&at("name"), "must be a string")),
            None => return Err(invalid(&at("name"), "field required")),
        };
        if !valid_tool_name(name, MAX_TOOL_NAME_LEN) {
            return Err(invalid(
                &at("name"),
                format!(
                    "must match ^[a-zA-Z0-9_-]{{1,{MAX_TOOL_NAME_LEN}}}$ (letters, digits, `_`, `-`), got {name:?}"
                ),
            ));
        }
        if !names.insert(name.clone()) {
            return Err(invalid(
                &at("name"),
                format!("tool names must be unique: `{name}` is given twice"),
            ));
        }
        let description = match t.get("description") {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(d)) => d.clone(),
            Some(_) => return Err(invalid(&at("description"), "must be a string")),
        };
        let parameters_json = match t.get("input_schema") {
            Some(v @ Value::Object(_)) => v.to_string(),
            Some(_) => {
                return Err(invalid(
                    &at("input_schema"),
                    "must be an object (a JSON Schema)",
                ))
            }
            None => return Err(invalid(&at("input_schema"), "field required")),
        };
        out.push(ToolDefinition {
            name: name.clone(),
            parameters_json,
            description,
        });
    }
    Ok(out)
}

/// `tool_choice: {"type": "auto" | "any" | "tool" | "none", "name"?,
/// "disable_parallel_tool_use"?}` -> (choice, parallel tool calls).
/// Default: auto with tools, none without.
fn parse_tool_choice(
    value: Option<&Value>,
    tools: &[ToolDefinition],
) -> Result<(ToolChoice, bool), Invalid> {
    let o = match value {
        None | Some(Value::Null) => {
            let choice = if tools.is_empty() {
                ToolChoice::None
            } else {
                ToolChoice::Auto
            };
            return Ok((choice, true));
        }
        Some(Value::Object(o)) => o,
        Some(_) => {
            return Err(invalid(
                "tool_choice",
                "must be an object: {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}",
            ))
        }
    };
    let parallel = match o.get("disable_parallel_tool_use") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => !b,
        Some(_) => {
            return Err(invalid(
                "tool_choice.disable_parallel_tool_use",
                "must be a boolean",
            ))
        }
    };
    let kind = match o.get("type") {
        Some(Value::String(t)) => t.as_str(),
        Some(_) => return Err(invalid("tool_choice.type", "must be a string")),
        None => return Err(invalid("tool_choice.type", "field required")),
    };
    let choice = match kind {
        "auto" if tools.is_empty() => ToolChoice::None,
        "auto" => ToolChoice::Auto,
        "none" => ToolChoice::None,
        "any" if tools.is_empty() => {
            return Err(invalid("tool_choice", "`any` needs `tools` (custom tools)"))
        }
        "any" => ToolChoice::Required,
        "tool" => {
            let name = match o.get("name") {
                Some(Value::String(n)) => n,
                Some(_) => return Err(invalid("tool_choice.name", "must be a string")),
                None => {
                    return Err(invalid(
                        "tool_choice.name",
                        "field required for type `tool`",
                    ))
                }
            };
            if !tools.iter().any(|t| &t.name == name) {
                return Err(invalid(
                    "tool_choice.name",
                    format!("names tool `{name}`, which is not among the request's custom `tools`"),
                ));
            }
            ToolChoice::Named(name.clone())
        }
        other => {
            return Err(invalid(
                "tool_choice.type",
                format!("unknown type `{other}`: expected auto, any, tool or none"),
            ))
        }
    };
    Ok((choice, parallel))
}

/// The names of the request's tools with `strict: true`, which `handle`
/// hands to the host (WIT 0.3.0 `strict-tools`: enforced when the reply
/// must be a call).
pub fn strict_tool_names(body: &[u8]) -> Vec<String> {
    let Ok(Value::Object(obj)) = serde_json::from_slice::<Value>(body) else {
        return Vec::new();
    };
    let Some(Value::Array(tools)) = obj.get("tools") else {
        return Vec::new();
    };
    tools
        .iter()
        .filter(|t| t.get("strict") == Some(&Value::Bool(true)))
        .filter_map(|t| t.get("name").and_then(Value::as_str).map(str::to_string))
        .collect()
}
