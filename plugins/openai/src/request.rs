//! `POST /v1/chat/completions` request body -> canonical generation request
//! (`mlxhost:plugin@0.2.0`, interface `request`).
//!
//! Field names, types and ranges follow the OpenAI API reference (Chat
//! Completions, "Create chat completion"); fields OpenAI does not define
//! (`top_k`, `min_p`, `repetition_penalty`, ...) follow mlx_lm.server's
//! spelling. Every rejection names the field (`param`) as OpenAI does, with
//! the path spelled as OpenAI spells it (`messages[2].tool_calls[0].id`).
//! Fields this adapter does not know are ignored (as before).
//!
//! Structured output: `response_format` (`json_object`, `json_schema` with
//! `strict`), or vLLM's `structured_outputs` / `guided_*` fields, become an
//! output constraint (`RenderOptions::constraint`) that `handle` attaches
//! through the host's `structured-output` service (WIT 0.3.0); the host's
//! constraint plugin then enforces it token by token.
//!
//! Non-standard extension fields (not in OpenAI's API):
//! - `top_k`, `min_p`, `xtc_probability`, `xtc_threshold`,
//!   `repetition_penalty`, `repetition_context_size`: mlx_lm.server's
//!   sampling fields;
//! - `return_tokens_as_token_ids` (vLLM): logprob tokens as `token_id:<id>`;
//! - `tool_parser`: tool-call parser plugin name, or `"none"` to turn
//!   parsing off (default: the server's choice);
//! - `reasoning_parser`: reasoning parser plugin name, or `"none"` (as
//!   `tool_parser`);
//! - `chat_template_kwargs` (vLLM's spelling): an object of extra chat
//!   template variables, e.g. `{"enable_thinking": false}` (default `{}`);
//! - `sampler`: sampler plugin name (default: the server's `--sampler`);
//! - `logits_processors`: extra logits-processor plugin names, in order;
//! - `plugin_params`: `{"plugin-name": {...}}`, each plugin's parameters.

use std::collections::HashSet;

use mlxhost_plugin_sdk::fields::{self, valid_function_name};
use mlxhost_plugin_sdk::structured::{self, OutputConstraint};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::request::{
    ContentPart, GenerationRequest, Message, Prompt, SamplingRequest, ToolCall, ToolChoice,
};
use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::types::ToolDefinition;
use serde_json::{Map, Value};

/// A rejected request: message and the offending field.
#[derive(Debug)]
pub struct Invalid {
    pub message: String,
    pub param: Option<String>,
}

pub(crate) fn invalid(param: &str, message: impl Into<String>) -> Invalid {
    Invalid {
        message: message.into(),
        param: Some(param.to_string()),
    }
}

/// Which route this instance serves (one instance serves one HTTP request).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`.
    #[default]
    Chat,
    /// `POST /v1/completions` (legacy Completions, `crate::completions`).
    Completions,
}

/// Options the renderer needs later in the same request.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    pub endpoint: Endpoint,
    pub logprobs: bool,
    pub include_usage: bool,
    /// vLLM's `return_tokens_as_token_ids`: tokens render as `token_id:<id>`.
    pub tokens_as_ids: bool,
    /// Completions `echo`: the prompt text, prepended to the completion.
    pub echo: Option<String>,
    /// Completions streams: where the next token starts in the text
    /// streamed so far (`logprobs.text_offset`), carried across updates.
    pub offsets: crate::completions::Offsets,
    /// The request's output constraint (structured output), which `handle`
    /// hands to the host; rendering does not use it.
    pub constraint: Option<OutputConstraint>,
    /// Tools with `function.strict: true`, which `handle` hands to the host.
    pub strict_tools: Vec<String>,
    /// The request's `speculative` field, which `handle` hands to the host.
    pub speculative: Option<mlxhost_plugin_sdk::speculative::SpeculativeOptions>,
}

/// The names of `tools[]` whose `function.strict` is true (after
/// `parse_tools` validated them).
fn strict_tool_names(obj: &Map<String, Value>) -> Vec<String> {
    let Some(Value::Array(tools)) = obj.get("tools") else {
        return Vec::new();
    };
    tools
        .iter()
        .filter_map(|t| t.get("function"))
        .filter(|f| f.get("strict") == Some(&Value::Bool(true)))
        .filter_map(|f| f.get("name").and_then(Value::as_str).map(str::to_string))
        .collect()
}

