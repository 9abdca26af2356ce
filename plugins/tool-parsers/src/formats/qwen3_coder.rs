//! `qwen3-coder` (Qwen3-Coder, Qwen3.5): XML-style calls
//!
//! ```text
//! <tool_call>
//! <function=get_weather>
//! <parameter=city>
//! Paris
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! Parameter values are raw text: one leading and one trailing newline are
//! stripped, then the value is converted with the tool's JSON Schema type
//! for that parameter (see [`convert`]). Leniently, a value also ends at
//! the next `<parameter=` or at `</function>` when its `</parameter>` is
//! missing, a missing `</tool_call>` is forgiven, and a `<function=...>`
//! block without the `<tool_call>` wrapper is a call too.

use serde_json::Value;

use super::{failed_block, Attempt, Item, Tagged};
use crate::json;
use crate::text::{could_become, find, find_any, skip_ws};
use crate::tools::Tools;

const OPEN: &str = "<tool_call>";
const CLOSE: &str = "</tool_call>";
const FUNCTION: &str = "<function=";
const FUNCTION_END: &str = "</function>";
const PARAMETER: &str = "<parameter=";
const PARAMETER_END: &str = "</parameter>";
const MARKERS: &[&str] = &[OPEN, FUNCTION];

pub struct Qwen3Coder<'a> {
    pub tools: &'a Tools,
}

/// A step of parsing that may stop early.
enum Stop {
    /// The text ends before the block does.
    Short,
    /// The block is malformed at this offset.
    Bad(usize),
}

impl Tagged for Qwen3Coder<'_> {
    fn markers(&self) -> &'static [&'static str] {
        MARKERS
    }

    fn attempt(&self, text: &str, m: usize, partial: bool) -> Attempt {
        let wrapped = text[m..].starts_with(OPEN);
        // A wrapped block's own `<function=` does not end it; only the
        // next `<tool_call>` does.
        let (marker_len, close, next): (usize, &str, &[&str]) = if wrapped {
            (OPEN.len(), CLOSE, &[OPEN])
        } else {
            (FUNCTION.len(), FUNCTION_END, MARKERS)
        };
        let failed = |from: usize| failed_block(text, m, from, close, next, marker_len, partial);
        let start = if wrapped {
            skip_ws(text, m + OPEN.len())
        } else {
            m
        };
        let (name, params, p) = match function(text, start) {
            Ok(parsed) => parsed,
            Err(Stop::Short) if partial => return Attempt::Incomplete,
            Err(Stop::Short) => return failed(m + marker_len),
            Err(Stop::Bad(at)) => return failed(at),
        };
        let end = if wrapped {
            let q = skip_ws(text, p);
            let rest = &text[q..];
            if rest.starts_with(CLOSE) {
                q + CLOSE.len()
            } else if partial
                && (could_become(rest, CLOSE)
                    || could_become(rest, OPEN)
                    || could_become(rest, FUNCTION))
            {
                return Attempt::Incomplete;
            } else if could_become(rest, CLOSE) {
                text.len()
            } else {
                // Missing close tag: the function block is self-delimiting.
                p
            }
        } else {
            p
        };
        if !self.tools.allows(&name) {
            return Attempt::Invalid(end);
        }
        let args = params
            .into_iter()
            .map(|(key, raw)| {
                let value = convert(&raw, self.tools.param_types(&name, &key).as_deref());
                (key, value)
            })
            .collect();
        Attempt::Parsed(
            vec![Item::Call {
                name,
                arguments: json::ordered_object(args),
            }],
            end,
        )
    }
}

/// A parsed function block: name, raw (name, value) parameters in order,
/// and the offset after `</function>`.
type Function = (String, Vec<(String, String)>, usize);

/// Parses `<function=NAME>` ... `</function>` at `p`.
fn function(text: &str, p: usize) -> Result<Function, Stop> {
    let rest = &text[p..];
    if !rest.starts_with(FUNCTION) {
        return Err(if could_become(rest, FUNCTION) {
            Stop::Short
        } else {
            Stop::Bad(p)
        });
    }
    let (name, mut p) = tag_value(text, p + FUNCTION.len())?;
    let mut params = Vec::new();
    loop {
        p = skip_ws(text, p);
        let rest = &text[p..];
        if rest.starts_with(PARAMETER) {
            let (key, v) = tag_value(text, p + PARAMETER.len())?;
            let Some((end, which)) = find_any(text, v, &[PARAMETER_END, PARAMETER, FUNCTION_END])
            else {
                return Err(Stop::Short);
            };
            params.push((key, strip_newlines(&text[v..end]).to_string()));
            p = if which == 0 {
                end + PARAMETER_END.len()
            } else {
                end
            };
        } else if rest.starts_with(FUNCTION_END) {
            return Ok((name, params, p + FUNCTION_END.len()));
        } else if could_become(rest, PARAMETER) || could_become(rest, FUNCTION_END) {
            return Err(Stop::Short);
        } else {
            return Err(Stop::Bad(p));
        }
    }
}

