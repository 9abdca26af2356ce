//! Chat templates (Jinja, as in Hugging Face `tokenizer_config.json` or GGUF
//! `tokenizer.chat_template`), rendered with `minijinja` plus its Python
//! compatibility layer (`.strip()`, `.items()`, ...), the way
//! `transformers`' `apply_chat_template` renders them.

use minijinja::{Environment, ErrorKind, Value};
use serde::Serialize;

use super::error::{ModelError, Result};

/// A chat message as chat templates see it (`role`, `content`).
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The message text.
    pub content: String,
}

/// A chat message with everything a tool-calling template reads, in the
/// shape `transformers` gives templates: `tool_calls` as
/// `[{"id", "type": "function", "function": {"name", "arguments": {...}}}]`
/// (arguments as a mapping, so templates can `tojson` them),
/// `tool_call_id` and `name` on tool results, the reasoning of assistant
/// turns as `reasoning_content` (Qwen3, DeepSeek) and as `thinking`
/// (gpt-oss's template reads its analysis channel from there; on a turn
/// with both tool calls and content it renders one of them as the
/// analysis and raises when given both, so there the content is left to
/// it and `thinking` is not set: a gpt-oss preamble before a call must not
/// fail the next request). Absent fields are left out (templates test them
/// with `is defined` or `in`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TemplateMessage {
    /// `system`, `user`, `assistant` or `tool`.
    pub role: String,
    /// The message text.
    pub content: String,
    /// Assistant turns: the calls made.
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// Tool turns: the call answered.
    pub tool_call_id: Option<String>,
    /// Participant or tool name.
    pub name: Option<String>,
    /// Assistant turns: reasoning text.
    pub reasoning_content: Option<String>,
}

impl Serialize for TemplateMessage {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Fields<'a> {
            role: &'a str,
            content: &'a str,
            #[serde(skip_serializing_if = "Option::is_none")]
            tool_calls: Option<&'a Vec<serde_json::Value>>,
            #[serde(skip_serializing_if = "Option::is_none")]
            tool_call_id: Option<&'a str>,
            #[serde(skip_serializing_if = "Option::is_none")]
            name: Option<&'a str>,
            #[serde(skip_serializing_if = "Option::is_none")]
            reasoning_content: Option<&'a str>,
            #[serde(skip_serializing_if = "Option::is_none")]
            thinking: Option<&'a str>,
        }
        Fields {
            role: &self.role,
            content: &self.content,
            tool_calls: self.tool_calls.as_ref(),
            tool_call_id: self.tool_call_id.as_deref(),
            name: self.name.as_deref(),
            reasoning_content: self.reasoning_content.as_deref(),
            thinking: self
                .reasoning_content
                .as_deref()
                .filter(|_| self.tool_calls.is_none() || self.content.is_empty()),
        }
        .serialize(s)
    }
}

impl From<&ChatMessage> for TemplateMessage {
    fn from(m: &ChatMessage) -> Self {
        TemplateMessage {
            role: m.role.clone(),
            content: m.content.clone(),
            ..TemplateMessage::default()
        }
    }
}

/// Names the template context defines itself; keyword arguments cannot
/// replace them.
const RESERVED: [&str; 5] = [
    "messages",
    "tools",
    "add_generation_prompt",
    "bos_token",
    "eos_token",
];

/// A compiled chat template.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Compiles `source`. `bos_token`/`eos_token` are exposed to the template
    /// as variables, as transformers does.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<Value, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        // `transformers` defines it: the current date and time, formatted
        // (gpt-oss's and Llama 3.x's templates print today's date).
        env.add_function("strftime_now", |format: String| {
            super::strftime::format_now(&format)
        });
        // `transformers` renders `tojson` with Python's `json.dumps`
        // (`", "` and `": "` separators, no HTML escaping); minijinja's
        // own filter is compact and escapes `<`: tool definitions in the
        // prompt must read as the model saw them in training.
        env.add_filter("tojson", python_tojson);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| ModelError::Template(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
        })
    }

    /// Renders `messages` to the prompt text. With `add_generation_prompt`
    /// the text ends where the assistant's reply starts.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        let messages: Vec<TemplateMessage> = messages.iter().map(TemplateMessage::from).collect();
        self.render_with(
            &messages,
            &[],
            &serde_json::Map::new(),
            add_generation_prompt,
        )
    }

    /// Renders a conversation with `tools` (OpenAI-shaped
    /// `{"type": "function", "function": {...}}` objects, passed as
    /// `transformers` does: undefined when empty) and extra template
    /// variables `kwargs` (e.g. `enable_thinking`; names the template
    /// context defines itself are ignored).
    ///
    /// Errors: [`ModelError::Template`] when the template fails (including
    /// its own `raise_exception`).
    pub fn render_with(
        &self,
        messages: &[TemplateMessage],
        tools: &[serde_json::Value],
        kwargs: &serde_json::Map<String, serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| ModelError::Template(e.to_string()))?;
        let mut ctx: std::collections::BTreeMap<String, Value> = kwargs
            .iter()
            .filter(|(k, _)| !RESERVED.contains(&k.as_str()))
            .map(|(k, v)| (k.clone(), Value::from_serialize(v)))
            .collect();
        ctx.insert("messages".into(), Value::from_serialize(messages));
        if !tools.is_empty() {
            ctx.insert("tools".into(), Value::from_serialize(tools));
        }
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        ctx.insert("bos_token".into(), Value::from(self.bos_token.clone()));
        ctx.insert("eos_token".into(), Value::from(self.eos_token.clone()));
        tmpl.render(ctx)
            .map_err(|e| ModelError::Template(e.to_string()))
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }
}