/// Parses and validates a request body.
pub fn parse(body: &[u8]) -> Result<(GenerationRequest, RenderOptions), Invalid> {
    let value: Value = serde_json::from_slice(body).map_err(|e| Invalid {
        message: format!("the request body is not valid JSON: {e}"),
        param: None,
    })?;
    let obj = value.as_object().ok_or_else(|| Invalid {
        message: "the request body must be a JSON object".into(),
        param: None,
    })?;
    let f = Fields(obj);
    f.string("model")?;
    if let Some(n) = f.uint("n")? {
        if n != 1 {
            return Err(invalid("n", format!("only n=1 is supported, got {n}")));
        }
    }
    let messages = parse_messages(obj.get("messages"))?;
    let max_completion = f.uint("max_completion_tokens")?;
    let max_tokens = max_completion.or(f.uint("max_tokens")?);
    if max_tokens == Some(0) {
        let param = if max_completion.is_some() {
            "max_completion_tokens"
        } else {
            "max_tokens"
        };
        return Err(invalid(param, format!("`{param}` must be at least 1")));
    }
    let stream = f.bool("stream")?.unwrap_or(false);
    let include_usage = include_usage(obj)?;
    let logprobs = f.bool("logprobs")?.unwrap_or(false);
    let top_logprobs = f.uint("top_logprobs")?.unwrap_or(0);
    if top_logprobs > 20 {
        return Err(invalid(
            "top_logprobs",
            format!("`top_logprobs` must be in [0, 20], got {top_logprobs}"),
        ));
    }
    if top_logprobs > 0 && !logprobs {
        return Err(invalid(
            "top_logprobs",
            "`top_logprobs` requires `logprobs` to be true",
        ));
    }
    let sampling = sampling(obj)?;
    let stop = stop(obj)?;
    let constraint = output_constraint(obj)?;
    let speculative = mlxhost_plugin_sdk::speculative::speculative(obj).map_err(lift)?;
    let sampler = f.string("sampler")?;
    let logits_processors = logits_processors(obj)?;
    let plugin_params = plugin_params(obj)?;
    let tools = parse_tools(obj.get("tools"))?;
    let tool_choice = parse_tool_choice(obj.get("tool_choice"), &tools)?;
    let parallel_tool_calls = f.bool("parallel_tool_calls")?.unwrap_or(true);
    let tool_parser = f.non_empty_string("tool_parser")?;
    let reasoning_parser = f.non_empty_string("reasoning_parser")?;
    let chat_template_kwargs = match obj.get("chat_template_kwargs") {
        None | Some(Value::Null) => "{}".to_string(),
        Some(v @ Value::Object(_)) => v.to_string(),
        Some(_) => {
            return Err(invalid(
                "chat_template_kwargs",
                "`chat_template_kwargs` must be an object of chat template variables",
            ))
        }
    };
    let tokens_as_ids = f.bool("return_tokens_as_token_ids")?.unwrap_or(false);
    Ok((
        GenerationRequest {
            prompt: Prompt::Messages(messages),
            sampling,
            max_tokens,
            // An upper bound, as llama.cpp's server and our other dialects
            // treat it (opencode sends 32000 whatever the context); the
            // host's `--strict-max-tokens` restores OpenAI's 400.
            clamp_max_tokens: true,
            stop,
            stream,
            logprobs,
            top_logprobs,
            tools,
            tool_choice,
            parallel_tool_calls,
            tool_parser,
            reasoning_parser,
            chat_template_kwargs,
            sampler,
            logits_processors,
            plugin_params,
            include_usage,
            previous_response_id: None,
        },
        RenderOptions {
            logprobs,
            include_usage,
            tokens_as_ids,
            constraint,
            strict_tools: strict_tool_names(obj),
            speculative,
            ..RenderOptions::default()
        },
    ))
}

/// `stream_options.include_usage` (false when absent).
pub(crate) fn include_usage(obj: &Map<String, Value>) -> Result<bool, Invalid> {
    Ok(match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => Fields(o).bool("include_usage")?.unwrap_or(false),
        Some(_) => {
            return Err(invalid(
                "stream_options",
                "`stream_options` must be an object",
            ))
        }
    })
}

