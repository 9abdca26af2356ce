//! The sessions' `extra` parameters (manifest `[defaults]` merged under the
//! request's `plugin_params.<plugin>`).
//!
//! Tool-call parsers: `format` (one of [`Format::ALL`]'s names; the
//! manifests set it; `hermes` when absent) and `id_salt` (a string mixed
//! into call ids, e.g. a request id, so that equal outputs of different
//! requests get different ids; default empty). The reasoning parser:
//! `format` (`think`, the default, or `harmony`), and for `harmony` also
//! `id_salt` (ignored: one `harmony` plugin folder serves both kinds, so
//! its `plugin_params` reach both sessions). Any other key is an error
//! naming it.

use serde_json::{Map, Value};

use crate::formats::Format;

/// A tool-call parser session's parameters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOptions {
    pub format: Format,
    pub id_salt: String,
}

fn object(extra: &str) -> Result<Map<String, Value>, String> {
    if extra.trim().is_empty() {
        return Ok(Map::new());
    }
    match serde_json::from_str(extra) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(other) => Err(format!("parameters must be a JSON object, got {other}")),
        Err(e) => Err(format!("parameters are not JSON: {e}")),
    }
}

fn string<'a>(map: &'a Map<String, Value>, key: &str) -> Result<Option<&'a str>, String> {
    match map.get(key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(other) => Err(format!("`{key}` must be a string, got {other}")),
    }
}

/// Parses a tool-call parser's `extra`.
pub fn tool_options(extra: &str) -> Result<ToolOptions, String> {
    let map = object(extra)?;
    if let Some(k) = map
        .keys()
        .find(|k| !matches!(k.as_str(), "format" | "id_salt"))
    {
        return Err(format!(
            "unknown parameter `{k}` (tool-call parsers take `format`, `id_salt`)"
        ));
    }
    let names = || {
        Format::ALL
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join(", ")
    };
    let format = match string(&map, "format")? {
        None => Format::Hermes,
        Some(name) => Format::from_name(name)
            .ok_or_else(|| format!("unknown `format` `{name}` (one of {})", names()))?,
    };
    let id_salt = string(&map, "id_salt")?.unwrap_or("").to_string();
    Ok(ToolOptions { format, id_salt })
}

/// The reasoning formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningFormat {
    /// `<think>...</think>` ([`crate::think`]).
    Think,
    /// gpt-oss's analysis channel ([`crate::harmony`]).
    Harmony,
}

/// Parses a reasoning parser's `extra`.
pub fn reasoning_options(extra: &str) -> Result<ReasoningFormat, String> {
    let map = object(extra)?;
    let format = match string(&map, "format")? {
        None | Some("think") => ReasoningFormat::Think,
        Some("harmony") => ReasoningFormat::Harmony,
        Some(other) => {
            return Err(format!(
                "unknown `format` `{other}` for the reasoning parser (`think` or `harmony`)"
            ))
        }
    };
    let allowed = |k: &str| k == "format" || (format == ReasoningFormat::Harmony && k == "id_salt");
    if let Some(k) = map.keys().find(|k| !allowed(k)) {
        return Err(format!(
            "unknown parameter `{k}` (the reasoning parser takes `format`)"
        ));
    }
    string(&map, "id_salt")?;
    Ok(format)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_and_their_errors() {
        assert_eq!(tool_options("{}").unwrap().format, Format::Hermes);
        assert_eq!(tool_options("").unwrap().format, Format::Hermes);
        let o = tool_options(r#"{"format": "qwen3-coder", "id_salt": "req-1"}"#).unwrap();
        assert_eq!(
            (o.format, o.id_salt.as_str()),
            (Format::Qwen3Coder, "req-1")
        );
        assert!(tool_options(r#"{"format": "xml"}"#)
            .unwrap_err()
            .contains("`format`"));
        assert!(tool_options(r#"{"format": 1}"#)
            .unwrap_err()
            .contains("`format`"));
        assert!(tool_options(r#"{"fromat": "hermes"}"#)
            .unwrap_err()
            .contains("`fromat`"));
        assert!(tool_options("[]").unwrap_err().contains("object"));
        assert_eq!(
            reasoning_options(r#"{"format": "think"}"#),
            Ok(ReasoningFormat::Think)
        );
        assert_eq!(
            reasoning_options(r#"{"format": "harmony", "id_salt": "r"}"#),
            Ok(ReasoningFormat::Harmony)
        );
        assert!(reasoning_options(r#"{"format": "think", "id_salt": "r"}"#)
            .unwrap_err()
            .contains("`id_salt`"));
        assert_eq!(
            tool_options(r#"{"format": "harmony"}"#).unwrap().format,
            Format::Harmony
        );
        assert!(reasoning_options(r#"{"format": "hermes"}"#)
            .unwrap_err()
            .contains("`format`"));
        assert!(reasoning_options(r#"{"x": 1}"#)
            .unwrap_err()
            .contains("`x`"));
    }
}
