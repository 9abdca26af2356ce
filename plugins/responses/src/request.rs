//! `POST /v1/responses` body -> canonical generation request
//! (`mlxhost:plugin@0.2.0`, interface `request`), following OpenAI's API
//! reference ("Create a model response"). Every rejection names the field
//! (`input[2].content[0].type`).
//!
//! Input items -> conversation:
//! - `input` as a string -> one user message;
//! - `message` items (or objects with a `role` and no `type`): roles
//!   `user`, `assistant`, `system`, `developer` (-> `system`); content a
//!   string or parts `input_text` / `output_text` / `text` / `refusal`;
//!   `input_image` -> 400 (text-only model), `input_file` / `input_audio`
//!   -> 400;
//! - `function_call` -> a tool call of the assistant turn (consecutive
//!   calls, and a call right after an assistant message, join that turn);
//!   `function_call_output` -> a `tool` message; `custom_tool_call` /
//!   `_output` likewise (arguments `{"input": ...}`);
//! - `reasoning` -> the reasoning of the next assistant turn (its
//!   `content` texts, else its `summary` texts; `encrypted_content` is
//!   ignored);
//! - any other item type -> 400 naming it.
//!
//! `instructions` -> a system message first (not carried to a response
//! that continues this one, as OpenAI specifies); `previous_response_id`
//! -> the stored conversation (its input and output) first.
//!
//! Tools: `function` tools (flat: `name`, `description`, `parameters`,
//! `strict`); every other tool type (`web_search`, `namespace`, `custom`,
//! `file_search`, `mcp`, ...) is ignored: this server runs none of them.

use std::collections::HashSet;

use mlxhost_plugin_sdk::fields::{
    extensions, invalid, object, valid_function_name, Fields, Invalid,
};
use mlxhost_plugin_sdk::structured;
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::request::{
    ContentPart, GenerationRequest, Message, Prompt, SamplingRequest, ToolCall, ToolChoice,
};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::types::ToolDefinition;
use serde_json::{json, Map, Value};

/// What `render` echoes back and what the adapter does after generating.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Keep the response for `GET` and `previous_response_id`.
    pub store: bool,
    /// Render reasoning as `summary_text` parts too (`reasoning.summary`).
    pub reasoning_summary: bool,
    /// The echoed request fields of the `response` object (`instructions`,
    /// `max_output_tokens`, `tools`, ...), in OpenAI's order.
    pub echo: Map<String, Value>,
    /// The conversation this response answers, without `instructions`:
    /// the previous response's (when continued) and this request's input.
    pub conversation: Vec<Message>,
    /// This request's input items, normalized (`GET .../input_items`).
    pub input_items: Vec<Value>,
    /// `text.format` `json_schema` / `json_object`: the output constraint
    /// `handle` hands to the host (structured output).
    pub constraint: Option<structured::OutputConstraint>,
}

