//! JSON helpers: finding where a JSON object or array ends in a stream
//! (before it is complete, without a parser), lenient parsing, and reading
//! a call out of a `{"name": ..., "arguments": ...}` object.

use std::collections::BTreeMap;

use serde_json::value::RawValue;
use serde_json::Value;

/// Where a JSON object or array that starts at some offset ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scan {
    /// The value ends just before this offset (brackets balanced; the text
    /// may still be invalid JSON: parse it to know).
    Complete(usize),
    /// The text ends inside the value.
    Incomplete,
    /// Not JSON, whatever follows: a mismatched bracket, or a character
    /// that JSON never allows outside strings (e.g. `<`).
    Malformed,
}

/// Scans the object or array starting at `start`. Tracks only brackets and
/// strings, so it can tell "cut short" from "never JSON" on a prefix.
pub fn scan(s: &str, start: usize) -> Scan {
    let b = s.as_bytes();
    match b.get(start) {
        None => return Scan::Incomplete,
        Some(b'{' | b'[') => {}
        Some(_) => return Scan::Malformed,
    }
    let mut stack: Vec<u8> = Vec::new();
    let (mut in_string, mut escaped) = (false, false);
    for (i, &c) in b.iter().enumerate().skip(start) {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == b'\\' {
                escaped = true;
            } else if c == b'"' {
                in_string = false;
            }
            continue;
        }
        match c {
            b'"' => in_string = true,
            b'{' => stack.push(b'}'),
            b'[' => stack.push(b']'),
            b'}' | b']' => {
                if stack.pop() != Some(c) {
                    return Scan::Malformed;
                }
                if stack.is_empty() {
                    // `c` is ASCII, so `i + 1` is a char boundary.
                    return Scan::Complete(i + 1);
                }
            }
            // Whitespace, separators, numbers, and letters (true/false/null;
            // leniently any ASCII letter, which the parse rejects later).
            b' ' | b'\t' | b'\n' | b'\r' | b',' | b':' | b'-' | b'+' | b'.' => {}
            c if c.is_ascii_alphanumeric() => {}
            _ => return Scan::Malformed,
        }
    }
    Scan::Incomplete
}

/// `s` with raw control characters inside strings escaped (small models
/// write literal newlines in string values), or `None` when it has none.
fn escape_raw_controls(s: &str) -> Option<String> {
    let mut fixed = String::with_capacity(s.len() + 16);
    let (mut in_string, mut escaped, mut changed) = (false, false, false);
    for c in s.chars() {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            } else if (c as u32) < 0x20 {
                changed = true;
                match c {
                    '\n' => fixed.push_str("\\n"),
                    '\r' => fixed.push_str("\\r"),
                    '\t' => fixed.push_str("\\t"),
                    other => fixed.push_str(&format!("\\u{:04x}", other as u32)),
                }
                continue;
            }
        } else if c == '"' {
            in_string = true;
        }
        fixed.push(c);
    }
    changed.then_some(fixed)
}

/// Valid JSON text for `s`: `s` itself, or `s` with raw control characters
/// in strings escaped; `None` when neither parses.
fn valid_text(s: &str) -> Option<std::borrow::Cow<'_, str>> {
    if serde_json::from_str::<serde::de::IgnoredAny>(s).is_ok() {
        return Some(s.into());
    }
    let fixed = escape_raw_controls(s)?;
    serde_json::from_str::<serde::de::IgnoredAny>(&fixed).ok()?;
    Some(fixed.into())
}

/// Parses JSON, forgiving raw control characters inside strings.
pub fn parse_lenient(s: &str) -> Option<Value> {
    serde_json::from_str(&valid_text(s)?).ok()
}

/// Valid JSON text without the whitespace outside strings: compact, with
/// keys in the order the model wrote them (a parsed `Value` would sort them).
pub(crate) fn minify(valid: &str) -> String {
    let mut out = String::with_capacity(valid.len());
    let (mut in_string, mut escaped) = (false, false);
    for c in valid.chars() {
        if in_string {
            if escaped {
                escaped = false;
            } else if c == '\\' {
                escaped = true;
            } else if c == '"' {
                in_string = false;
            }
        } else if c == '"' {
            in_string = true;
        } else if c.is_whitespace() {
            continue;
        }
        out.push(c);
    }
    out
}

/// Compact JSON text of the object `s` (forgiving raw control characters in
/// strings), keys in their order; `None` unless `s` is one JSON object.
pub fn object_text(s: &str) -> Option<String> {
    let valid = valid_text(s)?;
    if !valid.trim_start().starts_with('{') {
        return None;
    }
    Some(minify(&valid))
}

