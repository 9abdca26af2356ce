//! Structured-output request fields of each dialect, as the WIT 0.3.0
//! `structured-output.output-constraint` an adapter attaches to its request
//! (`constrain`). Feature `json`. Every rejection names the field as the
//! dialect spells it.
//!
//! | dialect | field | grammar |
//! |---|---|---|
//! | OpenAI Chat Completions | `response_format` `{"type": "json_object"}` / `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}` | [`chat_response_format`] |
//! | OpenAI Responses | `text.format` `{"type": "json_schema", "name", "schema", "strict"}` / `{"type": "json_object"}` | [`responses_text_format`] |
//! | OpenAI Completions (vLLM's extension) | `structured_outputs` `{"json" \| "regex" \| "choice" \| "grammar" \| "json_object"}`; older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` | [`vllm_structured_outputs`] |
//! | Anthropic Messages | `output_config.format` `{"type": "json_schema", "schema"}`; the beta's `output_format` (same shape) | [`anthropic_output_format`] |

use serde_json::{Map, Value};

use crate::fields::{invalid, Invalid};
pub use crate::v3::structured_output::mlxhost::plugin0_3_0::structured_output::OutputConstraint;
pub use crate::v3::structured_output::mlxhost::plugin0_3_0::types::Grammar;

fn constraint(grammar: Grammar, field: &str) -> OutputConstraint {
    OutputConstraint {
        grammar,
        field: field.to_string(),
        plugin: None,
    }
}

/// A JSON Schema given as an object (or a boolean, JSON Schema's `true` /
/// `false`), as text. Errors name `field`.
fn schema_text(value: Option<&Value>, field: &str) -> Result<String, Invalid> {
    match value {
        Some(v @ (Value::Object(_) | Value::Bool(_))) => Ok(v.to_string()),
        Some(_) => Err(invalid(
            field,
            format!("`{field}` must be a JSON Schema object"),
        )),
        None => Err(invalid(field, format!("`{field}` is required"))),
    }
}

/// `type` of a format object; errors name `field.type`.
fn format_type<'a>(o: &'a Map<String, Value>, field: &str) -> Result<&'a str, Invalid> {
    match o.get("type") {
        Some(Value::String(t)) => Ok(t),
        _ => Err(invalid(
            &format!("{field}.type"),
            format!("`{field}.type` must be a string"),
        )),
    }
}

/// `strict` when present must be a boolean. Every schema is enforced
/// whatever it says: `strict: false` asks for less than is given.
fn check_strict(o: &Map<String, Value>, field: &str) -> Result<(), Invalid> {
    match o.get("strict") {
        None | Some(Value::Null) | Some(Value::Bool(_)) => Ok(()),
        Some(_) => Err(invalid(
            &format!("{field}.strict"),
            format!("`{field}.strict` must be a boolean"),
        )),
    }
}

/// OpenAI Chat Completions `response_format`: `text` (none), `json_object`,
/// or `json_schema` with `json_schema.schema` (`name` required as OpenAI
/// requires it; `strict` accepted, the schema is always enforced).
pub fn chat_response_format(value: Option<&Value>) -> Result<Option<OutputConstraint>, Invalid> {
    const P: &str = "response_format";
    let o = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(_) => return Err(invalid(P, "`response_format` must be an object")),
    };
    match format_type(o, P)? {
        "text" => Ok(None),
        "json_object" => Ok(Some(constraint(Grammar::JsonObject, P))),
        "json_schema" => {
            let js =
                match o.get("json_schema") {
                    Some(Value::Object(js)) => js,
                    _ => return Err(invalid(
                        "response_format.json_schema",
                        "`response_format.json_schema` must be an object with `name` and `schema`",
                    )),
                };
            match js.get("name") {
                Some(Value::String(n)) if !n.is_empty() => {}
                _ => {
                    return Err(invalid(
                        "response_format.json_schema.name",
                        "`response_format.json_schema.name` must be a non-empty string",
                    ))
                }
            }
            check_strict(js, "response_format.json_schema")?;
            // OpenAI allows the schema to be left out (any JSON object).
            let grammar = match js.get("schema") {
                None | Some(Value::Null) => Grammar::JsonObject,
                v => Grammar::JsonSchema(schema_text(v, "response_format.json_schema.schema")?),
            };
            Ok(Some(constraint(grammar, P)))
        }
        t => Err(invalid(
            "response_format.type",
            format!(
                "`response_format.type` must be `text`, `json_object` or `json_schema`, got `{t}`"
            ),
        )),
    }
}

