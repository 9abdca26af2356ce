//! Typed access to a JSON request body's fields for API adapters, with
//! errors that name the field (`param`), and the mlxhost extension fields
//! every first-party adapter accepts (`sampler`, `logits_processors`,
//! `plugin_params`, `tool_parser`, `reasoning_parser`,
//! `chat_template_kwargs`). Feature `json`.

use serde_json::{Map, Value};

/// A rejected request: the HTTP status (400, or 404 for a missing stored
/// object), the field at fault and the message.
#[derive(Debug, Clone, PartialEq)]
pub struct Invalid {
    /// 400 or 404.
    pub status: u16,
    /// The message.
    pub message: String,
    /// The field at fault (`input[2].content[0].text`).
    pub param: Option<String>,
    /// A machine-readable code, where the dialect has one.
    pub code: Option<&'static str>,
}

/// A 400 naming `param`; the message is `why` as given.
pub fn invalid(param: &str, why: impl Into<String>) -> Invalid {
    Invalid {
        status: 400,
        message: why.into(),
        param: Some(param.to_string()),
        code: None,
    }
}

/// A 400 about the whole body.
pub fn body_error(why: impl Into<String>) -> Invalid {
    Invalid {
        status: 400,
        message: why.into(),
        param: None,
        code: None,
    }
}

/// The body as a JSON object. Errors: not JSON, or not an object.
pub fn object(body: &[u8]) -> Result<Map<String, Value>, Invalid> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(o)) => Ok(o),
        Ok(_) => Err(body_error("the request body must be a JSON object")),
        Err(e) => Err(body_error(format!(
            "the request body is not valid JSON: {e}"
        ))),
    }
}

/// Typed access to an object's optional fields; `null` counts as absent.
/// `at` prefixes the field names in errors (`""` at the top level).
pub struct Fields<'a> {
    obj: &'a Map<String, Value>,
    at: String,
}

impl<'a> Fields<'a> {
    /// The fields of `obj`, named `at.field` in errors.
    pub fn new(obj: &'a Map<String, Value>, at: &str) -> Self {
        Fields {
            obj,
            at: at.to_string(),
        }
    }

    /// The error path of `key`.
    pub fn path(&self, key: &str) -> String {
        if self.at.is_empty() {
            key.to_string()
        } else {
            format!("{}.{key}", self.at)
        }
    }

    /// The value, unless absent or null.
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        self.obj.get(key).filter(|v| !v.is_null())
    }

    /// A string field.
    pub fn string(&self, key: &str) -> Result<Option<String>, Invalid> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(invalid(
                &self.path(key),
                format!("`{}` must be a string", self.path(key)),
            )),
        }
    }

    /// A string field that must be present.
    pub fn required_string(&self, key: &str) -> Result<String, Invalid> {
        self.string(key)?
            .ok_or_else(|| invalid(&self.path(key), format!("`{}` is required", self.path(key))))
    }

    /// A non-empty string field.
    pub fn non_empty_string(&self, key: &str) -> Result<Option<String>, Invalid> {
        match self.string(key)? {
            Some(s) if s.is_empty() => Err(invalid(
                &self.path(key),
                format!("`{}` must not be empty", self.path(key)),
            )),
            s => Ok(s),
        }
    }

    /// A boolean field.
    pub fn bool(&self, key: &str) -> Result<Option<bool>, Invalid> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(_) => Err(invalid(
                &self.path(key),
                format!("`{}` must be a boolean", self.path(key)),
            )),
        }
    }

    /// A number in `[lo, hi]`.
    pub fn ranged(&self, key: &str, lo: f64, hi: f64) -> Result<Option<f32>, Invalid> {
        let p = self.path(key);
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => match n.as_f64() {
                Some(x) if (lo..=hi).contains(&x) => Ok(Some(x as f32)),
                _ => Err(invalid(
                    &p,
                    format!("`{p}` must be a number in [{lo}, {hi}], got {n}"),
                )),
            },
            Some(_) => Err(invalid(
                &p,
                format!("`{p}` must be a number in [{lo}, {hi}]"),
            )),
        }
    }

    /// A non-negative integer below 2^32.
    pub fn uint(&self, key: &str) -> Result<Option<u32>, Invalid> {
        self.u64(key)?
            .map(|x| {
                u32::try_from(x).map_err(|_| {
                    invalid(
                        &self.path(key),
                        format!("`{}` must be below 2^32, got {x}", self.path(key)),
                    )
                })
            })
            .transpose()
    }

    /// A sampling seed ([`seed`]'s rule).
    pub fn seed(&self, key: &str) -> Result<Option<u64>, Invalid> {
        let p = self.path(key);
        match self.get(key) {
            None => Ok(None),
            Some(v) => seed(v)
                .map(Some)
                .ok_or_else(|| invalid(&p, format!("`{p}` must be {SEED_RANGE}, got {v}"))),
        }
    }

    /// A non-negative integer.
    pub fn u64(&self, key: &str) -> Result<Option<u64>, Invalid> {
        let p = self.path(key);
        match self.get(key) {
            None => Ok(None),
            Some(Value::Number(n)) => n.as_u64().map(Some).ok_or_else(|| {
                invalid(&p, format!("`{p}` must be a non-negative integer, got {n}"))
            }),
            Some(_) => Err(invalid(&p, format!("`{p}` must be a non-negative integer"))),
        }
    }

    /// An object field.
    pub fn object(&self, key: &str) -> Result<Option<&'a Map<String, Value>>, Invalid> {
        match self.get(key) {
            None => Ok(None),
            Some(Value::Object(o)) => Ok(Some(o)),
            Some(_) => Err(invalid(
                &self.path(key),
                format!("`{}` must be an object", self.path(key)),
            )),
        }
    }

    /// An array of strings.
    pub fn strings(&self, key: &str) -> Result<Vec<String>, Invalid> {
        let p = self.path(key);
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .enumerate()
                .map(|(k, v)| {
                    v.as_str().map(str::to_string).ok_or_else(|| {
                        invalid(&format!("{p}[{k}]"), format!("`{p}[{k}]` must be a string"))
                    })
                })
                .collect(),
            Some(_) => Err(invalid(&p, format!("`{p}` must be an array of strings"))),
        }
    }
}

