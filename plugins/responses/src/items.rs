//! Input items as `GET /v1/responses/{id}/input_items` lists them: OpenAI's
//! item shapes whatever shorthand the request used ("List input items" in
//! OpenAI's API reference). A message's string content becomes one
//! `input_text` part (`output_text` for the assistant, with its
//! `annotations`), bare `text` parts get the role's part type, and every
//! item has a `status`; ids are assigned when listed ([`with_id`]).

use serde_json::{json, Value};

/// The part type a plain text part of `role` has in OpenAI's item shape.
fn text_part_type(role: &str) -> &'static str {
    if role == "assistant" {
        "output_text"
    } else {
        "input_text"
    }
}

fn text_part(role: &str, text: &Value) -> Value {
    let kind = text_part_type(role);
    let mut part = json!({"type": kind, "text": text});
    if kind == "output_text" {
        part["annotations"] = json!([]);
    }
    part
}

fn message_content(role: &str, content: &Value) -> Value {
    match content {
        Value::String(_) => json!([text_part(role, content)]),
        Value::Array(parts) => Value::Array(
            parts
                .iter()
                .map(|p| match p.get("type").and_then(Value::as_str) {
                    Some("text") => text_part(role, &p["text"]),
                    Some("output_text") if p.get("annotations").is_none() => {
                        let mut p = p.clone();
                        p["annotations"] = json!([]);
                        p
                    }
                    _ => p.clone(),
                })
                .collect(),
        ),
        other => other.clone(),
    }
}

/// `item` (already validated as `kind`) in OpenAI's shape for listing.
pub fn normalize(kind: &str, item: &Value) -> Value {
    let mut out = item.clone();
    let Some(o) = out.as_object_mut() else {
        return out;
    };
    o.insert("type".into(), json!(kind));
    if kind == "message" {
        let role = o
            .get("role")
            .and_then(Value::as_str)
            .unwrap_or("user")
            .to_string();
        if let Some(content) = o.get("content").cloned() {
            o.insert("content".into(), message_content(&role, &content));
        }
    }
    if kind == "reasoning" && o.get("summary").is_none_or(Value::is_null) {
        o.insert("summary".into(), json!([]));
    }
    if o.get("status").is_none_or(Value::is_null) && kind != "reasoning" {
        o.insert("status".into(), json!("completed"));
    }
    out
}

/// `item` with an `id`: its own when it has a string one, else one
/// derived from the response id and its position (stable across listings).
pub fn with_id(mut item: Value, response_id: &str, index: usize) -> Value {
    if item.get("id").and_then(Value::as_str).is_none() {
        let prefix = match item.get("type").and_then(Value::as_str) {
            Some("message") => "msg",
            Some("function_call") => "fc",
            Some("function_call_output") => "fco",
            Some("custom_tool_call") => "ctc",
            Some("custom_tool_call_output") => "ctco",
            Some("reasoning") => "rs",
            _ => "item",
        };
        let base = response_id.trim_start_matches("resp_");
        item["id"] = json!(format!("{prefix}_{base}_in{index}"));
    }
    item
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn string_content_becomes_the_roles_part() {
        let user = normalize("message", &json!({"role": "user", "content": "hi"}));
        assert_eq!(
            user,
            json!({"type": "message", "role": "user", "status": "completed",
                   "content": [{"type": "input_text", "text": "hi"}]})
        );
        let assistant = normalize(
            "message",
            &json!({"role": "assistant", "content": [{"type": "text", "text": "yo"}]}),
        );
        assert_eq!(
            assistant["content"],
            json!([{"type": "output_text", "text": "yo", "annotations": []}])
        );
    }

    #[test]
    fn calls_get_a_status_and_every_item_an_id() {
        let call = normalize(
            "function_call",
            &json!({"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": null}),
        );
        assert_eq!(call["status"], "completed");
        let listed = with_id(call, "resp_abc", 2);
        assert_eq!(listed["id"], "fc_abc_in2");
        let own = with_id(json!({"type": "message", "id": "msg_mine"}), "resp_abc", 0);
        assert_eq!(own["id"], "msg_mine");
        let reasoning = normalize("reasoning", &json!({"content": []}));
        assert_eq!(reasoning["summary"], json!([]));
        assert!(reasoning.get("status").is_none());
    }
}