/// The sampling fields shared by Chat Completions and Completions (OpenAI's
/// and mlx_lm.server's).
pub(crate) fn sampling(obj: &Map<String, Value>) -> Result<SamplingRequest, Invalid> {
    let f = Fields(obj);
    Ok(SamplingRequest {
        temperature: f.ranged("temperature", 0.0, 2.0)?,
        top_p: f.ranged("top_p", 0.0, 1.0)?,
        top_k: match f.int("top_k")? {
            None => None,
            // vLLM and mlx_lm.server spell "off" as -1 or 0.
            Some(k) if k <= 0 => Some(0),
            Some(k) => {
                Some(u32::try_from(k).map_err(|_| invalid("top_k", "`top_k` is too large"))?)
            }
        },
        min_p: f.ranged("min_p", 0.0, 1.0)?,
        xtc_probability: f.ranged("xtc_probability", 0.0, 1.0)?,
        xtc_threshold: f.ranged("xtc_threshold", 0.0, 0.5)?,
        seed: f.seed("seed")?,
        repetition_penalty: match f.number("repetition_penalty")? {
            Some(p) if p <= 0.0 => {
                return Err(invalid(
                    "repetition_penalty",
                    format!("`repetition_penalty` must be > 0, got {p}"),
                ))
            }
            p => p,
        },
        repetition_context_size: f.uint("repetition_context_size")?,
        presence_penalty: f.ranged("presence_penalty", -2.0, 2.0)?,
        frequency_penalty: f.ranged("frequency_penalty", -2.0, 2.0)?,
        logit_bias: parse_logit_bias(obj.get("logit_bias"))?,
    })
}

/// `stop`: a string or up to 4 non-empty strings.
pub(crate) fn stop(obj: &Map<String, Value>) -> Result<Vec<String>, Invalid> {
    let stop: Vec<String> = match obj.get("stop") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => {
            if items.len() > 4 {
                return Err(invalid(
                    "stop",
                    format!("at most 4 stop sequences, got {}", items.len()),
                ));
            }
            items
                .iter()
                .map(|v| {
                    v.as_str().map(str::to_string).ok_or_else(|| {
                        invalid("stop", "`stop` must be a string or an array of strings")
                    })
                })
                .collect::<Result<_, _>>()?
        }
        Some(_) => {
            return Err(invalid(
                "stop",
                "`stop` must be a string or an array of strings",
            ))
        }
    };
    if stop.iter().any(|s| s.is_empty()) {
        return Err(invalid("stop", "stop sequences must not be empty"));
    }
    Ok(stop)
}

/// `logits_processors`: plugin names, in order.
pub(crate) fn logits_processors(obj: &Map<String, Value>) -> Result<Vec<String>, Invalid> {
    Ok(match obj.get("logits_processors") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| {
                v.as_str().map(str::to_string).ok_or_else(|| {
                    invalid(
                        "logits_processors",
                        "`logits_processors` must be an array of plugin names",
                    )
                })
            })
            .collect::<Result<_, _>>()?,
        Some(_) => {
            return Err(invalid(
                "logits_processors",
                "`logits_processors` must be an array of plugin names",
            ))
        }
    })
}

/// `plugin_params`: `{"plugin-name": {...}}` as JSON text (`{}` when absent).
pub(crate) fn plugin_params(obj: &Map<String, Value>) -> Result<String, Invalid> {
    Ok(match obj.get("plugin_params") {
        None | Some(Value::Null) => "{}".to_string(),
        Some(v @ Value::Object(m)) => {
            if let Some((k, _)) = m.iter().find(|(_, v)| !v.is_object()) {
                return Err(invalid(
                    "plugin_params",
                    format!("`plugin_params.{k}` must be an object of that plugin's parameters"),
                ));
            }
            v.to_string()
        }
        Some(_) => {
            return Err(invalid(
                "plugin_params",
                "`plugin_params` must be an object keyed by plugin name",
            ))
        }
    })
}

/// Typed access to optional fields; `null` counts as absent.
pub(crate) struct Fields<'a>(pub(crate) &'a Map<String, Value>);