/// Parses a `/v1/responses` (or `/v1/responses/input_tokens`) body.
/// `previous` resolves `previous_response_id` to its stored conversation.
///
/// Errors: a 400 naming the field, or a 404 (`previous_response_not_found`)
/// for an unknown or expired `previous_response_id`.
///
/// `counting` (`/v1/responses/input_tokens`): `instructions` alone are a
/// prompt to count; a generation needs `input`.
pub fn parse(
    body: &[u8],
    previous: &dyn Fn(&str) -> Option<Vec<Message>>,
    counting: bool,
) -> Result<(GenerationRequest, Options), Invalid> {
    let obj = object(body)?;
    let f = Fields::new(&obj, "");
    f.string("model")?;
    for (field, what) in [
        ("background", "background responses"),
        ("conversation", "conversations"),
        ("prompt", "prompt templates"),
    ] {
        let off = matches!(f.get(field), None | Some(Value::Bool(false)));
        if !off {
            return Err(invalid(
                field,
                format!("`{field}`: {what} are not supported by this server"),
            ));
        }
    }
    let previous_response_id = f.non_empty_string("previous_response_id")?;
    let mut conversation = Vec::new();
    if let Some(id) = &previous_response_id {
        match previous(id) {
            Some(messages) => conversation = messages,
            None => {
                return Err(Invalid {
                    status: 404,
                    message: format!("Previous response with id '{id}' not found."),
                    param: Some("previous_response_id".into()),
                    code: Some("previous_response_not_found"),
                })
            }
        }
    }
    let (input_messages, input_items) = parse_input(obj.get("input"))?;
    conversation.extend(input_messages);
    let instructions = f.string("instructions")?;
    let has_instructions = instructions.as_ref().is_some_and(|t| !t.is_empty());
    if conversation.is_empty() && !(counting && has_instructions) {
        return Err(invalid("input", "`input` must not be empty"));
    }
    let mut messages = Vec::new();
    if let Some(text) = instructions.as_ref().filter(|t| !t.is_empty()) {
        messages.push(text_message("system", text.clone()));
    }
    messages.extend(conversation.iter().cloned());

    let max_output_tokens = match f.uint("max_output_tokens")? {
        Some(0) => {
            return Err(invalid(
                "max_output_tokens",
                "`max_output_tokens` must be at least 1",
            ))
        }
        n => n,
    };
    let top_logprobs = match f.uint("top_logprobs")? {
        Some(n) if n > 20 => {
            return Err(invalid(
                "top_logprobs",
                format!("`top_logprobs` must be in [0, 20], got {n}"),
            ))
        }
        n => n.unwrap_or(0),
    };
    let include = f.strings("include")?;
    let logprobs = top_logprobs > 0 || include.iter().any(|i| i == "message.output_text.logprobs");
    let temperature = f.ranged("temperature", 0.0, 2.0)?;
    let top_p = f.ranged("top_p", 0.0, 1.0)?;
    let sampling = SamplingRequest {
        temperature,
        top_p,
        // Not OpenAI's; accepted as vLLM does.
        top_k: f.uint("top_k")?,
        min_p: f.ranged("min_p", 0.0, 1.0)?,
        xtc_probability: None,
        xtc_threshold: None,
        seed: f.seed("seed")?,
        repetition_penalty: None,
        repetition_context_size: None,
        presence_penalty: None,
        frequency_penalty: None,
        logit_bias: Vec::new(),
    };
    let (tools, tools_echo) = parse_tools(f.get("tools"))?;
    let (tool_choice, tool_choice_echo) = parse_tool_choice(f.get("tool_choice"), &tools)?;
    let parallel_tool_calls = f.bool("parallel_tool_calls")?.unwrap_or(true);
    let text = parse_text(f.get("text"))?;
    let constraint = structured::responses_text_format(f.get("text"))?;
    let reasoning = match f.object("reasoning")? {
        None => json!({"effort": null, "summary": null}),
        Some(r) => {
            let rf = Fields::new(r, "reasoning");
            let effort = rf.string("effort")?;
            let summary = rf.string("summary")?;
            if let Some(s) = &summary {
                if !matches!(s.as_str(), "auto" | "concise" | "detailed" | "none") {
                    return Err(invalid(
                        "reasoning.summary",
                        format!("`reasoning.summary` must be auto, concise, detailed or none, got {s:?}"),
                    ));
                }
            }
            json!({"effort": effort, "summary": summary})
        }
    };
    let reasoning_summary = reasoning["summary"].as_str().is_some_and(|s| s != "none");
    match f.string("truncation")?.as_deref() {
        None | Some("disabled") | Some("auto") => {}
        Some(t) => {
            return Err(invalid(
                "truncation",
                format!("`truncation` must be auto or disabled, got {t:?}"),
            ))
        }
    }
    let metadata = match f.object("metadata")? {
        None => json!({}),
        Some(m) => {
            check_metadata(m)?;
            Value::Object(m.clone())
        }
    };
    let stream = f.bool("stream")?.unwrap_or(false);
    let store = f.bool("store")?.unwrap_or(true);
    let ext = extensions(&f)?;

    let mut echo = Map::new();
    echo.insert("instructions".into(), json!(instructions));
    echo.insert("max_output_tokens".into(), json!(max_output_tokens));
    echo.insert("metadata".into(), metadata);
    echo.insert("parallel_tool_calls".into(), json!(parallel_tool_calls));
    echo.insert("previous_response_id".into(), json!(previous_response_id));
    echo.insert("reasoning".into(), reasoning);
    echo.insert("store".into(), json!(store));
    echo.insert("temperature".into(), json!(temperature.unwrap_or(1.0)));
    echo.insert("text".into(), text);
    echo.insert("tool_choice".into(), tool_choice_echo);
    echo.insert("tools".into(), Value::Array(tools_echo));
    echo.insert("top_logprobs".into(), json!(top_logprobs));
    echo.insert("top_p".into(), json!(top_p.unwrap_or(1.0)));
    echo.insert(
        "truncation".into(),
        json!(f.string("truncation")?.unwrap_or_else(|| "disabled".into())),
    );
    echo.insert("user".into(), json!(f.string("user")?));

    let request = GenerationRequest {
        prompt: Prompt::Messages(messages),
        sampling,
        max_tokens: max_output_tokens,
        // An upper bound ("the maximum number of output tokens"), as the
        // Anthropic adapter treats `max_tokens`.
        clamp_max_tokens: true,
        stop: Vec::new(),
        stream,
        logprobs,
        top_logprobs,
        tools,
        tool_choice,
        parallel_tool_calls,
        tool_parser: ext.tool_parser,
        reasoning_parser: ext.reasoning_parser,
        chat_template_kwargs: ext.chat_template_kwargs,
        sampler: ext.sampler,
        logits_processors: ext.logits_processors,
        plugin_params: ext.plugin_params,
        include_usage: true,
        previous_response_id: None,
    };
    let options = Options {
        store,
        reasoning_summary,
        echo,
        conversation,
        input_items,
        constraint,
    };
    Ok((request, options))
}