/// The mlxhost extension fields of a request body (not in any vendor's
/// API), as the canonical request spells them.
#[derive(Debug, Clone, PartialEq)]
pub struct Extensions {
    /// Sampler plugin; none = the server's default.
    pub sampler: Option<String>,
    /// Extra logits processor plugins, in order.
    pub logits_processors: Vec<String>,
    /// `{"plugin-name": {...}}` as JSON text (`{}` when absent).
    pub plugin_params: String,
    /// Tool-call parser plugin or `"none"`.
    pub tool_parser: Option<String>,
    /// Reasoning parser plugin or `"none"`.
    pub reasoning_parser: Option<String>,
    /// Extra chat-template variables as JSON text (`{}` when absent).
    pub chat_template_kwargs: String,
}

/// Reads the extension fields. Errors: a 400 naming the field.
pub fn extensions(f: &Fields) -> Result<Extensions, Invalid> {
    let plugin_params = match f.get("plugin_params") {
        None => "{}".to_string(),
        Some(v @ Value::Object(m)) => {
            if let Some((k, _)) = m.iter().find(|(_, v)| !v.is_object()) {
                let p = f.path(&format!("plugin_params.{k}"));
                return Err(invalid(
                    &p,
                    format!("`{p}` must be an object of that plugin's parameters"),
                ));
            }
            v.to_string()
        }
        Some(_) => {
            let p = f.path("plugin_params");
            return Err(invalid(
                &p,
                format!("`{p}` must be an object keyed by plugin name"),
            ));
        }
    };
    let chat_template_kwargs = match f.get("chat_template_kwargs") {
        None => "{}".to_string(),
        Some(v @ Value::Object(_)) => v.to_string(),
        Some(_) => {
            let p = f.path("chat_template_kwargs");
            return Err(invalid(
                &p,
                format!("`{p}` must be an object of chat template variables"),
            ));
        }
    };
    Ok(Extensions {
        sampler: f.non_empty_string("sampler")?,
        logits_processors: f.strings("logits_processors")?,
        plugin_params,
        tool_parser: f.non_empty_string("tool_parser")?,
        reasoning_parser: f.non_empty_string("reasoning_parser")?,
        chat_template_kwargs,
    })
}

/// What a `seed` may be, in words for error messages.
pub const SEED_RANGE: &str = "an integer from -2^63 to 2^63-1";

/// The `seed` rule of every first-party adapter: a signed 64-bit integer
/// (vLLM's bound for OpenAI's `seed`), handed to the sampler as the same
/// 64 bits read unsigned (`-1` is seed `2^64-1`). `None` for anything else
/// (fractions, strings, integers out of range).
pub fn seed(value: &Value) -> Option<u64> {
    value.as_i64().map(|s| s as u64)
}

/// OpenAI's function-name rule: `^[a-zA-Z0-9_-]{1,64}$`.
pub fn valid_function_name(name: &str) -> bool {
    valid_tool_name(name, 64)
}

/// A tool name of ASCII letters, digits, `_` and `-`, 1 to `max_len` bytes:
/// `^[a-zA-Z0-9_-]{1,max_len}$` (OpenAI allows 64, Anthropic 128). Names
/// outside it would be written into the chat template as is, where a
/// space, quote or newline breaks the tool list the model reads.
pub fn valid_tool_name(name: &str, max_len: usize) -> bool {
    (1..=max_len).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}