impl Fields<'_> {
    pub(crate) fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }
    pub(crate) fn string(&self, key: &str) -> Result<Option<String>, Invalid> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(invalid(key, format!("`{key}` must be a string"))),
        }
    }
    pub(crate) fn bool(&self, key: &str) -> Result<Option<bool>, Invalid> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(invalid(key, format!("`{key}` must be a boolean"))),
        }
    }
    pub(crate) fn number(&self, key: &str) -> Result<Option<f32>, Invalid> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => n
                .as_f64()
                .filter(|x| x.is_finite())
                .map(|x| Some(x as f32))
                .ok_or_else(|| invalid(key, format!("`{key}` must be a finite number"))),
            Some(_) => Err(invalid(key, format!("`{key}` must be a number"))),
        }
    }
    pub(crate) fn ranged(&self, key: &str, lo: f32, hi: f32) -> Result<Option<f32>, Invalid> {
        match self.number(key)? {
            Some(x) if !(lo..=hi).contains(&x) => Err(invalid(
                key,
                format!("`{key}` must be in [{lo}, {hi}], got {x}"),
            )),
            x => Ok(x),
        }
    }
    pub(crate) fn int(&self, key: &str) -> Result<Option<i64>, Invalid> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => n
                .as_i64()
                .map(Some)
                .ok_or_else(|| invalid(key, format!("`{key}` must be an integer"))),
            Some(_) => Err(invalid(key, format!("`{key}` must be an integer"))),
        }
    }
    /// A sampling seed: the SDK's rule ([`fields::seed`]), shared by every
    /// first-party adapter.
    pub(crate) fn seed(&self, key: &str) -> Result<Option<u64>, Invalid> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => fields::seed(v).map(Some).ok_or_else(|| {
                invalid(
                    key,
                    format!("`{key}` must be {}, got {v}", fields::SEED_RANGE),
                )
            }),
        }
    }
    pub(crate) fn uint(&self, key: &str) -> Result<Option<u32>, Invalid> {
        match self.int(key)? {
            None => Ok(None),
            Some(x) => u32::try_from(x).map(Some).map_err(|_| {
                invalid(
                    key,
                    format!("`{key}` must be a non-negative integer below 2^32, got {x}"),
                )
            }),
        }
    }
    /// A string that must not be empty when given (plugin names).
    pub(crate) fn non_empty_string(&self, key: &str) -> Result<Option<String>, Invalid> {
        match self.string(key)? {
            Some(s) if s.is_empty() => Err(invalid(key, format!("`{key}` must not be empty"))),
            s => Ok(s),
        }
    }
}

fn parse_messages(value: Option<&Value>) -> Result<Vec<Message>, Invalid> {
    let items = match value {
        None | Some(Value::Null) => return Err(invalid("messages", "`messages` is required")),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(invalid("messages", "`messages` must be an array")),
    };
    if items.is_empty() {
        return Err(invalid(
            "messages",
            "`messages` must contain at least one message",
        ));
    }
    items
        .iter()
        .enumerate()
        .map(|(i, m)| parse_message(i, m))
        .collect()
}

