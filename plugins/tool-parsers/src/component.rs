//! The WIT glue: sessions of both interfaces over [`crate::stream::Stream`].

use std::cell::{Cell, RefCell};

use crate::formats::{Format, ToolParser};
use crate::reasoning::Reasoner;
use crate::stream::{Event, Stream};
use crate::tools::Tools;

wit_bindgen::generate!({
    path: "wit",
    world: "parsers",
    // The interfaces come from the `mlxhost:plugin@0.2.0` dependency.
    generate_all,
});

use exports::mlxhost::plugin::reasoning_parser as rp;
use exports::mlxhost::plugin::tool_call_parser as tcp;
use mlxhost::plugin::types::{GenerationEvent, PluginError, ToolCallDelta, ToolCallStart};

thread_local! {
    /// The format of the tool-call session created last (see the crate docs).
    static LAST_FORMAT: Cell<Option<Format>> = const { Cell::new(None) };
}

fn wit_event(e: Event) -> GenerationEvent {
    match e {
        Event::Text(t) => GenerationEvent::Text(t),
        Event::Reasoning(t) => GenerationEvent::Reasoning(t),
        Event::CallStart { index, id, name } => {
            GenerationEvent::ToolCallStart(ToolCallStart { index, id, name })
        }
        Event::CallArguments { index, arguments } => {
            GenerationEvent::ToolCallArgumentsDelta(ToolCallDelta { index, arguments })
        }
        Event::CallEnd(index) => GenerationEvent::ToolCallEnd(index),
        Event::Invalid(t) => GenerationEvent::InvalidCall(t),
    }
}

fn wit_events(events: Vec<Event>) -> Vec<GenerationEvent> {
    events.into_iter().map(wit_event).collect()
}

struct Component;

/// A tool-call parser session. `parallel-tool-calls` is not enforced here:
/// every call is parsed and reported, and the host decides what a second
/// call means for a request that allowed one.
struct ToolSession(RefCell<Stream<ToolParser>>);

impl tcp::Guest for Component {
    type Session = ToolSession;

    fn call_prefix(name: String) -> Option<String> {
        let format = LAST_FORMAT.with(Cell::get).unwrap_or(Format::Hermes);
        Some(format.call_prefix(&name))
    }
}

impl tcp::GuestSession for ToolSession {
    fn create(options: tcp::ParserOptions) -> Result<tcp::Session, PluginError> {
        let opts = crate::options::tool_options(&options.extra)
            .map_err(|message| PluginError { message })?;
        LAST_FORMAT.with(|f| f.set(Some(opts.format)));
        let tools = Tools::new(
            options
                .tools
                .into_iter()
                .map(|t| (t.name, t.parameters_json)),
        );
        let parser = ToolParser {
            format: opts.format,
            tools,
        };
        Ok(tcp::Session::new(ToolSession(RefCell::new(Stream::new(
            parser,
            &opts.id_salt,
        )))))
    }

    fn feed(&self, delta: String, _token_ids: Vec<u32>) -> Vec<GenerationEvent> {
        wit_events(self.0.borrow_mut().feed(&delta))
    }

    fn finish(&self) -> Vec<GenerationEvent> {
        wit_events(self.0.borrow_mut().finish())
    }
}

/// A reasoning parser session.
struct ReasoningSession(RefCell<Stream<Reasoner>>);

impl rp::Guest for Component {
    type Session = ReasoningSession;
}

impl rp::GuestSession for ReasoningSession {
    fn create(options: rp::ReasoningOptions) -> Result<rp::Session, PluginError> {
        let format = crate::options::reasoning_options(&options.extra)
            .map_err(|message| PluginError { message })?;
        let parser = Reasoner::new(format, &options.prompt_tail);
        Ok(rp::Session::new(ReasoningSession(RefCell::new(
            Stream::new(parser, ""),
        ))))
    }

    fn feed(&self, delta: String, _token_ids: Vec<u32>) -> Vec<GenerationEvent> {
        wit_events(self.0.borrow_mut().feed(&delta))
    }

    fn finish(&self) -> Vec<GenerationEvent> {
        wit_events(self.0.borrow_mut().finish())
    }
}

export!(Component);