/// The `NAME` of `<tag=NAME>` starting at `p` (after `=`), trimmed, and the
/// offset after `>`.
fn tag_value(text: &str, p: usize) -> Result<(String, usize), Stop> {
    let Some(gt) = find(text, p, ">") else {
        return if text[p..].contains(['<', '\n']) {
            Err(Stop::Bad(p))
        } else {
            Err(Stop::Short)
        };
    };
    let name = text[p..gt].trim();
    if name.is_empty() || name.contains(['<', '\n']) {
        return Err(Stop::Bad(p));
    }
    Ok((name.to_string(), gt + 1))
}

/// A value without one leading and one trailing newline.
fn strip_newlines(v: &str) -> &str {
    let v = v
        .strip_prefix("\r\n")
        .or_else(|| v.strip_prefix('\n'))
        .unwrap_or(v);
    v.strip_suffix("\r\n")
        .or_else(|| v.strip_suffix('\n'))
        .unwrap_or(v)
}

/// A raw parameter value as JSON, by the schema's types: `string` keeps the
/// text; `integer`/`number`/`boolean`/`object`/`array`/`null` take it when it
/// parses as such (types tried in the schema's order, `string` last); when
/// nothing matches, or the schema does not say, JSON if it parses, else the
/// text. (With a declared `string` type, text is never re-typed.)
pub fn convert(raw: &str, types: Option<&[String]>) -> Value {
    let Some(types) = types else {
        return serde_json::from_str(raw.trim()).unwrap_or_else(|_| Value::String(raw.to_string()));
    };
    let t = raw.trim();
    for ty in types {
        let v = match ty.as_str() {
            "integer" | "number" => serde_json::from_str::<Value>(t)
                .ok()
                .filter(Value::is_number),
            "boolean" => match t.to_ascii_lowercase().as_str() {
                "true" => Some(Value::Bool(true)),
                "false" => Some(Value::Bool(false)),
                _ => None,
            },
            "object" => json::parse_lenient(t).filter(Value::is_object),
            "array" => json::parse_lenient(t).filter(Value::is_array),
            "null" => matches!(t, "null" | "None").then_some(Value::Null),
            _ => None,
        };
        if let Some(v) = v {
            return v;
        }
    }
    if types.iter().any(|t| t == "string") {
        return Value::String(raw.to_string());
    }
    serde_json::from_str(t).unwrap_or_else(|_| Value::String(raw.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn types(t: &[&str]) -> Vec<String> {
        t.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn values_follow_the_schema() {
        assert_eq!(convert("5", Some(&types(&["integer"]))), json!(5));
        assert_eq!(convert("5", Some(&types(&["string"]))), json!("5"));
        assert_eq!(convert("2.5", Some(&types(&["number"]))), json!(2.5));
        assert_eq!(convert("True", Some(&types(&["boolean"]))), json!(true));
        assert_eq!(
            convert("{\"a\": [1]}", Some(&types(&["object"]))),
            json!({"a": [1]})
        );
        assert_eq!(convert("[1, 2]", Some(&types(&["array"]))), json!([1, 2]));
        assert_eq!(
            convert("null", Some(&types(&["string", "null"]))),
            json!(null)
        );
        assert_eq!(convert("many", Some(&types(&["integer"]))), json!("many"));
        assert_eq!(
            convert("  spaced ", Some(&types(&["string"]))),
            json!("  spaced ")
        );
        assert_eq!(convert("7", None), json!(7));
        assert_eq!(convert("Paris", None), json!("Paris"));
        assert_eq!(convert("[1, 2]", None), json!([1, 2]));
    }

    #[test]
    fn one_newline_each_side() {
        assert_eq!(strip_newlines("\n\nx\n\n"), "\nx\n");
        assert_eq!(strip_newlines("x"), "x");
    }
}