pub fn text_message(role: &str, text: String) -> Message {
    Message {
        role: role.into(),
        content: vec![ContentPart::Text(text)],
        name: None,
        tool_calls: Vec::new(),
        tool_call_id: None,
        reasoning: None,
    }
}

fn assistant(reasoning: Option<String>) -> Message {
    Message {
        role: "assistant".into(),
        content: Vec::new(),
        name: None,
        tool_calls: Vec::new(),
        tool_call_id: None,
        reasoning,
    }
}

/// The conversation being built from input items.
#[derive(Default)]
struct Builder {
    messages: Vec<Message>,
    /// Reasoning waiting for the assistant turn it belongs to.
    reasoning: Option<String>,
    /// The last message is an assistant turn that later calls may join.
    open_assistant: bool,
}

impl Builder {
    fn push(&mut self, m: Message) {
        self.open_assistant = m.role == "assistant";
        self.messages.push(m);
    }

    fn assistant_text(&mut self, content: Vec<ContentPart>) {
        let mut m = assistant(self.reasoning.take());
        m.content = content;
        self.push(m);
    }

    fn call(&mut self, call: ToolCall) {
        if !self.open_assistant || self.reasoning.is_some() {
            let m = assistant(self.reasoning.take());
            self.push(m);
        }
        if let Some(m) = self.messages.last_mut() {
            m.tool_calls.push(call);
        }
    }
}

