//! The output side of a request, next to the engine: the engine streams
//! final text (detokenized, stop strings applied, special tokens kept when
//! a parser runs); [`OutputPipeline`] turns it into canonical events
//! (text, reasoning, tool calls) through parser plugins; adapters render
//! those events, streamed or not.

pub mod parser;
pub mod pipeline;

pub use parser::{GenerationEvent, ParserSession, ToolDefinition};
pub use pipeline::{merge, OutputPipeline};

use crate::plugin::{Kind, PluginHost};

/// How a parser is chosen: the request's field wins, then the server's
/// flag, then the loaded plugin of `kind` whose `template_markers` all
/// occur in the chat template (most markers wins; ties by name). `"none"`
/// at any level turns parsing off. Returns the plugin name, or `None`.
pub fn choose_parser(
    requested: Option<&str>,
    server: Option<&str>,
    template: Option<&str>,
    plugins: &PluginHost,
    kind: Kind,
) -> Option<String> {
    match requested.or(server) {
        Some("none") => return None,
        Some(name) => return Some(name.to_string()),
        None => {}
    }
    let template = template?;
    plugins
        .plugins
        .values()
        .filter(|p| p.manifest.kinds.contains(&kind) && !p.manifest.template_markers.is_empty())
        .filter(|p| {
            p.manifest
                .template_markers
                .iter()
                .all(|m| template.contains(m.as_str()))
        })
        .max_by(|a, b| {
            a.manifest
                .template_markers
                .len()
                .cmp(&b.manifest.template_markers.len())
                .then_with(|| b.manifest.name.cmp(&a.manifest.name))
        })
        .map(|p| p.manifest.name.clone())
}