/// `tojson` as `transformers` defines it for chat templates:
/// `json.dumps(value, ensure_ascii=False, indent=indent)`.
fn python_tojson(
    value: &Value,
    kwargs: minijinja::value::Kwargs,
) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let pad = " ".repeat(n);
            let mut ser = serde_json::Serializer::with_formatter(
                &mut out,
                serde_json::ser::PrettyFormatter::with_indent(pad.as_bytes()),
            );
            serde::Serialize::serialize(&json, &mut ser)
        }
        None => {
            let mut ser = serde_json::Serializer::with_formatter(&mut out, PythonFormatter);
            serde::Serialize::serialize(&json, &mut ser)
        }
    };
    written.map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let text = String::from_utf8(out)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    Ok(Value::from_safe_string(text))
}

/// Python's default `json.dumps` separators: `", "` and `": "`.
struct PythonFormatter;

/// `", "` before every item but the first.
fn item_separator<W: ?Sized + std::io::Write>(writer: &mut W, first: bool) -> std::io::Result<()> {
    if first {
        Ok(())
    } else {
        writer.write_all(b", ")
    }
}

impl serde_json::ser::Formatter for PythonFormatter {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        item_separator(writer, first)
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        item_separator(writer, first)
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(
        &mut self,
        writer: &mut W,
    ) -> std::io::Result<()> {
        writer.write_all(b": ")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_chatml_with_default_system_prompt() -> Result<()> {
        let src = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nDefault<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let t = ChatTemplate::new(src, "", "<|im_end|>")?;
        let out = t.render(
            &[ChatMessage {
                role: "user".into(),
                content: "Hi".into(),
            }],
            true,
        )?;
        assert_eq!(out, "<|im_start|>system\nDefault<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
        Ok(())
    }

    #[test]
    fn tools_tool_calls_and_kwargs_reach_the_template() -> Result<()> {
        let src = "{% if tools %}{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}{% for m in messages %}{{ m.role }}:{% if m.tool_calls is defined %}{% for c in m.tool_calls %}{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}{% endif %}{% if m.tool_call_id is defined %}[{{ m.tool_call_id }}]{% endif %}{{ m.content }};{% endfor %}{{ enable_thinking }}";
        let t = ChatTemplate::new(src, "", "")?;
        let tools = [
            serde_json::json!({"type": "function", "function": {"name": "f", "parameters": {"a": "<b>"}}}),
        ];
        let messages = [
            TemplateMessage {
                role: "assistant".into(),
                tool_calls: Some(vec![
                    serde_json::json!({"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1, "y": "é"}}}),
                ]),
                ..TemplateMessage::default()
            },
            TemplateMessage {
                role: "tool".into(),
                content: "42".into(),
                tool_call_id: Some("c1".into()),
                ..TemplateMessage::default()
            },
        ];
        let mut kwargs = serde_json::Map::new();
        kwargs.insert("enable_thinking".into(), serde_json::json!(false));
        kwargs.insert("messages".into(), serde_json::json!([]));
        // Booleans print as Python does (`False`), as in `transformers`.
        let out = t.render_with(&messages, &tools, &kwargs, false)?;
        assert_eq!(
            out,
            "{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"a\": \"<b>\"}}}\nassistant:f{\"x\": 1, \"y\": \"é\"};tool:[c1]42;False"
        );
        Ok(())
    }

    #[test]
    fn python_string_methods_work() -> Result<()> {
        let t = ChatTemplate::new("{{ messages[0].content.strip() }}", "", "")?;
        assert_eq!(
            t.render(
                &[ChatMessage {
                    role: "user".into(),
                    content: "  x ".into()
                }],
                false
            )?,
            "x"
        );
        Ok(())
    }

    /// What gpt-oss's template needs beyond the others: today's date from
    /// `strftime_now`, and an assistant turn's reasoning as `thinking`
    /// (tested with `in`, so it is absent when there is none).
    #[test]
    fn gpt_oss_reads_the_date_and_thinking() -> Result<()> {
        let src = "{{ strftime_now('%Y-%m-%d') }}|{% for m in messages %}{% if 'thinking' in m %}[{{ m.thinking }}]{% endif %}{{ m.content }};{% endfor %}";
        let t = ChatTemplate::new(src, "", "")?;
        let messages = [
            TemplateMessage {
                role: "assistant".into(),
                content: "Hi.".into(),
                reasoning_content: Some("Greet back.".into()),
                ..TemplateMessage::default()
            },
            TemplateMessage {
                role: "user".into(),
                content: "Hello".into(),
                ..TemplateMessage::default()
            },
        ];
        let out = t.render_with(&messages, &[], &serde_json::Map::new(), false)?;
        let (date, rest) = out.split_once('|').expect("a date");
        assert_eq!(date, super::super::strftime::format_now("%Y-%m-%d"));
        assert!(date.len() == 10 && date.as_bytes()[4] == b'-', "{date}");
        assert_eq!(rest, "[Greet back.]Hi.;Hello;");
        // A preamble before a call: the content stands for the analysis.
        let call = serde_json::json!({"id": "c", "type": "function",
                                      "function": {"name": "f", "arguments": {}}});
        let preamble = TemplateMessage {
            tool_calls: Some(vec![call]),
            ..messages[0].clone()
        };
        let out = t.render_with(&[preamble], &[], &serde_json::Map::new(), false)?;
        assert_eq!(out.split_once('|').map(|x| x.1), Some("Hi.;"));
        Ok(())
    }
}
