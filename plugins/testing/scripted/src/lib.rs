//! Test-only sampler: emits a scripted token sequence, so tests can make a
//! model "say" a recorded output (e.g. a tool call) through the real
//! pipeline.
//!
//! Parameters (`plugin_params.scripted`), one of:
//! - `text`: a string, tokenized in `create` with `vocab::encode` (special
//!   tokens are not parsed: their text is tokenized as plain text);
//! - `ids`: a list of token ids;
//!
//! and optionally `end_id`: the id emitted once the script is spent
//! (default: the first of `xtc_special_ids`, the host's EOS ids, when
//! there are any, else the most likely token). Step `i` (0-based) returns
//! the script's `i`-th id; every step past it returns the end id.
use mlxhost_plugin_sdk::sampler::exports::mlxhost::plugin::sampler::{self as api, Choice};
use mlxhost_plugin_sdk::sampler::mlxhost::plugin::tensors::{History, Logits};
use mlxhost_plugin_sdk::sampler::mlxhost::plugin::types::{PluginError, SamplingParams};
use mlxhost_plugin_sdk::sampler::mlxhost::plugin::vocab;
use serde_json::Value;

struct Plugin;
impl api::Guest for Plugin {
    type Session = Session;
}

struct Session {
    script: Vec<u32>,
    /// None: the argmax of the logits.
    end_id: Option<u32>,
}

fn error(message: String) -> PluginError {
    PluginError { message }
}

/// A u32 token id, or an error naming `what`.
fn id(v: &Value, what: &str) -> Result<u32, PluginError> {
    v.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| {
            error(format!(
                "`{what}` must be a token id (an integer >= 0), got {v}"
            ))
        })
}

impl api::GuestSession for Session {
    fn create(p: SamplingParams) -> Result<api::Session, PluginError> {
        let extra: Value = serde_json::from_str(&p.extra)
            .map_err(|e| error(format!("parameters are not JSON: {e}")))?;
        let Value::Object(obj) = extra else {
            return Err(error(format!(
                "parameters must be a JSON object, got {extra}"
            )));
        };
        const KNOWN: [&str; 3] = ["text", "ids", "end_id"];
        if let Some(k) = obj.keys().find(|k| !KNOWN.contains(&k.as_str())) {
            return Err(error(format!(
                "unknown parameter `{k}` (scripted takes {})",
                KNOWN.join(", ")
            )));
        }
        let script = match (obj.get("text"), obj.get("ids")) {
            (Some(_), Some(_)) => return Err(error("give `text` or `ids`, not both".into())),
            (Some(Value::String(text)), None) => vocab::encode(text),
            (Some(other), None) => {
                return Err(error(format!("`text` must be a string, got {other}")))
            }
            (None, Some(Value::Array(ids))) => ids
                .iter()
                .enumerate()
                .map(|(i, v)| id(v, &format!("ids[{i}]")))
                .collect::<Result<_, _>>()?,
            (None, Some(other)) => {
                return Err(error(format!(
                    "`ids` must be a list of token ids, got {other}"
                )))
            }
            (None, None) => return Err(error("missing `text` or `ids` (the script)".into())),
        };
        let end_id = match obj.get("end_id") {
            Some(v) => Some(id(v, "end_id")?),
            None => p.xtc_special_ids.first().copied(),
        };
        Ok(api::Session::new(Session { script, end_id }))
    }

    fn sample(
        &self,
        logits: &Logits,
        _history: &History,
        step: u32,
    ) -> Result<Choice, PluginError> {
        if let Some(&id) = self.script.get(step as usize) {
            return Ok(Choice::Host(id));
        }
        Ok(match self.end_id {
            Some(id) => Choice::Host(id),
            None => Choice::Device(logits.argmax()),
        })
    }

    fn accept(&self, _token: u32, _raw: f32, _sampled: f32) {}
}

mlxhost_plugin_sdk::sampler::export_sampler!(Plugin);