/// `input` -> (messages, the items as given, normalized).
fn parse_input(value: Option<&Value>) -> Result<(Vec<Message>, Vec<Value>), Invalid> {
    let items = match value {
        None | Some(Value::Null) => return Ok((Vec::new(), Vec::new())),
        Some(Value::String(s)) => {
            let item = crate::items::normalize("message", &json!({"role": "user", "content": s}));
            return Ok((vec![text_message("user", s.clone())], vec![item]));
        }
        Some(Value::Array(items)) => items,
        Some(_) => {
            return Err(invalid(
                "input",
                "`input` must be a string or an array of input items",
            ))
        }
    };
    let mut b = Builder::default();
    let mut normalized = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = format!("input[{i}]");
        let o = item
            .as_object()
            .ok_or_else(|| invalid(&at, format!("`{at}` must be an object")))?;
        let f = Fields::new(o, &at);
        let kind = match f.string("type")? {
            Some(t) => t,
            None if o.contains_key("role") => "message".to_string(),
            None => return Err(invalid(&f.path("type"), format!("`{at}.type` is required"))),
        };
        match kind.as_str() {
            "message" => message_item(&f, &mut b)?,
            "function_call" => {
                let call_id = f.required_string("call_id")?;
                let name = f.required_string("name")?;
                let arguments = f.required_string("arguments")?;
                b.call(ToolCall {
                    id: call_id,
                    name,
                    arguments,
                });
            }
            "custom_tool_call" => {
                let call_id = f.required_string("call_id")?;
                let name = f.required_string("name")?;
                let input = f.required_string("input")?;
                b.call(ToolCall {
                    id: call_id,
                    name,
                    arguments: json!({ "input": input }).to_string(),
                });
            }
            "function_call_output" | "custom_tool_call_output" => {
                let call_id = f.required_string("call_id")?;
                let output = output_text(&f)?;
                b.push(Message {
                    role: "tool".into(),
                    content: vec![ContentPart::Text(output)],
                    name: None,
                    tool_calls: Vec::new(),
                    tool_call_id: Some(call_id),
                    reasoning: None,
                });
            }
            "reasoning" => {
                let text = reasoning_text(&f)?;
                if !text.is_empty() {
                    let pending = b.reasoning.get_or_insert_with(String::new);
                    if !pending.is_empty() {
                        pending.push('\n');
                    }
                    pending.push_str(&text);
                }
            }
            "item_reference" => {
                return Err(invalid(
                    &f.path("type"),
                    format!("`{at}.type`: `item_reference` items are not supported by this server; send the item itself"),
                ))
            }
            other => {
                return Err(invalid(
                    &f.path("type"),
                    format!("`{at}.type`: input item type `{other}` is not supported by this server"),
                ))
            }
        }
        normalized.push(crate::items::normalize(&kind, item));
    }
    Ok((b.messages, normalized))
}

fn message_item(f: &Fields, b: &mut Builder) -> Result<(), Invalid> {
    let role = f.required_string("role")?;
    let role = match role.as_str() {
        "user" | "assistant" | "system" => role,
        "developer" => "system".into(),
        other => {
            return Err(invalid(
                &f.path("role"),
                format!(
                    "`{}`: unknown role `{other}` (expected user, assistant, system or developer)",
                    f.path("role")
                ),
            ))
        }
    };
    let at = f.path("content");
    let content = match f.get("content") {
        None => return Err(invalid(&at, format!("`{at}` is required"))),
        Some(Value::String(s)) => vec![ContentPart::Text(s.clone())],
        Some(Value::Array(parts)) => {
            if parts.is_empty() && role != "assistant" {
                return Err(invalid(&at, format!("`{at}` must not be empty")));
            }
            parts
                .iter()
                .enumerate()
                .map(|(j, p)| content_part(p, &format!("{at}[{j}]")))
                .collect::<Result<_, _>>()?
        }
        Some(_) => {
            return Err(invalid(
                &at,
                format!("`{at}` must be a string or an array of content parts"),
            ))
        }
    };
    if role == "assistant" {
        b.assistant_text(content);
    } else {
        b.push(Message {
            role,
            content,
            name: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
            reasoning: None,
        });
    }
    Ok(())
}

fn content_part(p: &Value, at: &str) -> Result<ContentPart, Invalid> {
    let o = p
        .as_object()
        .ok_or_else(|| invalid(at, format!("`{at}` must be a content part object")))?;
    let f = Fields::new(o, at);
    let kind = f.required_string("type")?;
    match kind.as_str() {
        "input_text" | "output_text" | "text" => Ok(ContentPart::Text(f.required_string("text")?)),
        "refusal" => Ok(ContentPart::Text(f.required_string("refusal")?)),
        "input_image" => Err(invalid(
            at,
            format!("`{at}`: image input is not supported: this model takes text only"),
        )),
        other => Err(invalid(
            &f.path("type"),
            format!(
                "`{}`: content part type `{other}` is not supported by this server",
                f.path("type")
            ),
        )),
    }
}

