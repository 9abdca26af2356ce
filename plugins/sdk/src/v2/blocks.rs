//! Cuts a generation's events into content blocks, in order: reasoning,
//! text (with `invalid-call` text) and each tool call; a change of kind
//! starts a new block, a tool call's block closes at its end. Dialects that
//! render blocks or output items (Anthropic's content blocks, OpenAI
//! Responses' output items) share it, so the streamed steps fold to exactly
//! the non-streamed result.

use crate::v2::adapter::mlxhost::plugin::types::GenerationEvent;

/// How a content block begins.
#[derive(Debug, Clone, PartialEq)]
pub enum Start {
    /// Visible text.
    Text,
    /// Reasoning.
    Thinking,
    /// A tool call: the host's call id (`call_...`) and the function name.
    ToolUse {
        /// The call id.
        id: String,
        /// The function name.
        name: String,
    },
}

/// More of a content block.
#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    /// Visible text.
    Text(String),
    /// Reasoning text.
    Thinking(String),
    /// A fragment of a tool call's arguments (`input_json_delta`).
    Json(String),
}

/// One step of the block sequence; `u32` is the block's index.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// A block begins.
    Start(u32, Start),
    /// More of a block.
    Delta(u32, Delta),
    /// A block ends.
    Stop(u32),
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Text,
    Thinking,
    Tool(u32),
}

/// Cuts events into content blocks: a block stays open while events of its
/// kind arrive; a tool call's block closes at its end. Empty texts start
/// nothing.
#[derive(Debug, Default)]
pub struct Blocks {
    open: Option<(u32, Kind)>,
    next: u32,
    /// (call index, block index) of every call seen.
    calls: Vec<(u32, u32)>,
}

impl Blocks {
    fn close(&mut self, out: &mut Vec<Step>) {
        if let Some((index, _)) = self.open.take() {
            out.push(Step::Stop(index));
        }
    }

    /// The open block of `kind`, or a new one (closing the open one).
    fn ensure(&mut self, kind: Kind, start: Start, out: &mut Vec<Step>) -> u32 {
        match self.open {
            Some((index, k)) if k == kind => index,
            _ => {
                self.close(out);
                let index = self.next;
                self.next += 1;
                self.open = Some((index, kind));
                out.push(Step::Start(index, start));
                index
            }
        }
    }

    /// Appends the steps of `events` to `out`.
    pub fn feed(&mut self, events: &[GenerationEvent], out: &mut Vec<Step>) {
        for e in events {
            match e {
                GenerationEvent::Text(t) | GenerationEvent::InvalidCall(t) if !t.is_empty() => {
                    let index = self.ensure(Kind::Text, Start::Text, out);
                    out.push(Step::Delta(index, Delta::Text(t.clone())));
                }
                GenerationEvent::Reasoning(r) if !r.is_empty() => {
                    let index = self.ensure(Kind::Thinking, Start::Thinking, out);
                    out.push(Step::Delta(index, Delta::Thinking(r.clone())));
                }
                GenerationEvent::ToolCallStart(s) => {
                    // A new call always starts a new block.
                    self.close(out);
                    let start = Start::ToolUse {
                        id: s.id.clone(),
                        name: s.name.clone(),
                    };
                    let index = self.ensure(Kind::Tool(s.index), start, out);
                    self.calls.push((s.index, index));
                }
                GenerationEvent::ToolCallArgumentsDelta(d) if !d.arguments.is_empty() => {
                    // The host sends fragments only for an open call, so
                    // this is the open block; a fragment for an unknown
                    // call has nowhere to go and is dropped.
                    if let Some(&(_, index)) = self.calls.iter().find(|(c, _)| *c == d.index) {
                        out.push(Step::Delta(index, Delta::Json(d.arguments.clone())));
                    }
                }
                GenerationEvent::ToolCallEnd(i) => {
                    if matches!(self.open, Some((_, Kind::Tool(c))) if c == *i) {
                        self.close(out);
                    }
                }
                _ => {}
            }
        }
    }

    /// End of the generation: closes the open block.
    pub fn finish(&mut self, out: &mut Vec<Step>) {
        self.close(out);
    }
}

/// A whole block, as a non-streamed response holds it.
#[derive(Debug, Clone, PartialEq)]
pub enum Built {
    /// Visible text.
    Text(String),
    /// Reasoning text.
    Thinking(String),
    /// A tool call: the host's call id, the function name and the
    /// arguments' JSON text as the model wrote it.
    ToolUse {
        /// The call id.
        id: String,
        /// The function name.
        name: String,
        /// The arguments (JSON text).
        arguments: String,
    },
}

/// Every block of `events`, whole: what the steps of a stream fold to.
pub fn fold(events: &[GenerationEvent]) -> Vec<Built> {
    let mut steps = Vec::new();
    let mut b = Blocks::default();
    b.feed(events, &mut steps);
    b.finish(&mut steps);
    let mut built: Vec<Built> = Vec::new();
    for step in steps {
        match step {
            Step::Start(_, Start::Text) => built.push(Built::Text(String::new())),
            Step::Start(_, Start::Thinking) => built.push(Built::Thinking(String::new())),
            Step::Start(_, Start::ToolUse { id, name }) => built.push(Built::ToolUse {
                id,
                name,
                arguments: String::new(),
            }),
            Step::Delta(index, delta) => match (built.get_mut(index as usize), delta) {
                (Some(Built::Text(t)), Delta::Text(d))
                | (Some(Built::Thinking(t)), Delta::Thinking(d))
                | (Some(Built::ToolUse { arguments: t, .. }), Delta::Json(d)) => t.push_str(&d),
                // `Blocks` sends deltas only to an open block of their kind.
                _ => {}
            },
            Step::Stop(_) => {}
        }
    }
    built
}