/// OpenAI Responses `text.format`: `text` (none), `json_object`, or
/// `json_schema` with `name` and `schema` beside `type`.
pub fn responses_text_format(text: Option<&Value>) -> Result<Option<OutputConstraint>, Invalid> {
    const P: &str = "text.format";
    let text = match text {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(t)) => t,
        Some(_) => return Err(invalid("text", "`text` must be an object")),
    };
    let o = match text.get("format") {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(_) => return Err(invalid(P, "`text.format` must be an object")),
    };
    match format_type(o, P)? {
        "text" => Ok(None),
        "json_object" => Ok(Some(constraint(Grammar::JsonObject, P))),
        "json_schema" => {
            match o.get("name") {
                Some(Value::String(n)) if !n.is_empty() => {}
                _ => {
                    return Err(invalid(
                        "text.format.name",
                        "`text.format.name` must be a non-empty string",
                    ))
                }
            }
            check_strict(o, P)?;
            let schema = schema_text(o.get("schema"), "text.format.schema")?;
            Ok(Some(constraint(Grammar::JsonSchema(schema), P)))
        }
        t => Err(invalid(
            "text.format.type",
            format!("`text.format.type` must be `text`, `json_object` or `json_schema`, got `{t}`"),
        )),
    }
}

/// A list of strings (`guided_choice`, `structured_outputs.choice`).
fn choices(value: &Value, field: &str) -> Result<Vec<String>, Invalid> {
    let items = value.as_array().filter(|a| !a.is_empty()).ok_or_else(|| {
        invalid(
            field,
            format!("`{field}` must be a non-empty array of strings"),
        )
    })?;
    items
        .iter()
        .map(|c| {
            c.as_str().map(str::to_string).ok_or_else(|| {
                invalid(
                    field,
                    format!("`{field}` must be a non-empty array of strings"),
                )
            })
        })
        .collect()
}

/// A JSON Schema given as an object or as JSON text (vLLM takes both).
fn schema_or_text(value: &Value, field: &str) -> Result<String, Invalid> {
    match value {
        Value::String(s) => match serde_json::from_str::<Value>(s) {
            Ok(v @ (Value::Object(_) | Value::Bool(_))) => Ok(v.to_string()),
            _ => Err(invalid(
                field,
                format!("`{field}` must be a JSON Schema (an object, or its JSON text)"),
            )),
        },
        v => schema_text(Some(v), field),
    }
}

fn text(value: &Value, field: &str) -> Result<String, Invalid> {
    match value {
        Value::String(s) if !s.is_empty() => Ok(s.clone()),
        _ => Err(invalid(
            field,
            format!("`{field}` must be a non-empty string"),
        )),
    }
}

/// vLLM's Completions (and Chat) extension: `structured_outputs` (an object
/// with exactly one of `json`, `regex`, `choice`, `grammar`, `json_object`)
/// or the older top-level `guided_json`, `guided_regex`, `guided_choice`,
/// `guided_grammar`. Grammars are Lark (llguidance's dialect, as vLLM's
/// `guidance` backend takes them). At most one may be given.
pub fn vllm_structured_outputs(
    obj: &Map<String, Value>,
) -> Result<Option<OutputConstraint>, Invalid> {
    let mut found: Vec<OutputConstraint> = Vec::new();
    if let Some(v) = obj.get("structured_outputs").filter(|v| !v.is_null()) {
        const P: &str = "structured_outputs";
        let so = v
            .as_object()
            .ok_or_else(|| invalid(P, "`structured_outputs` must be an object"))?;
        for (key, value) in so.iter().filter(|(_, v)| !v.is_null()) {
            let field = format!("{P}.{key}");
            let grammar = match key.as_str() {
                "json" => Grammar::JsonSchema(schema_or_text(value, &field)?),
                "regex" => Grammar::Regex(text(value, &field)?),
                "choice" => Grammar::Choice(choices(value, &field)?),
                "grammar" => Grammar::Lark(text(value, &field)?),
                "json_object" => match value {
                    Value::Bool(true) => Grammar::JsonObject,
                    Value::Bool(false) => continue,
                    _ => return Err(invalid(&field, format!("`{field}` must be a boolean"))),
                },
                // Options of vLLM's engines that change nothing here.
                "disable_fallback" | "disable_any_whitespace" | "disable_additional_properties"
                | "whitespace_pattern" => continue,
                other => {
                    return Err(invalid(
                        &field,
                        format!("`{P}.{other}` is not supported (json, regex, choice, grammar, json_object)"),
                    ))
                }
            };
            found.push(constraint(grammar, &field));
        }
    }
    for key in [
        "guided_json",
        "guided_regex",
        "guided_choice",
        "guided_grammar",
    ] {
        let Some(value) = obj.get(key).filter(|v| !v.is_null()) else {
            continue;
        };
        let grammar = match key {
            "guided_json" => Grammar::JsonSchema(schema_or_text(value, key)?),
            "guided_regex" => Grammar::Regex(text(value, key)?),
            "guided_choice" => Grammar::Choice(choices(value, key)?),
            _ => Grammar::Lark(text(value, key)?),
        };
        found.push(constraint(grammar, key));
    }
    if found.len() > 1 {
        let names: Vec<&str> = found.iter().map(|c| c.field.as_str()).collect();
        return Err(invalid(
            &found[1].field,
            format!(
                "give one structured output constraint, not several ({})",
                names.join(", ")
            ),
        ));
    }
    Ok(found.pop())
}

