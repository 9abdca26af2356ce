//! The `speculative` request field every first-party adapter may accept
//! (speculative decoding, WIT 0.4.0's `speculation` service):
//!
//! | field | meaning |
//! |---|---|
//! | `speculative: {"drafter": "prompt-lookup", "n_max": 8}` | the drafter plugin (`"none"`: off) and the most tokens drafted per step (`num_speculative_tokens`, vLLM's name, is an alias); either may be left out for the server's default (`--drafter`, `--draft-max`) |
//! | `speculative: false` | no speculation for this request |
//! | `"speculative.n_max": 8` | llama.cpp server's flat spelling of `n_max` |
//!
//! Speculation never changes the output, only its speed. Feature `json`.

use serde_json::{Map, Value};

use crate::fields::{invalid, Invalid};
pub use crate::v4::speculation::mlxhost::plugin0_4_0::speculation::SpeculativeOptions;

/// The most drafts per step a request may name (the host's limit).
pub const MAX_N: u64 = 64;

/// Reads `speculative` (and llama.cpp's `speculative.n_max`); `None` when
/// the request says nothing. Errors: a 400 naming the field.
pub fn speculative(obj: &Map<String, Value>) -> Result<Option<SpeculativeOptions>, Invalid> {
    let n = |v: &Value, p: &str| -> Result<u32, Invalid> {
        v.as_u64()
            .filter(|n| *n <= MAX_N)
            .map(|n| n as u32)
            .ok_or_else(|| invalid(p, format!("`{p}` must be an integer from 0 to {MAX_N}")))
    };
    let mut out = match obj.get("speculative") {
        None | Some(Value::Null) => None,
        Some(Value::Bool(false)) => Some(SpeculativeOptions {
            drafter: Some("none".into()),
            max_draft: None,
        }),
        Some(Value::Bool(true)) => Some(SpeculativeOptions {
            drafter: None,
            max_draft: None,
        }),
        Some(Value::Object(m)) => {
            let drafter = match m.get("drafter") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
                Some(_) => {
                    return Err(invalid(
                        "speculative.drafter",
                        "`speculative.drafter` must be a drafter plugin's name (or \"none\")",
                    ))
                }
            };
            let max_draft = match (m.get("n_max"), m.get("num_speculative_tokens")) {
                (Some(v), _) if !v.is_null() => Some(n(v, "speculative.n_max")?),
                (_, Some(v)) if !v.is_null() => Some(n(v, "speculative.num_speculative_tokens")?),
                _ => None,
            };
            if let Some(k) = m
                .keys()
                .find(|k| !["drafter", "n_max", "num_speculative_tokens"].contains(&k.as_str()))
            {
                return Err(invalid(
                    &format!("speculative.{k}"),
                    format!("`speculative.{k}` is not a speculative option (drafter, n_max)"),
                ));
            }
            Some(SpeculativeOptions { drafter, max_draft })
        }
        Some(_) => {
            return Err(invalid(
                "speculative",
                "`speculative` must be an object ({\"drafter\": ..., \"n_max\": ...}) or a boolean",
            ))
        }
    };
    if let Some(v) = obj.get("speculative.n_max").filter(|v| !v.is_null()) {
        let k = n(v, "speculative.n_max")?;
        out.get_or_insert(SpeculativeOptions {
            drafter: None,
            max_draft: None,
        })
        .max_draft = Some(k);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str) -> Result<Option<SpeculativeOptions>, String> {
        let v: Value = serde_json::from_str(body).map_err(|e| e.to_string())?;
        let obj = v.as_object().ok_or("not an object")?;
        speculative(obj).map_err(|e| e.param.unwrap_or_default())
    }

    fn opts(drafter: Option<&str>, max_draft: Option<u32>) -> Option<SpeculativeOptions> {
        Some(SpeculativeOptions {
            drafter: drafter.map(str::to_string),
            max_draft,
        })
    }

    #[test]
    fn reads_each_spelling_and_names_the_bad_field() {
        assert_eq!(parse("{}"), Ok(None));
        assert_eq!(parse(r#"{"speculative": null}"#), Ok(None));
        assert_eq!(
            parse(r#"{"speculative": false}"#),
            Ok(opts(Some("none"), None))
        );
        assert_eq!(parse(r#"{"speculative": true}"#), Ok(opts(None, None)));
        assert_eq!(
            parse(r#"{"speculative": {"drafter": "prompt-lookup", "n_max": 6}}"#),
            Ok(opts(Some("prompt-lookup"), Some(6)))
        );
        assert_eq!(
            parse(r#"{"speculative": {"num_speculative_tokens": 3}}"#),
            Ok(opts(None, Some(3)))
        );
        assert_eq!(
            parse(r#"{"speculative.n_max": 0}"#),
            Ok(opts(None, Some(0)))
        );
        assert_eq!(
            parse(r#"{"speculative": {"n_max": 65}}"#),
            Err("speculative.n_max".into())
        );
        assert_eq!(
            parse(r#"{"speculative": {"k": 3}}"#),
            Err("speculative.k".into())
        );
        assert_eq!(
            parse(r#"{"speculative": {"drafter": 3}}"#),
            Err("speculative.drafter".into())
        );
        assert_eq!(
            parse(r#"{"speculative": "yes"}"#),
            Err("speculative".into())
        );
    }
}