/// A tool output: a string, or text parts (joined).
fn output_text(f: &Fields) -> Result<String, Invalid> {
    let at = f.path("output");
    match f.get("output") {
        None => Err(invalid(&at, format!("`{at}` is required"))),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                match content_part(p, &format!("{at}[{j}]"))? {
                    ContentPart::Text(t) => text.push_str(&t),
                    ContentPart::ImageUrl(_) => {}
                }
            }
            Ok(text)
        }
        Some(_) => Err(invalid(
            &at,
            format!("`{at}` must be a string or an array of content parts"),
        )),
    }
}

/// A reasoning item's text: its `content` texts, else its `summary` texts.
fn reasoning_text(f: &Fields) -> Result<String, Invalid> {
    let texts = |key: &str| -> Result<Vec<String>, Invalid> {
        let at = f.path(key);
        match f.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(parts)) => parts
                .iter()
                .enumerate()
                .map(|(j, p)| {
                    let here = format!("{at}[{j}]");
                    let o = p
                        .as_object()
                        .ok_or_else(|| invalid(&here, format!("`{here}` must be an object")))?;
                    Fields::new(o, &here).required_string("text")
                })
                .collect(),
            Some(_) => Err(invalid(&at, format!("`{at}` must be an array"))),
        }
    };
    let content = texts("content")?;
    let parts = if content.is_empty() {
        texts("summary")?
    } else {
        content
    };
    Ok(parts.join("\n"))
}

/// `tools` -> (function tools, the `tools` echoed in the response).
fn parse_tools(value: Option<&Value>) -> Result<(Vec<ToolDefinition>, Vec<Value>), Invalid> {
    let items = match value {
        None => return Ok((Vec::new(), Vec::new())),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(invalid("tools", "`tools` must be an array")),
    };
    let mut names = HashSet::new();
    let mut tools = Vec::new();
    let mut echo = Vec::new();
    for (i, t) in items.iter().enumerate() {
        let at = format!("tools[{i}]");
        let o = t
            .as_object()
            .ok_or_else(|| invalid(&at, format!("`{at}` must be an object")))?;
        let f = Fields::new(o, &at);
        if f.required_string("type")? != "function" {
            // A hosted or grouped tool (web_search, namespace, custom, ...):
            // this server runs none of them, so it is not offered.
            continue;
        }
        let name = f.required_string("name")?;
        if !valid_function_name(&name) {
            return Err(invalid(
                &f.path("name"),
                format!("`{at}.name` must match ^[a-zA-Z0-9_-]{{1,64}}$, got {name:?}"),
            ));
        }
        if !names.insert(name.clone()) {
            return Err(invalid(
                &f.path("name"),
                format!("`{at}.name`: duplicate function name `{name}` in `tools`"),
            ));
        }
        let description = f.string("description")?.unwrap_or_default();
        let parameters = f.object("parameters")?.cloned().unwrap_or_default();
        let strict = f.bool("strict")?;
        echo.push(json!({
            "type": "function",
            "name": name,
            "description": description,
            "parameters": parameters,
            "strict": strict.unwrap_or(true),
        }));
        tools.push(ToolDefinition {
            name,
            description,
            parameters_json: Value::Object(parameters).to_string(),
        });
    }
    Ok((tools, echo))
}

/// `metadata`: at most 16 pairs, keys up to 64 characters, string values up
/// to 512, as OpenAI limits it.
fn check_metadata(m: &Map<String, Value>) -> Result<(), Invalid> {
    if m.len() > 16 {
        return Err(invalid(
            "metadata",
            format!("`metadata` may hold at most 16 pairs, got {}", m.len()),
        ));
    }
    for (k, v) in m {
        if k.chars().count() > 64 {
            return Err(invalid(
                "metadata",
                format!("`metadata` keys may be at most 64 characters, `{k}` is longer"),
            ));
        }
        match v {
            Value::String(s) if s.chars().count() <= 512 => {}
            Value::String(_) => {
                return Err(invalid(
                    &format!("metadata.{k}"),
                    format!("`metadata.{k}` may be at most 512 characters"),
                ))
            }
            _ => {
                return Err(invalid(
                    &format!("metadata.{k}"),
                    format!("`metadata.{k}` must be a string"),
                ))
            }
        }
    }
    Ok(())
}