/// Anthropic Messages: `output_config.format` (`{"type": "json_schema",
/// "schema": {...}}`), or the structured-outputs beta's top-level
/// `output_format` of the same shape, which Anthropic still accepts.
pub fn anthropic_output_format(
    obj: &Map<String, Value>,
) -> Result<Option<OutputConstraint>, Invalid> {
    let (field, value) = match obj.get("output_config") {
        Some(Value::Object(cfg)) if cfg.get("format").is_some_and(|f| !f.is_null()) => {
            ("output_config.format", cfg.get("format"))
        }
        _ => ("output_format", obj.get("output_format")),
    };
    let o = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(o)) => o,
        Some(_) => return Err(invalid(field, format!("`{field}` must be an object"))),
    };
    match format_type(o, field)? {
        "json_schema" => {
            let schema = schema_text(o.get("schema"), &format!("{field}.schema"))?;
            Ok(Some(constraint(Grammar::JsonSchema(schema), field)))
        }
        t => Err(invalid(
            &format!("{field}.type"),
            format!("`{field}.type` must be `json_schema`, got `{t}`"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().expect("object")
    }

    #[test]
    fn chat_response_format_types() {
        assert!(chat_response_format(None).expect("none").is_none());
        assert!(chat_response_format(Some(&json!({"type": "text"})))
            .expect("text")
            .is_none());
        let c = chat_response_format(Some(&json!({"type": "json_object"})))
            .expect("ok")
            .expect("some");
        assert_eq!(
            (c.grammar, c.field.as_str()),
            (Grammar::JsonObject, "response_format")
        );
        let c = chat_response_format(Some(&json!({"type": "json_schema",
            "json_schema": {"name": "x", "strict": true, "schema": {"type": "integer"}}})))
        .expect("ok")
        .expect("some");
        assert_eq!(
            c.grammar,
            Grammar::JsonSchema(r#"{"type":"integer"}"#.into())
        );
        let e = chat_response_format(Some(
            &json!({"type": "json_schema", "json_schema": {"schema": {}}}),
        ))
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("response_format.json_schema.name"));
        let e = chat_response_format(Some(&json!({"type": "yaml"}))).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("response_format.type"));
    }

    #[test]
    fn responses_text_format_types() {
        let c = responses_text_format(Some(&json!({"format": {"type": "json_schema",
            "name": "n", "schema": {"type": "object"}}})))
        .expect("ok")
        .expect("some");
        assert_eq!(c.field, "text.format");
        assert!(
            responses_text_format(Some(&json!({"format": {"type": "text"}})))
                .expect("ok")
                .is_none()
        );
        let e = responses_text_format(Some(
            &json!({"format": {"type": "json_schema", "name": "n"}}),
        ))
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("text.format.schema"));
    }

    #[test]
    fn vllm_fields_both_spellings() {
        let c = vllm_structured_outputs(&obj(json!({"guided_choice": ["a", "b"]})))
            .expect("ok")
            .expect("some");
        assert_eq!(c.grammar, Grammar::Choice(vec!["a".into(), "b".into()]));
        let c = vllm_structured_outputs(&obj(
            json!({"structured_outputs": {"json": "{\"type\": \"string\"}"}}),
        ))
        .expect("ok")
        .expect("some");
        assert_eq!(
            (c.grammar, c.field.as_str()),
            (
                Grammar::JsonSchema(r#"{"type":"string"}"#.into()),
                "structured_outputs.json"
            )
        );
        let c = vllm_structured_outputs(&obj(json!({"guided_regex": "[0-9]+"})))
            .expect("ok")
            .expect("some");
        assert_eq!(c.grammar, Grammar::Regex("[0-9]+".into()));
        let c = vllm_structured_outputs(&obj(json!({"guided_grammar": "start: \"x\""})))
            .expect("ok")
            .expect("some");
        assert_eq!(c.grammar, Grammar::Lark("start: \"x\"".into()));
        let e = vllm_structured_outputs(&obj(json!({"guided_regex": "a", "guided_json": {}})))
            .unwrap_err();
        assert!(e.message.contains("not several"), "{}", e.message);
        let e =
            vllm_structured_outputs(&obj(json!({"structured_outputs": {"structural_tag": "x"}})))
                .unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("structured_outputs.structural_tag")
        );
        assert!(vllm_structured_outputs(&obj(json!({})))
            .expect("ok")
            .is_none());
    }

    #[test]
    fn anthropic_fields() {
        let c = anthropic_output_format(&obj(json!({"output_config": {"effort": "low",
            "format": {"type": "json_schema", "schema": {"type": "object"}}}})))
        .expect("ok")
        .expect("some");
        assert_eq!(c.field, "output_config.format");
        let c = anthropic_output_format(&obj(json!({"output_format": {"type": "json_schema",
            "schema": {"type": "object"}}})))
        .expect("ok")
        .expect("some");
        assert_eq!(c.field, "output_format");
        // `output_config` without a format (Claude Code's effort) asks for nothing.
        assert!(
            anthropic_output_format(&obj(json!({"output_config": {"effort": "high"}})))
                .expect("ok")
                .is_none()
        );
        let e =
            anthropic_output_format(&obj(json!({"output_config": {"format": {"type": "xml"}}})))
                .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("output_config.format.type"));
    }
}
