//! Strict tools (`strict: true`) when the reply must be a tool call
//! (`tool_choice` `required` or a named function): the reply is constrained
//! by a grammar over the tool-call parser's own call syntax, so the
//! arguments match the tool's `parameters` schema token by token.
//!
//! The host already prefills what the forced calls' prefixes share (e.g.
//! hermes' `<tool_call>\n{"name": "`); the grammar covers the rest: one
//! alternative per allowed function, each the rest of its prefix (the
//! function's name and what follows up to the arguments), then its
//! arguments (`%json` of its schema when strict, any object otherwise), then
//! the call's closing syntax, then free text (a further call, or EOS). The
//! parser's WIT gives only the call prefix, so the closing is derived from
//! it: every JSON bracket and `<tag>` the prefix opened, closed in reverse
//! (hermes' `<tool_call>\n{"name": "f", "arguments": ` closes with
//! `}\n</tool_call>`; whitespace between the closers is free). Only formats
//! whose arguments are a JSON value inside the call's JSON object are
//! covered (hermes, llama3-json, mistral); for others (qwen3-coder's XML
//! parameters, pythonic) no grammar is made and the first-token mask stays.
//! This replaces the first-token mask of [`crate::engine::constrain`] for
//! that request.

use crate::output::ToolDefinition;
use crate::plugin::constraint::Grammar;

/// One function the reply may call: the rest of its call prefix after the
/// prefilled text, and its name.
#[derive(Debug, Clone, PartialEq)]
pub struct CallAlternative {
    /// The rest of the parser's call prefix for it (may be empty).
    pub rest: String,
    /// The function's name.
    pub name: String,
}

/// A Lark string literal for `text` (JSON's escapes, which llguidance's
/// Lark reads).
fn literal(text: &str) -> String {
    serde_json::Value::String(text.to_string()).to_string()
}

/// What a call prefix left open, innermost last.
#[derive(Debug, Clone, PartialEq)]
enum Open {
    /// `{` or `[`: closed by `}` / `]`.
    Bracket(char),
    /// `<name>`: closed by `</name>`.
    Tag(String),
}

/// What `prefix` left open (JSON brackets outside strings, `<tag>`s
/// outside JSON), or `None` when it cannot be read (a closer that does not
/// match).
fn open_in(prefix: &str) -> Option<Vec<Open>> {
    let mut stack: Vec<Open> = Vec::new();
    let mut chars = prefix.char_indices().peekable();
    let in_json = |stack: &[Open]| matches!(stack.last(), Some(Open::Bracket(_)));
    while let Some((i, c)) = chars.next() {
        match c {
            '"' if in_json(&stack) => {
                // Skip the string, escapes included.
                let mut escaped = false;
                for (_, c) in chars.by_ref() {
                    match (escaped, c) {
                        (true, _) => escaped = false,
                        (false, '\\') => escaped = true,
                        (false, '"') => break,
                        _ => {}
                    }
                }
            }
            '{' | '[' => stack.push(Open::Bracket(c)),
            '}' | ']' => {
                let want = if c == '}' { '{' } else { '[' };
                if stack.pop() != Some(Open::Bracket(want)) {
                    return None;
                }
            }
            '<' if !in_json(&stack) => {
                let end = prefix[i..].find('>')? + i;
                let tag = &prefix[i + 1..end];
                if let Some(name) = tag.strip_prefix('/') {
                    if stack.pop() != Some(Open::Tag(name.to_string())) {
                        return None;
                    }
                } else if !tag.is_empty() && !tag.contains([' ', '=', '/']) {
                    stack.push(Open::Tag(tag.to_string()));
                }
                while chars.peek().is_some_and(|(j, _)| *j <= end) {
                    chars.next();
                }
            }
            _ => {}
        }
    }
    Some(stack)
}

/// The Lark sequence that closes what `prefix` opened, with optional
/// whitespace before each closer; `None` unless the prefix ends inside a
/// JSON object (where the arguments are a JSON value).
fn closing(prefix: &str) -> Option<String> {
    let open = open_in(prefix)?;
    if open.last() != Some(&Open::Bracket('{')) {
        return None;
    }
    let closers: Vec<String> = open
        .iter()
        .rev()
        .map(|o| match o {
            Open::Bracket('{') => "}".to_string(),
            Open::Bracket(_) => "]".to_string(),
            Open::Tag(t) => format!("</{t}>"),
        })
        .map(|c| format!("WS {}", literal(&c)))
        .collect();
    Some(closers.join(" "))
}

