//! Parser plugin sessions (WIT 0.2.0 `tool-call-parser` and
//! `reasoning-parser`): one instance and one session per request, every
//! call under the parser deadline. What a parser returns is checked here
//! (call indices in order, fragments only for open calls, every call
//! closed with arguments that are one JSON object), so the adapters can
//! trust the event sequence.

use std::sync::Arc;

use wasmtime::component::ResourceAny;
use wasmtime::Store;

use crate::plugin::bindings::v2::reasoning_parser::exports::mlxhost::plugin::reasoning_parser::ReasoningOptions;
use crate::plugin::bindings::v2::reasoning_parser::ReasoningParserPlugin;
use crate::plugin::bindings::v2::tool_parser::exports::mlxhost::plugin::tool_call_parser::ParserOptions;
use crate::plugin::bindings::v2::tool_parser::mlxhost::plugin::types as wit;
use crate::plugin::bindings::v2::tool_parser::ToolCallParserPlugin;
use crate::plugin::session::{created_with, failed, merged_params, trap_cause};
use crate::plugin::tensors::PluginState;
use crate::plugin::{Kind, PluginError, PluginHost};

pub use wit::{GenerationEvent, ToolCallDelta, ToolCallStart, ToolDefinition};

enum World {
    Tool(ToolCallParserPlugin),
    Reasoning(ReasoningParserPlugin),
}

/// A live parser session for one request.
pub struct ParserSession {
    /// Keeps the host (and its epoch ticker) alive with the instance.
    _host: Arc<PluginHost>,
    name: String,
    store: Store<PluginState>,
    world: World,
    session: ResourceAny,
    deadline_ticks: u64,
    checker: EventChecker,
}

fn created<T>(
    name: &str,
    result: wasmtime::Result<Result<T, wit::PluginError>>,
) -> Result<T, PluginError> {
    created_with(name, result, |e| e.message)
}

impl ParserSession {
    /// A tool-call parser session for `tools`. `plugin_params` is the
    /// request's per-plugin object (this plugin's entry is merged over its
    /// manifest defaults).
    ///
    /// Errors: unknown plugin or kind ([`PluginError::Unknown`]), a
    /// rejected option ([`PluginError::Rejected`]), a trap.
    pub fn tool_parser(
        host: Arc<PluginHost>,
        name: &str,
        tools: &[ToolDefinition],
        parallel_tool_calls: bool,
        plugin_params: &serde_json::Value,
    ) -> Result<Self, PluginError> {
        let plugin = host.get(name, Kind::ToolCallParser)?;
        let pre = plugin
            .tool_parser
            .as_ref()
            .ok_or_else(|| failed(name, "no tool-call-parser world"))?;
        let extra = merged_params(name, plugin.manifest.defaults_json(), plugin_params);
        let mut store = host.new_store(Kind::ToolCallParser);
        let bindings = pre
            .instantiate(&mut store)
            .map_err(|e| failed(name, trap_cause(&e)))?;
        let options = ParserOptions {
            tools: tools.to_vec(),
            parallel_tool_calls,
            extra: extra.to_string(),
        };
        let session = created(
            name,
            bindings
                .mlxhost_plugin_tool_call_parser()
                .session()
                .call_create(&mut store, &options),
        )?;
        let deadline_ticks = host.deadline_ticks(Kind::ToolCallParser);
        Ok(ParserSession {
            name: name.into(),
            _host: host,
            store,
            world: World::Tool(bindings),
            session,
            deadline_ticks,
            checker: EventChecker::default(),
        })
    }