fn parse_message(i: usize, m: &Value) -> Result<Message, Invalid> {
    let at = |field: &str| format!("messages[{i}].{field}");
    let m = m.as_object().ok_or_else(|| {
        invalid(
            &format!("messages[{i}]"),
            format!("`messages[{i}]` must be an object"),
        )
    })?;
    let role = match m.get("role") {
        Some(Value::String(r)) => r.as_str(),
        Some(_) => {
            return Err(invalid(
                &at("role"),
                format!("`{}` must be a string", at("role")),
            ))
        }
        None => {
            return Err(invalid(
                &at("role"),
                format!("`{}` is required", at("role")),
            ))
        }
    };
    // `developer` is OpenAI's newer name for the system role.
    let role = match role {
        "system" | "developer" => "system",
        "user" | "assistant" | "tool" => role,
        other => {
            return Err(invalid(
                &at("role"),
                format!(
                    "unknown role `{other}` in `{}`: expected system, developer, user, assistant or tool",
                    at("role")
                ),
            ))
        }
    };
    let content = match m.get("content") {
        Some(Value::String(s)) => vec![ContentPart::Text(s.clone())],
        // OpenAI: required unless the assistant message has `tool_calls`;
        // an empty assistant turn is accepted here (as before).
        None | Some(Value::Null) if role == "assistant" => Vec::new(),
        None | Some(Value::Null) => {
            return Err(invalid(
                &at("content"),
                format!("`{}` is required for role {role}", at("content")),
            ))
        }
        Some(Value::Array(parts)) => content_parts(parts, &at("content"), role)?,
        Some(_) => {
            return Err(invalid(
                &at("content"),
                format!(
                    "`{}` must be a string or an array of content parts",
                    at("content")
                ),
            ))
        }
    };
    let f = Fields(m);
    let name = f
        .string("name")
        .map_err(|_| invalid(&at("name"), format!("`{}` must be a string", at("name"))))?;
    let tool_calls = match m.get("tool_calls") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(calls)) if role == "assistant" => calls
            .iter()
            .enumerate()
            .map(|(k, c)| parse_tool_call(c, &format!("{}[{k}]", at("tool_calls"))))
            .collect::<Result<_, _>>()?,
        Some(Value::Array(calls)) if calls.is_empty() => Vec::new(),
        Some(Value::Array(_)) => {
            return Err(invalid(
                &at("tool_calls"),
                format!("`{}` is only allowed for role assistant", at("tool_calls")),
            ))
        }
        Some(_) => {
            return Err(invalid(
                &at("tool_calls"),
                format!("`{}` must be an array", at("tool_calls")),
            ))
        }
    };
    let tool_call_id = match m.get("tool_call_id") {
        None | Some(Value::Null) if role == "tool" => {
            return Err(invalid(
                &at("tool_call_id"),
                format!("`{}` is required for role tool", at("tool_call_id")),
            ))
        }
        None | Some(Value::Null) => None,
        Some(Value::String(id)) if role == "tool" => Some(id.clone()),
        Some(Value::String(_)) => {
            return Err(invalid(
                &at("tool_call_id"),
                format!("`{}` is only allowed for role tool", at("tool_call_id")),
            ))
        }
        Some(_) => {
            return Err(invalid(
                &at("tool_call_id"),
                format!("`{}` must be a string", at("tool_call_id")),
            ))
        }
    };
    // The reasoning of an earlier assistant turn: vLLM's `reasoning_content`,
    // or `reasoning` (OpenRouter, newer vLLM). Ignored on other roles.
    let reasoning = if role == "assistant" {
        let mut reasoning = None;
        for key in ["reasoning_content", "reasoning"] {
            match m.get(key) {
                None | Some(Value::Null) => {}
                Some(Value::String(r)) => {
                    reasoning.get_or_insert_with(|| r.clone());
                }
                Some(_) => {
                    return Err(invalid(&at(key), format!("`{}` must be a string", at(key))))
                }
            }
        }
        reasoning
    } else {
        None
    };
    Ok(Message {
        role: role.into(),
        content,
        name,
        tool_calls,
        tool_call_id,
        reasoning,
    })
}

/// Content parts: `{"type": "text", "text": ...}` for every role, and
/// `{"type": "image_url", "image_url": {"url": ...}}` for user messages
/// (OpenAI allows images only there); the host rejects images for a
/// text-only model. Other part types (`input_audio`, `file`, `refusal`) are
/// not supported.
fn content_parts(parts: &[Value], param: &str, role: &str) -> Result<Vec<ContentPart>, Invalid> {
    parts
        .iter()
        .enumerate()
        .map(|(j, part)| {
            let at = |field: &str| format!("{param}[{j}].{field}");
            let part = part.as_object().ok_or_else(|| {
                invalid(
                    &format!("{param}[{j}]"),
                    format!("`{param}[{j}]` must be an object"),
                )
            })?;
            match part.get("type") {
                Some(Value::String(t)) if t == "text" => match part.get("text") {
                    Some(Value::String(text)) => Ok(ContentPart::Text(text.clone())),
                    _ => Err(invalid(
                        &at("text"),
                        format!("`{}` must be a string", at("text")),
                    )),
                },
                Some(Value::String(t)) if t == "image_url" && role == "user" => {
                    match part
                        .get("image_url")
                        .and_then(Value::as_object)
                        .map(|o| o.get("url"))
                    {
                        Some(Some(Value::String(url))) => Ok(ContentPart::ImageUrl(url.clone())),
                        Some(_) => Err(invalid(
                            &at("image_url.url"),
                            format!("`{}` must be a string", at("image_url.url")),
                        )),
                        None => Err(invalid(
                            &at("image_url"),
                            format!("`{}` must be an object with a `url`", at("image_url")),
                        )),
                    }
                }
                Some(Value::String(t)) if t == "image_url" => Err(invalid(
                    &at("type"),
                    format!("image content parts are only allowed for role user, not {role}"),
                )),
                Some(Value::String(other)) => Err(invalid(
                    &at("type"),
                    format!(
                        "content part type `{other}` is not supported: expected `text` or `image_url`"
                    ),
                )),
                Some(_) => Err(invalid(&at("type"), format!("`{}` must be a string", at("type")))),
                None => Err(invalid(&at("type"), format!("`{}` is required", at("type")))),
            }
        })
        .collect()
}