/// The grammar for `alternatives` after the prefilled text `prefilled`, or
/// `None` when none of their tools is in `strict` or the call format's
/// arguments are not JSON (the first-token mask then stays). Errors: a
/// strict tool's `parameters` are not JSON (adapters check they are
/// objects).
pub fn call_grammar(
    prefilled: &str,
    alternatives: &[CallAlternative],
    tools: &[ToolDefinition],
    strict: &[String],
) -> Result<Option<Grammar>, String> {
    if !alternatives.iter().any(|a| strict.contains(&a.name)) {
        return Ok(None);
    }
    let mut rules = Vec::new();
    let mut calls = Vec::new();
    for (i, a) in alternatives.iter().enumerate() {
        let schema = match tools.iter().find(|t| t.name == a.name) {
            Some(t) if strict.contains(&a.name) => {
                let v: serde_json::Value = serde_json::from_str(&t.parameters_json)
                    .map_err(|e| format!("tool `{}`: `parameters` is not JSON: {e}", a.name))?;
                v.to_string()
            }
            _ => r#"{"type": "object"}"#.to_string(),
        };
        let head = if a.rest.is_empty() {
            String::new()
        } else {
            format!("{} ", literal(&a.rest))
        };
        let Some(close) = closing(&format!("{prefilled}{}", a.rest)) else {
            return Ok(None);
        };
        calls.push(format!("call_{i}"));
        rules.push(format!("call_{i}: {head}args_{i} {close} tail"));
        rules.push(format!("args_{i}: %json {schema}"));
    }
    let mut lark = format!("start: {}\n", calls.join(" | "));
    for r in rules {
        lark.push_str(&r);
        lark.push('\n');
    }
    // After the call, anything: EOS, or a further call when parallel calls
    // are allowed.
    lark.push_str("tail: /(?s:.*)/\nWS: /[ \\t\\n]*/\n");
    Ok(Some(Grammar::Lark(lark)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tool(name: &str, params: &str) -> ToolDefinition {
        ToolDefinition {
            name: name.into(),
            parameters_json: params.into(),
            description: String::new(),
        }
    }

    #[test]
    fn strict_tools_get_their_schema_others_any_object() {
        let tools = [
            tool(
                "get_weather",
                r#"{"type": "object", "properties": {"city": {"type": "string"}}}"#,
            ),
            tool("other", r#"{"type": "object", "properties": {"x": {}}}"#),
        ];
        let alts = [
            CallAlternative {
                rest: "get_weather\", \"arguments\": ".into(),
                name: "get_weather".into(),
            },
            CallAlternative {
                rest: "other\", \"arguments\": ".into(),
                name: "other".into(),
            },
        ];
        let prefilled = "<tool_call>\n{\"name\": \"";
        let Some(Grammar::Lark(g)) =
            call_grammar(prefilled, &alts, &tools, &["get_weather".into()]).expect("ok")
        else {
            panic!("a grammar");
        };
        assert!(g.starts_with("start: call_0 | call_1\n"), "{g}");
        assert!(
            g.contains(
                r#"call_0: "get_weather\", \"arguments\": " args_0 WS "}" WS "</tool_call>" tail"#
            ),
            "{g}"
        );
        assert!(
            g.contains(
                r#"args_0: %json {"type":"object","properties":{"city":{"type":"string"}}}"#
            ),
            "{g}"
        );
        assert!(g.contains(r#"args_1: %json {"type": "object"}"#), "{g}");
        assert!(call_grammar(prefilled, &alts, &tools, &[])
            .expect("ok")
            .is_none());
    }

    #[test]
    fn a_named_call_with_its_whole_prefix_prefilled_has_no_literal() {
        let tools = [tool("f", r#"{"type": "object"}"#)];
        let alts = [CallAlternative {
            rest: String::new(),
            name: "f".into(),
        }];
        let prefix = "[TOOL_CALLS][{\"name\": \"f\", \"arguments\": ";
        let Some(Grammar::Lark(g)) =
            call_grammar(prefix, &alts, &tools, &["f".into()]).expect("ok")
        else {
            panic!("a grammar");
        };
        assert!(g.contains(r#"call_0: args_0 WS "}" WS "]" tail"#), "{g}");
        let bad = [tool("f", "{nope")];
        assert!(call_grammar(prefix, &alts, &bad, &["f".into()]).is_err());
    }

    #[test]
    fn formats_whose_arguments_are_not_json_get_no_grammar() {
        let tools = [tool("f", r#"{"type": "object"}"#)];
        let alts = [CallAlternative {
            rest: String::new(),
            name: "f".into(),
        }];
        let strict = ["f".to_string()];
        // qwen3-coder's XML parameters, pythonic calls.
        for prefix in ["<tool_call>\n<function=f>\n", "[f("] {
            assert!(
                call_grammar(prefix, &alts, &tools, &strict)
                    .expect("ok")
                    .is_none(),
                "{prefix}"
            );
        }
    }

    #[test]
    fn open_brackets_skip_strings_and_tags() {
        assert_eq!(
            open_in(r#"<a>{"x": "}{<b>", "y": ["#),
            Some(vec![
                Open::Tag("a".into()),
                Open::Bracket('{'),
                Open::Bracket('[')
            ])
        );
        assert_eq!(open_in("<a></b>"), None);
    }
}
