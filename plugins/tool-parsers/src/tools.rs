//! The request's declared tools, as the parsers need them.

use serde_json::Value;

/// Declared functions and their argument schemas.
#[derive(Debug, Default, Clone)]
pub struct Tools {
    names: Vec<String>,
    /// Parsed `parameters-json`, by position (`None`: absent or not JSON).
    schemas: Vec<Option<Value>>,
}

impl Tools {
    /// From (name, JSON Schema text) pairs.
    pub fn new<I: IntoIterator<Item = (String, String)>>(defs: I) -> Self {
        let mut t = Tools::default();
        for (name, schema) in defs {
            t.names.push(name);
            t.schemas.push(serde_json::from_str(&schema).ok());
        }
        t
    }

    /// Whether `name` was declared.
    pub fn declared(&self, name: &str) -> bool {
        self.names.iter().any(|n| n == name)
    }

    /// Whether a call marked as one (e.g. inside `<tool_call>`) may name
    /// `name`: any name when the request declared no tools.
    pub fn allows(&self, name: &str) -> bool {
        self.names.is_empty() || self.declared(name)
    }

    /// The JSON Schema types declared for parameter `param` of `function`
    /// (`type`, a list of types, or the types of `anyOf`/`oneOf`
    /// alternatives); `None` when the schema does not say.
    pub fn param_types(&self, function: &str, param: &str) -> Option<Vec<String>> {
        let i = self.names.iter().position(|n| n == function)?;
        let prop = self
            .schemas
            .get(i)?
            .as_ref()?
            .get("properties")?
            .get(param)?;
        let mut types = Vec::new();
        collect_types(prop, &mut types);
        (!types.is_empty()).then_some(types)
    }
}

fn collect_types(schema: &Value, out: &mut Vec<String>) {
    match schema.get("type") {
        Some(Value::String(t)) => out.push(t.clone()),
        Some(Value::Array(ts)) => {
            out.extend(ts.iter().filter_map(|t| t.as_str().map(String::from)))
        }
        _ => {}
    }
    for key in ["anyOf", "oneOf"] {
        if let Some(Value::Array(alts)) = schema.get(key) {
            for alt in alts {
                collect_types(alt, out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn types_from_every_schema_shape() {
        let t = Tools::new([(
            "f".to_string(),
            r#"{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": ["string", "null"]},
                "c": {"anyOf": [{"type": "number"}, {"type": "boolean"}]}, "d": {"description": "x"}}}"#
                .to_string(),
        )]);
        assert_eq!(t.param_types("f", "a"), Some(vec!["integer".into()]));
        assert_eq!(
            t.param_types("f", "b"),
            Some(vec!["string".into(), "null".into()])
        );
        assert_eq!(
            t.param_types("f", "c"),
            Some(vec!["number".into(), "boolean".into()])
        );
        assert_eq!(t.param_types("f", "d"), None);
        assert_eq!(t.param_types("g", "a"), None);
        assert!(t.allows("f") && !t.allows("g") && Tools::default().allows("g"));
    }
}