/// One `{"id", "type": "function", "function": {"name", "arguments"}}` of an
/// assistant message; `arguments` is JSON text that must parse as an object.
fn parse_tool_call(call: &Value, param: &str) -> Result<ToolCall, Invalid> {
    let at = |field: &str| format!("{param}.{field}");
    let call = call
        .as_object()
        .ok_or_else(|| invalid(param, format!("`{param}` must be an object")))?;
    let id = match call.get("id") {
        Some(Value::String(id)) => id.clone(),
        Some(_) => {
            return Err(invalid(
                &at("id"),
                format!("`{}` must be a string", at("id")),
            ))
        }
        None => return Err(invalid(&at("id"), format!("`{}` is required", at("id")))),
    };
    match call.get("type") {
        None | Some(Value::Null) => {}
        Some(Value::String(t)) if t == "function" => {}
        Some(_) => {
            return Err(invalid(
                &at("type"),
                format!("`{}` must be \"function\"", at("type")),
            ))
        }
    }
    let function = function_object(call.get("function"), &at("function"))?;
    let name = match function.get("name") {
        Some(Value::String(n)) => n.clone(),
        _ => {
            let p = at("function.name");
            return Err(invalid(&p, format!("`{p}` must be a string")));
        }
    };
    let p = at("function.arguments");
    let arguments = match function.get("arguments") {
        Some(Value::String(a)) => a.clone(),
        _ => {
            return Err(invalid(
                &p,
                format!("`{p}` must be a string holding a JSON object"),
            ))
        }
    };
    match serde_json::from_str::<Value>(&arguments) {
        Ok(Value::Object(_)) => {}
        Ok(_) => return Err(invalid(&p, format!("`{p}` must be a JSON object"))),
        Err(e) => return Err(invalid(&p, format!("`{p}` is not valid JSON: {e}"))),
    }
    Ok(ToolCall {
        id,
        name,
        arguments,
    })
}

fn parse_logit_bias(value: Option<&Value>) -> Result<Vec<(u32, f32)>, Invalid> {
    let map = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(m)) => m,
        Some(_) => {
            return Err(invalid(
                "logit_bias",
                "`logit_bias` must be an object mapping token ids to biases",
            ))
        }
    };
    let mut out = Vec::with_capacity(map.len());
    for (k, v) in map {
        let id: u32 = k.parse().map_err(|_| {
            invalid(
                "logit_bias",
                format!("`logit_bias` key `{k}` is not a token id"),
            )
        })?;
        let bias = v
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| {
                invalid(
                    "logit_bias",
                    format!("`logit_bias.{k}` must be a number in [-100, 100]"),
                )
            })?;
        out.push((id, bias as f32));
    }
    Ok(out)
}

