//! What a request asks for (WIT `types.grammar`) as llguidance's grammar.

use llguidance::api::TopLevelGrammar;
use serde_json::{json, Value};

/// A request's grammar, natively (mirrors WIT `types.grammar`).
#[derive(Debug, Clone, PartialEq)]
pub enum Grammar {
    /// A JSON Schema as JSON text.
    JsonSchema(String),
    /// Any JSON object.
    JsonObject,
    /// A regular expression for the whole output.
    Regex(String),
    /// A Lark grammar (llguidance's dialect).
    Lark(String),
    /// One of these strings.
    Choice(Vec<String>),
}

/// The plugin's options (`extra`: `[defaults]` under the request's
/// `plugin_params.grammar`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Options {
    /// Let JSON carry any whitespace between tokens (llguidance's
    /// `whitespace_flexible`). Off by default: a small model given free
    /// whitespace can write newlines forever and never close the object
    /// (Ollama#18567's outputs that never end); compact `, ` / `: `
    /// separators always make progress.
    pub whitespace_flexible: bool,
}

impl Options {
    /// Reads `extra` (a JSON object). Errors name the bad key.
    pub fn parse(extra: &str) -> Result<Self, String> {
        let value: Value = if extra.trim().is_empty() {
            json!({})
        } else {
            serde_json::from_str(extra).map_err(|e| format!("parameters are not JSON: {e}"))?
        };
        let Value::Object(map) = value else {
            return Err("parameters must be a JSON object".into());
        };
        let mut o = Options::default();
        for (k, v) in &map {
            match k.as_str() {
                "whitespace_flexible" => {
                    o.whitespace_flexible = v
                        .as_bool()
                        .ok_or("`whitespace_flexible` must be true or false")?
                }
                other => return Err(format!("unknown parameter `{other}`")),
            }
        }
        Ok(o)
    }
}

/// The llguidance grammar for `g`. Errors: a JSON Schema that is not JSON,
/// an empty choice list (messages name the problem).
pub fn top_level(g: &Grammar, opts: &Options) -> Result<TopLevelGrammar, String> {
    Ok(match g {
        Grammar::JsonSchema(text) => {
            let schema: Value = serde_json::from_str(text)
                .map_err(|e| format!("the JSON Schema is not valid JSON: {e}"))?;
            TopLevelGrammar::from_json_schema(with_layout(schema, opts))
        }
        Grammar::JsonObject => {
            TopLevelGrammar::from_json_schema(with_layout(json!({"type": "object"}), opts))
        }
        Grammar::Regex(rx) => TopLevelGrammar::from_regex(rx),
        Grammar::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        Grammar::Choice(choices) => {
            if choices.is_empty() {
                return Err("the choice list is empty".into());
            }
            // Each choice as a literal (regex-escaped), any one of them.
            let alternatives: Vec<String> =
                choices.iter().map(|c| regex_syntax::escape(c)).collect();
            TopLevelGrammar::from_regex(&format!("(?:{})", alternatives.join("|")))
        }
    })
}

/// The JSON layout llguidance should enforce (its `x-guidance` options),
/// unless the schema sets its own: compact separators with one space, as
/// `json.dumps` writes and models are trained on.
fn with_layout(mut schema: Value, opts: &Options) -> Value {
    if let Value::Object(map) = &mut schema {
        if !map.contains_key("x-guidance") {
            map.insert(
                "x-guidance".into(),
                json!({
                    "whitespace_flexible": opts.whitespace_flexible,
                    "item_separator": ", ",
                    "key_separator": ": ",
                }),
            );
        }
    }
    schema
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_name_their_errors() {
        assert_eq!(Options::parse("{}"), Ok(Options::default()));
        assert!(
            Options::parse(r#"{"whitespace_flexible": true}"#)
                .expect("ok")
                .whitespace_flexible
        );
        assert!(Options::parse(r#"{"whitespace": 1}"#)
            .unwrap_err()
            .contains("`whitespace`"));
        assert!(Options::parse("[]").is_err());
    }

    #[test]
    fn schemas_get_the_layout_unless_they_set_one() {
        let o = Options::default();
        let g = top_level(&Grammar::JsonSchema(r#"{"type": "integer"}"#.into()), &o).expect("ok");
        let s = g.grammars[0].json_schema.as_ref().expect("schema");
        assert_eq!(s["x-guidance"]["whitespace_flexible"], json!(false));
        let own = r#"{"type": "integer", "x-guidance": {"whitespace_flexible": true}}"#;
        let g = top_level(&Grammar::JsonSchema(own.into()), &o).expect("ok");
        let s = g.grammars[0].json_schema.as_ref().expect("schema");
        assert_eq!(s["x-guidance"], json!({"whitespace_flexible": true}));
    }

    #[test]
    fn bad_inputs_are_errors() {
        let o = Options::default();
        assert!(top_level(&Grammar::JsonSchema("{".into()), &o)
            .unwrap_err()
            .contains("not valid JSON"));
        assert!(top_level(&Grammar::Choice(vec![]), &o).is_err());
    }
}
