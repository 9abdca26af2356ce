//! What the adapter keeps in the host's response store per response id
//! (WIT `response-store`): the `response` object as rendered, the
//! conversation it closes (for `previous_response_id`) and its input items
//! (for `GET /v1/responses/{id}/input_items`), as one JSON document.

use mlxhost_plugin_sdk::v2::adapter::mlxhost::plugin::request::{ContentPart, Message, ToolCall};
use serde_json::{json, Value};

/// A stored response.
#[derive(Debug, Clone)]
pub struct Stored {
    /// The `response` object.
    pub response: Value,
    /// The conversation up to and including this response's output
    /// (without `instructions`).
    pub conversation: Vec<Message>,
    /// This request's input items.
    pub input_items: Vec<Value>,
}

fn message_json(m: &Message) -> Value {
    // Text parts as a list: joined, two parts would render differently in
    // the chat template than the request that sent them.
    let parts: Vec<&str> = m
        .content
        .iter()
        .filter_map(|p| match p {
            ContentPart::Text(t) => Some(t.as_str()),
            ContentPart::ImageUrl(_) => None,
        })
        .collect();
    json!({
        "role": m.role,
        "content": parts,
        "tool_calls": m.tool_calls.iter().map(|c| json!({
            "id": c.id, "name": c.name, "arguments": c.arguments,
        })).collect::<Vec<_>>(),
        "tool_call_id": m.tool_call_id,
        "reasoning": m.reasoning,
    })
}

fn message_from(v: &Value) -> Option<Message> {
    let s = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
    let content = match v.get("content")? {
        Value::Array(parts) => parts
            .iter()
            .map(|p| p.as_str().map(|t| ContentPart::Text(t.to_string())))
            .collect::<Option<Vec<_>>>()?,
        Value::String(t) if t.is_empty() => Vec::new(),
        // Documents written before parts were kept as a list.
        Value::String(t) => vec![ContentPart::Text(t.clone())],
        _ => return None,
    };
    let tool_calls = v
        .get("tool_calls")?
        .as_array()?
        .iter()
        .map(|c| {
            Some(ToolCall {
                id: c.get("id")?.as_str()?.to_string(),
                name: c.get("name")?.as_str()?.to_string(),
                arguments: c.get("arguments")?.as_str()?.to_string(),
            })
        })
        .collect::<Option<Vec<_>>>()?;
    Some(Message {
        role: s("role")?,
        content,
        name: None,
        tool_calls,
        tool_call_id: s("tool_call_id"),
        reasoning: s("reasoning"),
    })
}

impl Stored {
    /// The document's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        json!({
            "response": self.response,
            "conversation": self.conversation.iter().map(message_json).collect::<Vec<_>>(),
            "input_items": self.input_items,
        })
        .to_string()
        .into_bytes()
    }

    /// Parses a document; `None` when it is not one (then the id is
    /// treated as unknown).
    pub fn from_bytes(bytes: &[u8]) -> Option<Self> {
        let v: Value = serde_json::from_slice(bytes).ok()?;
        let conversation = v
            .get("conversation")?
            .as_array()?
            .iter()
            .map(message_from)
            .collect::<Option<Vec<_>>>()?;
        Some(Stored {
            response: v.get("response")?.clone(),
            conversation,
            input_items: v.get("input_items")?.as_array()?.clone(),
        })
    }
}