/// `tools: [{"type": "function", "function": {"name", "description"?,
/// "parameters"?, "strict"?}}]`. An empty array means no tools.
fn parse_tools(value: Option<&Value>) -> Result<Vec<ToolDefinition>, Invalid> {
    let items = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(invalid("tools", "`tools` must be an array")),
    };
    let mut names = HashSet::new();
    items
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let at = |field: &str| format!("tools[{i}].{field}");
            let t = t.as_object().ok_or_else(|| {
                invalid(&format!("tools[{i}]"), format!("`tools[{i}]` must be an object"))
            })?;
            match t.get("type") {
                // OpenAI requires `type`; like vLLM, a missing one means "function".
                None | Some(Value::Null) => {}
                Some(Value::String(s)) if s == "function" => {}
                Some(other) => {
                    return Err(invalid(
                        &at("type"),
                        format!("`{}` must be \"function\", got {other}", at("type")),
                    ))
                }
            }
            let function = function_object(t.get("function"), &at("function"))?;
            let p = at("function.name");
            let name = match function.get("name") {
                Some(Value::String(n)) => n,
                Some(_) => return Err(invalid(&p, format!("`{p}` must be a string"))),
                None => return Err(invalid(&p, format!("`{p}` is required"))),
            };
            if !valid_function_name(name) {
                return Err(invalid(
                    &p,
                    format!(
                        "`{p}` must match ^[a-zA-Z0-9_-]{{1,64}}$ (letters, digits, `_`, `-`; 1 to 64), got {name:?}"
                    ),
                ));
            }
            if !names.insert(name.clone()) {
                return Err(invalid(
                    &p,
                    format!("`{p}`: duplicate function name `{name}` in `tools`"),
                ));
            }
            let description = match function.get("description") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(d)) => d.clone(),
                Some(_) => {
                    let p = at("function.description");
                    return Err(invalid(&p, format!("`{p}` must be a string")));
                }
            };
            let parameters_json = match function.get("parameters") {
                None | Some(Value::Null) => "{}".to_string(),
                Some(v @ Value::Object(_)) => v.to_string(),
                Some(_) => {
                    let p = at("function.parameters");
                    return Err(invalid(
                        &p,
                        format!("`{p}` must be an object (a JSON Schema)"),
                    ));
                }
            };
            // `strict: true` is enforced by the host when the reply must be
            // a call (`strict_tool_names`, WIT 0.3.0 `strict-tools`).
            match function.get("strict") {
                None | Some(Value::Null) | Some(Value::Bool(_)) => {}
                Some(_) => {
                    let p = at("function.strict");
                    return Err(invalid(&p, format!("`{p}` must be a boolean")));
                }
            }
            Ok(ToolDefinition {
                name: name.clone(),
                parameters_json,
                description,
            })
        })
        .collect()
}

/// `tool_choice`: `"auto" | "none" | "required"` or `{"type": "function",
/// "function": {"name"}}`. Default: auto with tools, none without.
fn parse_tool_choice(
    value: Option<&Value>,
    tools: &[ToolDefinition],
) -> Result<ToolChoice, Invalid> {
    const P: &str = "tool_choice";
    let shape = "`tool_choice` must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": string}}";
    let choice = match value {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            _ => return Err(invalid(P, format!("{shape}, got {s:?}"))),
        },
        Some(Value::Object(o)) => {
            if o.get("type").and_then(Value::as_str) != Some("function") {
                return Err(invalid(P, shape));
            }
            match o.get("function").and_then(|f| f.get("name")) {
                Some(Value::String(name)) => ToolChoice::Named(name.clone()),
                _ => return Err(invalid(P, shape)),
            }
        }
        Some(_) => return Err(invalid(P, shape)),
    };
    match choice {
        ToolChoice::Auto if tools.is_empty() => Ok(ToolChoice::None),
        ToolChoice::Required if tools.is_empty() => {
            Err(invalid(P, "`tool_choice` \"required\" needs `tools`"))
        }
        ToolChoice::Named(name) if !tools.iter().any(|t| t.name == name) => Err(invalid(
            P,
            format!("`tool_choice` names function `{name}`, which is not in `tools`"),
        )),
        choice => Ok(choice),
    }
}

/// The structured output a chat request asks for: `response_format`, or
/// vLLM's `structured_outputs` / `guided_*` fields (which vLLM also takes on
/// Chat Completions); not both.
fn output_constraint(obj: &Map<String, Value>) -> Result<Option<OutputConstraint>, Invalid> {
    let from_format = structured::chat_response_format(obj.get("response_format")).map_err(lift)?;
    let from_vllm = structured::vllm_structured_outputs(obj).map_err(lift)?;
    match (from_format, from_vllm) {
        (Some(_), Some(v)) => Err(invalid(
            &v.field,
            format!("`{}` cannot be combined with `response_format`", v.field),
        )),
        (a, b) => Ok(a.or(b)),
    }
}

/// The SDK's field error as this adapter's.
pub(crate) fn lift(e: fields::Invalid) -> Invalid {
    Invalid {
        message: e.message,
        param: e.param,
    }
}

/// The `function` object of a tool or a tool call; `param` names it in errors.
fn function_object<'a>(
    value: Option<&'a Value>,
    param: &str,
) -> Result<&'a Map<String, Value>, Invalid> {
    match value {
        Some(Value::Object(f)) => Ok(f),
        Some(_) => Err(invalid(param, format!("`{param}` must be an object"))),
        None => Err(invalid(param, format!("`{param}` is required"))),
    }
}
