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
        let tmpl = self
            .env
            .get_template("chat")
            .map_err(|e| ModelError::Template(e.to_string()))?;
        tmpl.render(minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token,
            eos_token => self.eos_token,
        })
        .map_err(|e| ModelError::Template(e.to_string()))
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
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
}
