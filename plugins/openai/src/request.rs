//! `POST /v1/chat/completions` request body -> canonical generation request.
//!
//! Field names, types and ranges follow the OpenAI API reference (Chat
//! Completions, "Create chat completion"); fields OpenAI does not define
//! (`top_k`, `min_p`, `repetition_penalty`, ...) follow mlx_lm.server's
//! spelling. Every rejection names the field (`param`) as OpenAI does.

use mlxhost_plugin_sdk::adapter::exports::mlxhost::plugin::api_adapter::{
    GenerationRequest, Message, SamplingRequest,
};
use mlxhost_plugin_sdk::adapter::mlxhost::plugin::types::ToolDefinition;
use serde_json::{Map, Value};

/// A rejected request: message and the offending field.
#[derive(Debug)]
pub struct Invalid {
    pub message: String,
    pub param: Option<String>,
}

fn invalid(param: &str, message: impl Into<String>) -> Invalid {
    Invalid {
        message: message.into(),
        param: Some(param.to_string()),
    }
}

/// Options the renderer needs later in the same request.
#[derive(Debug, Clone, Default)]
pub struct RenderOptions {
    pub logprobs: bool,
    pub include_usage: bool,
    /// vLLM's `return_tokens_as_token_ids`: tokens render as `token_id:<id>`.
    pub tokens_as_ids: bool,
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
    let include_usage = match obj.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => Fields(o).bool("include_usage")?.unwrap_or(false),
        Some(_) => {
            return Err(invalid(
                "stream_options",
                "`stream_options` must be an object",
            ))
        }
    };
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
    let sampling = SamplingRequest {
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
        seed: f.int("seed")?.map(|s| s as u64),
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
    };
    let stop = match obj.get("stop") {
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
    let sampler = f.string("sampler")?;
    let logits_processors = match obj.get("logits_processors") {
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
    };
    let plugin_params = match obj.get("plugin_params") {
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
    };
    let tools = parse_tools(obj.get("tools"))?;
    let tokens_as_ids = f.bool("return_tokens_as_token_ids")?.unwrap_or(false);
    Ok((
        GenerationRequest {
            messages,
            sampling,
            max_tokens,
            stop,
            stream,
            logprobs,
            top_logprobs,
            tools,
            sampler,
            logits_processors,
            plugin_params,
            include_usage,
        },
        RenderOptions {
            logprobs,
            include_usage,
            tokens_as_ids,
        },
    ))
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
            Some(_) => Err(invalid(key, format!("`{key}` must be a string"))),
        }
    }
    fn bool(&self, key: &str) -> Result<Option<bool>, Invalid> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(invalid(key, format!("`{key}` must be a boolean"))),
        }
    }
    fn number(&self, key: &str) -> Result<Option<f32>, Invalid> {
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
    fn ranged(&self, key: &str, lo: f32, hi: f32) -> Result<Option<f32>, Invalid> {
        match self.number(key)? {
            Some(x) if !(lo..=hi).contains(&x) => Err(invalid(
                key,
                format!("`{key}` must be in [{lo}, {hi}], got {x}"),
            )),
            x => Ok(x),
        }
    }
    fn int(&self, key: &str) -> Result<Option<i64>, Invalid> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => n
                .as_i64()
                .map(Some)
                .ok_or_else(|| invalid(key, format!("`{key}` must be an integer"))),
            Some(_) => Err(invalid(key, format!("`{key}` must be an integer"))),
        }
    }
    fn uint(&self, key: &str) -> Result<Option<u32>, Invalid> {
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
        .map(|(i, m)| {
            let at = |field: &str| format!("messages[{i}].{field}");
            let m = m
                .as_object()
                .ok_or_else(|| invalid(&format!("messages[{i}]"), format!("messages[{i}] must be an object")))?;
            let role = match m.get("role") {
                Some(Value::String(r)) => r.as_str(),
                Some(_) => return Err(invalid(&at("role"), format!("`{}` must be a string", at("role")))),
                None => return Err(invalid(&at("role"), format!("`{}` is required", at("role")))),
            };
            // `developer` is OpenAI's newer name for the system role.
            let role = match role {
                "system" | "developer" => "system",
                "user" | "assistant" | "tool" => role,
                other => {
                    return Err(invalid(
                        &at("role"),
                        format!("unknown role `{other}` in {}: expected system, developer, user, assistant or tool", at("role")),
                    ))
                }
            };
            let content = match m.get("content") {
                Some(Value::String(s)) => s.clone(),
                None | Some(Value::Null) if role == "assistant" => String::new(),
                None | Some(Value::Null) => {
                    return Err(invalid(&at("content"), format!("`{}` is required for role {role}", at("content"))))
                }
                Some(Value::Array(parts)) => text_parts(parts, &at("content"))?,
                Some(_) => {
                    return Err(invalid(&at("content"), format!("`{}` must be a string or an array of text parts", at("content"))))
                }
            };
            Ok(Message { role: role.into(), content })
        })
        .collect()
}

/// Joins `[{"type": "text", "text": ...}]` parts; other part types are not
/// supported by a text-only model.
fn text_parts(parts: &[Value], param: &str) -> Result<String, Invalid> {
    let mut out = String::new();
    for (j, part) in parts.iter().enumerate() {
        let kind = part.get("type").and_then(Value::as_str);
        match (kind, part.get("text").and_then(Value::as_str)) {
            (Some("text"), Some(text)) => out.push_str(text),
            (Some(other), _) if other != "text" => {
                return Err(invalid(
                    &format!("{param}[{j}].type"),
                    format!(
                        "content part type `{other}` is not supported by this model (text only)"
                    ),
                ))
            }
            _ => {
                return Err(invalid(
                    &format!("{param}[{j}]"),
                    format!("`{param}[{j}]` must be {{\"type\": \"text\", \"text\": string}}"),
                ))
            }
        }
    }
    Ok(out)
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

fn parse_tools(value: Option<&Value>) -> Result<Vec<ToolDefinition>, Invalid> {
    let items = match value {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Array(items)) => items,
        Some(_) => return Err(invalid("tools", "`tools` must be an array")),
    };
    items
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let function = t
                .get("function")
                .and_then(Value::as_object)
                .ok_or_else(|| {
                    invalid(
                        &format!("tools[{i}].function"),
                        format!("`tools[{i}].function` is required"),
                    )
                })?;
            let name = function
                .get("name")
                .and_then(Value::as_str)
                .ok_or_else(|| {
                    invalid(
                        &format!("tools[{i}].function.name"),
                        format!("`tools[{i}].function.name` must be a string"),
                    )
                })?;
            Ok(ToolDefinition {
                name: name.into(),
                parameters_json: function
                    .get("parameters")
                    .map(Value::to_string)
                    .unwrap_or_else(|| "{}".into()),
                description: function
                    .get("description")
                    .and_then(Value::as_str)
                    .unwrap_or_default()
                    .into(),
            })
        })
        .collect()
}