/// `tool_choice`: `"auto" | "none" | "required"`, `{"type": "function",
/// "name"}` or `{"type": "allowed_tools", "mode"}` (the mode applies to all
/// function tools). Default: auto with tools, none without.
fn parse_tool_choice(
    value: Option<&Value>,
    tools: &[ToolDefinition],
) -> Result<(ToolChoice, Value), Invalid> {
    const P: &str = "tool_choice";
    let shape = "`tool_choice` must be \"auto\", \"none\", \"required\", {\"type\": \"function\", \"name\": string} or {\"type\": \"allowed_tools\", \"mode\": ...}";
    let mode = |s: &str| match s {
        "auto" => Some(ToolChoice::Auto),
        "none" => Some(ToolChoice::None),
        "required" => Some(ToolChoice::Required),
        _ => None,
    };
    let (choice, echo) = match value {
        None | Some(Value::Null) => (ToolChoice::Auto, json!("auto")),
        Some(Value::String(s)) => match mode(s) {
            Some(c) => (c, json!(s)),
            None => return Err(invalid(P, format!("{shape}, got {s:?}"))),
        },
        Some(v @ Value::Object(o)) => match o.get("type").and_then(Value::as_str) {
            Some("function") => match o.get("name").and_then(Value::as_str) {
                Some(name) => (ToolChoice::Named(name.to_string()), v.clone()),
                None => {
                    return Err(invalid(
                        "tool_choice.name",
                        "`tool_choice.name` is required",
                    ))
                }
            },
            Some("allowed_tools") => match o.get("mode").and_then(Value::as_str).and_then(mode) {
                Some(c) => (c, v.clone()),
                None => {
                    return Err(invalid(
                        "tool_choice.mode",
                        "`tool_choice.mode` must be auto or required",
                    ))
                }
            },
            // A hosted tool (`web_search_preview`, `file_search`, `mcp`,
            // ...): `tools` of those types are ignored, so one cannot be
            // forced.
            Some(other) => {
                return Err(invalid(
                    "tool_choice.type",
                    format!("`tool_choice.type` `{other}`: this server runs no hosted tools; only function tools can be chosen"),
                ))
            }
            None => return Err(invalid(P, shape)),
        },
        Some(_) => return Err(invalid(P, shape)),
    };
    let choice = match choice {
        ToolChoice::Auto if tools.is_empty() => ToolChoice::None,
        ToolChoice::Required if tools.is_empty() => {
            return Err(invalid(
                P,
                "`tool_choice` \"required\" needs function `tools`",
            ))
        }
        ToolChoice::Named(name) if !tools.iter().any(|t| t.name == name) => {
            return Err(invalid(
                P,
                format!("`tool_choice` names function `{name}`, which is not in `tools`"),
            ))
        }
        c => c,
    };
    Ok((choice, echo))
}

/// `text`: `format` `{"type": "text"}` (the default), `json_object` or
/// `json_schema` (structured outputs, [`Options::constraint`]);
/// `verbosity` is accepted and ignored. Returns the echoed `text`.
fn parse_text(value: Option<&Value>) -> Result<Value, Invalid> {
    let Some(v) = value.filter(|v| !v.is_null()) else {
        return Ok(json!({"format": {"type": "text"}}));
    };
    let o = v
        .as_object()
        .ok_or_else(|| invalid("text", "`text` must be an object"))?;
    let mut echo = o.clone();
    echo.entry("format").or_insert(json!({"type": "text"}));
    Ok(Value::Object(echo))
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
        .filter(|t| t.get("type").and_then(Value::as_str).unwrap_or("function") == "function")
        .filter(|t| t.get("strict") == Some(&Value::Bool(true)))
        .filter_map(|t| t.get("name").and_then(Value::as_str).map(str::to_string))
        .collect()
}