    /// A reasoning parser session; `prompt_tail` is the end of the rendered
    /// prompt (at most 64 bytes, cut at a character boundary).
    ///
    /// Errors: as [`ParserSession::tool_parser`].
    pub fn reasoning_parser(
        host: Arc<PluginHost>,
        name: &str,
        prompt_tail: &str,
        plugin_params: &serde_json::Value,
    ) -> Result<Self, PluginError> {
        let plugin = host.get(name, Kind::ReasoningParser)?;
        let pre = plugin
            .reasoning_parser
            .as_ref()
            .ok_or_else(|| failed(name, "no reasoning-parser world"))?;
        let extra = merged_params(name, plugin.manifest.defaults_json(), plugin_params);
        let mut store = host.new_store(Kind::ReasoningParser);
        let bindings = pre
            .instantiate(&mut store)
            .map_err(|e| failed(name, trap_cause(&e)))?;
        let options = ReasoningOptions {
            prompt_tail: tail(prompt_tail, 64).to_string(),
            extra: extra.to_string(),
        };
        let session = created(
            name,
            bindings
                .mlxhost_plugin_reasoning_parser()
                .session()
                .call_create(&mut store, &options),
        )?;
        let deadline_ticks = host.deadline_ticks(Kind::ReasoningParser);
        Ok(ParserSession {
            name: name.into(),
            _host: host,
            store,
            world: World::Reasoning(bindings),
            session,
            deadline_ticks,
            checker: EventChecker::default(),
        })
    }

    /// The plugin's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Feeds output text (special tokens kept) and the ids that completed it.
    ///
    /// Errors: a trap, the deadline, or events that break the rules above.
    pub fn feed(&mut self, delta: &str, ids: &[u32]) -> Result<Vec<GenerationEvent>, PluginError> {
        self.store.set_epoch_deadline(self.deadline_ticks);
        let events = match &self.world {
            World::Tool(b) => b.mlxhost_plugin_tool_call_parser().session().call_feed(
                &mut self.store,
                self.session,
                delta,
                ids,
            ),
            World::Reasoning(b) => b.mlxhost_plugin_reasoning_parser().session().call_feed(
                &mut self.store,
                self.session,
                delta,
                ids,
            ),
        }
        .map_err(|e| failed(&self.name, format!("`feed` failed: {}", trap_cause(&e))))?;
        self.check(&events)?;
        Ok(events)
    }

    /// End of output: what the parser held back.
    ///
    /// Errors: as [`ParserSession::feed`], and a call left open.
    pub fn finish(&mut self) -> Result<Vec<GenerationEvent>, PluginError> {
        self.store.set_epoch_deadline(self.deadline_ticks);
        let events = match &self.world {
            World::Tool(b) => b
                .mlxhost_plugin_tool_call_parser()
                .session()
                .call_finish(&mut self.store, self.session),
            World::Reasoning(b) => b
                .mlxhost_plugin_reasoning_parser()
                .session()
                .call_finish(&mut self.store, self.session),
        }
        .map_err(|e| failed(&self.name, format!("`finish` failed: {}", trap_cause(&e))))?;
        self.check(&events)?;
        self.checker
            .finish()
            .map_err(|cause| failed(&self.name, cause))?;
        Ok(events)
    }

    /// The text that starts a call of `function` (tool parsers only; the
    /// session must exist first: a shared component learns its format from
    /// the session's parameters).
    ///
    /// Errors: a trap or the deadline.
    pub fn call_prefix(&mut self, function: &str) -> Result<Option<String>, PluginError> {
        let World::Tool(b) = &self.world else {
            return Ok(None);
        };
        self.store.set_epoch_deadline(self.deadline_ticks);
        b.mlxhost_plugin_tool_call_parser()
            .call_call_prefix(&mut self.store, function)
            .map_err(|e| {
                failed(
                    &self.name,
                    format!("`call-prefix` failed: {}", trap_cause(&e)),
                )
            })
    }

    fn check(&mut self, events: &[GenerationEvent]) -> Result<(), PluginError> {
        let reasoning_only = matches!(self.world, World::Reasoning(_));
        for e in events {
            if reasoning_only
                && !matches!(e, GenerationEvent::Text(_) | GenerationEvent::Reasoning(_))
            {
                return Err(failed(
                    &self.name,
                    "a reasoning parser returned a tool-call event",
                ));
            }
            self.checker
                .event(e)
                .map_err(|cause| failed(&self.name, cause))?;
        }
        Ok(())
    }
}

/// Whether `text` is one JSON object. Checked syntactically (serde's
/// `IgnoredAny` never converts numbers), so a number beyond f64's range
/// such as `1e400`, which is valid JSON, passes.
fn is_json_object(text: &str) -> bool {
    text.trim_start().starts_with('{')
        && serde_json::from_str::<serde::de::IgnoredAny>(text).is_ok()
}