/// Compact JSON text of an object given as (key, value) pairs, keys in
/// order; a repeated key keeps its first place and its last value.
pub fn ordered_object(pairs: Vec<(String, Value)>) -> String {
    let mut kept: Vec<(String, Value)> = Vec::with_capacity(pairs.len());
    for (k, v) in pairs {
        match kept.iter_mut().find(|(key, _)| *key == k) {
            Some(slot) => slot.1 = v,
            None => kept.push((k, v)),
        }
    }
    let fields: Vec<String> = kept
        .iter()
        .map(|(k, v)| {
            // Serializing strings and `Value`s cannot fail.
            let key = serde_json::to_string(k).unwrap_or_default();
            let value = serde_json::to_string(v).unwrap_or_else(|_| "null".into());
            format!("{key}:{value}")
        })
        .collect();
    format!("{{{}}}", fields.join(","))
}

/// Arguments as compact JSON text: an object as is, a string holding a JSON
/// object (OpenAI's own encoding), or absent/null for no arguments.
fn arguments_text(raw: Option<&RawValue>) -> Option<String> {
    let Some(raw) = raw else {
        return Some("{}".into());
    };
    let t = raw.get().trim();
    if t == "null" {
        return Some("{}".into());
    }
    if t.starts_with('{') {
        return Some(minify(t));
    }
    let inner: String = serde_json::from_str(t).ok()?;
    if inner.trim().is_empty() {
        return Some("{}".into());
    }
    object_text(&inner)
}

/// A call object's text: `{"name": "f", "arguments": {...}}`, with
/// `parameters` accepted for `arguments` (Llama 3), and OpenAI's wrapped
/// `{"type": "function", "function": {...}}`. Returns (name, arguments).
pub fn call_from_text(s: &str) -> Option<(String, String)> {
    let valid = valid_text(s)?;
    let obj: BTreeMap<String, Box<RawValue>> = serde_json::from_str(&valid).ok()?;
    if !obj.contains_key("name") {
        let inner = obj.get("function")?.get();
        return if inner.trim_start().starts_with('{') {
            call_from_text(inner)
        } else {
            None
        };
    }
    let name: String = serde_json::from_str(obj.get("name")?.get()).ok()?;
    let name = name.trim();
    if name.is_empty() {
        return None;
    }
    let raw = obj.get("arguments").or_else(|| obj.get("parameters"));
    let args = arguments_text(raw.map(|r| &**r))?;
    Some((name.to_string(), args))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scan_tells_cut_short_from_never_json() {
        assert_eq!(scan(r#"{"a": {"b": "}"}} tail"#, 0), Scan::Complete(17));
        assert_eq!(scan(r#"{"a": "\"}"#, 0), Scan::Incomplete);
        assert_eq!(scan(r#"{"a": [1}"#, 0), Scan::Malformed);
        assert_eq!(scan(r#"{"a": 1</tool_call>"#, 0), Scan::Malformed);
        assert_eq!(scan("x", 0), Scan::Malformed);
        assert_eq!(scan("", 0), Scan::Incomplete);
        assert_eq!(scan("{\"é\": 1}", 0), Scan::Complete(9));
    }

    #[test]
    fn arguments_in_every_spelling() {
        let f = call_from_text;
        assert_eq!(
            f(r#"{"name": "f", "arguments": {"b": 1, "a": 2}}"#),
            Some(("f".into(), r#"{"b":1,"a":2}"#.into()))
        );
        assert_eq!(
            f(r#"{"name": "f", "parameters": {"a": 1}}"#),
            Some(("f".into(), r#"{"a":1}"#.into()))
        );
        assert_eq!(
            f(r#"{"name": "f", "arguments": "{\"a\": 1}"}"#),
            Some(("f".into(), r#"{"a":1}"#.into()))
        );
        assert_eq!(f(r#"{"name": "f"}"#), Some(("f".into(), "{}".into())));
        assert_eq!(
            f(r#"{"type": "function", "function": {"name": "f", "arguments": {}}}"#),
            Some(("f".into(), "{}".into()))
        );
        assert_eq!(f(r#"{"name": "f", "arguments": [1]}"#), None);
        assert_eq!(f(r#"{"name": "f", "arguments": "nope"}"#), None);
        assert_eq!(f(r#"{"arguments": {}}"#), None);
    }

    #[test]
    fn raw_newlines_in_strings_are_forgiven() {
        assert_eq!(
            parse_lenient("{\"a\": \"x\ny\"}"),
            Some(serde_json::json!({"a": "x\ny"}))
        );
        assert_eq!(parse_lenient("{\"a\": }"), None);
        assert_eq!(
            object_text("{\"b\": \"x\ny\",\n \"a\": [1, 2]}"),
            Some("{\"b\":\"x\\ny\",\"a\":[1,2]}".into())
        );
        assert_eq!(object_text("[1]"), None);
        assert_eq!(
            ordered_object(vec![
                ("b".into(), Value::from(1)),
                ("a".into(), Value::from("x")),
                ("b".into(), Value::from(2))
            ]),
            "{\"b\":2,\"a\":\"x\"}"
        );
    }
}