/// The last at most `max` bytes of `s`, starting at a character boundary.
fn tail(s: &str, max: usize) -> &str {
    let mut start = s.len().saturating_sub(max);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    &s[start..]
}

/// The rules a parser's event sequence must keep.
#[derive(Debug, Default)]
struct EventChecker {
    /// Arguments so far of every call started, by index.
    calls: Vec<(String, bool)>,
}

impl EventChecker {
    fn event(&mut self, e: &GenerationEvent) -> Result<(), String> {
        match e {
            GenerationEvent::ToolCallStart(s) => {
                if s.index as usize != self.calls.len() {
                    return Err(format!(
                        "tool call {} started, expected index {}",
                        s.index,
                        self.calls.len()
                    ));
                }
                if s.name.is_empty() || s.id.is_empty() {
                    return Err(format!("tool call {} has an empty name or id", s.index));
                }
                self.calls.push((String::new(), false));
            }
            GenerationEvent::ToolCallArgumentsDelta(d) => {
                match self.calls.get_mut(d.index as usize) {
                    Some((args, false)) => args.push_str(&d.arguments),
                    _ => {
                        return Err(format!(
                            "arguments for tool call {} which is not open",
                            d.index
                        ))
                    }
                }
            }
            GenerationEvent::ToolCallEnd(i) => match self.calls.get_mut(*i as usize) {
                Some((args, open @ false)) => {
                    if !is_json_object(args) {
                        return Err(format!(
                            "tool call {i} ended with arguments that are not a JSON object: {args:?}"
                        ));
                    }
                    *open = true;
                }
                _ => return Err(format!("tool call {i} ended but is not open")),
            },
            _ => {}
        }
        Ok(())
    }

    fn finish(&self) -> Result<(), String> {
        match self.calls.iter().position(|(_, closed)| !closed) {
            Some(i) => Err(format!("tool call {i} was never ended")),
            None => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(index: u32) -> GenerationEvent {
        GenerationEvent::ToolCallStart(ToolCallStart {
            index,
            id: format!("call_{index}"),
            name: "f".into(),
        })
    }

    fn args(index: u32, a: &str) -> GenerationEvent {
        GenerationEvent::ToolCallArgumentsDelta(ToolCallDelta {
            index,
            arguments: a.into(),
        })
    }

    #[test]
    fn a_well_formed_sequence_passes() {
        let mut c = EventChecker::default();
        for e in [
            GenerationEvent::Text("hi".into()),
            start(0),
            args(0, "{\"a\":"),
            args(0, "1}"),
            GenerationEvent::ToolCallEnd(0),
            start(1),
            args(1, "{}"),
            GenerationEvent::ToolCallEnd(1),
        ] {
            c.event(&e).expect("valid");
        }
        c.finish().expect("all closed");
    }

    #[test]
    fn broken_sequences_are_named() {
        let mut c = EventChecker::default();
        assert!(c.event(&start(1)).unwrap_err().contains("expected index 0"));
        assert!(c.event(&args(0, "{}")).unwrap_err().contains("not open"));
        c.event(&start(0)).expect("start");
        c.event(&args(0, "[1]")).expect("fragment");
        assert!(c
            .event(&GenerationEvent::ToolCallEnd(0))
            .unwrap_err()
            .contains("not a JSON object"));
        let mut open = EventChecker::default();
        open.event(&start(0)).expect("start");
        assert!(open.finish().unwrap_err().contains("never ended"));
    }

    #[test]
    fn json_objects_are_checked_by_syntax_not_by_number_range() {
        assert!(is_json_object("{\"x\": 1e400, \"y\": -1e999}"));
        assert!(is_json_object(" {}"));
        assert!(!is_json_object("[1]"));
        assert!(!is_json_object("{\"x\": }"));
        assert!(!is_json_object("{} {}"));
    }

    #[test]
    fn tail_cuts_at_a_character_boundary() {
        assert_eq!(tail("abc", 64), "abc");
        assert_eq!(tail("aé", 1), "");
        assert_eq!(tail("aéb", 2), "b");
        assert_eq!(tail("aéb", 3), "éb");
    }
}
