//! Tool-call formats. Each is a scanner over the accumulated output that
//! finds call markers, parses the call after each, and treats the rest as
//! text (see [`crate::segment`] for the streaming contract).
//!
//! Shared rules, in [`Out`]:
//! - whitespace between text and a call (before a marker, after a call) is
//!   dropped; so while streaming, trailing whitespace is held back until
//!   something other than a call follows it (an invalid call is content:
//!   the text around it is kept whole);
//! - text whose end could still become a marker (`<tool_`) is held back;
//! - a call that cannot be completed becomes [`Seg::Invalid`] with its
//!   original text, never dropped.

pub mod hermes;
pub mod llama3_json;
pub mod mistral;
pub mod pythonic;
pub mod qwen3_coder;

use crate::harmony::{self, Harmony};
use crate::json::{self, Scan};
use crate::segment::{Parsed, Parser, Seg};
use crate::text::{could_become, find_any, held_from, skip_ws};
use crate::tools::Tools;

/// The tool-call formats this crate parses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Hermes,
    Llama3Json,
    Mistral,
    Qwen3Coder,
    Pythonic,
    /// gpt-oss's harmony messages ([`crate::harmony`]).
    Harmony,
}

impl Format {
    /// Every format, by its `format` parameter value.
    pub const ALL: [(&'static str, Format); 6] = [
        ("hermes", Format::Hermes),
        ("llama3-json", Format::Llama3Json),
        ("mistral", Format::Mistral),
        ("qwen3-coder", Format::Qwen3Coder),
        ("pythonic", Format::Pythonic),
        ("harmony", Format::Harmony),
    ];

    /// The format called `name`.
    pub fn from_name(name: &str) -> Option<Format> {
        Format::ALL
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, f)| *f)
    }

    /// The text that starts a call of `name`, up to where its arguments
    /// begin (what the host forces for `tool_choice` required/named).
    pub fn call_prefix(self, name: &str) -> String {
        // JSON formats quote the name as JSON would.
        let quoted = serde_json::to_string(name).unwrap_or_else(|_| format!("\"{name}\""));
        match self {
            Format::Hermes => format!("<tool_call>\n{{\"name\": {quoted}, \"arguments\": "),
            Format::Llama3Json => format!("{{\"name\": {quoted}, \"parameters\": "),
            Format::Mistral => format!("[TOOL_CALLS][{{\"name\": {quoted}, \"arguments\": "),
            Format::Qwen3Coder => format!("<tool_call>\n<function={name}>\n"),
            Format::Pythonic => format!("[{name}("),
            Format::Harmony => harmony::call_prefix(name),
        }
    }
}

/// What the scanner knows about the text before a resume point.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prev {
    /// Nothing decided yet (bare-output forms are still possible).
    Start,
    /// Text was emitted last.
    Text,
    /// A call (or an invalid call) was emitted last.
    Call,
}

/// A tool-call parser's state: the marker formats' [`Prev`], or harmony's
/// own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolState {
    Tagged(Prev),
    Harmony(harmony::State),
}

/// A tool-call parser for one format and the request's tools.
#[derive(Debug, Clone)]
pub struct ToolParser {
    pub format: Format,
    pub tools: Tools,
}

impl Parser for ToolParser {
    type State = ToolState;

    fn initial(&self) -> ToolState {
        match self.format {
            Format::Harmony => ToolState::Harmony(Harmony::calls(&self.tools).initial()),
            _ => ToolState::Tagged(Prev::Start),
        }
    }

    fn parse(&self, text: &str, from: usize, state: ToolState, partial: bool) -> Parsed<ToolState> {
        let prev = match state {
            ToolState::Tagged(prev) => prev,
            ToolState::Harmony(s) => {
                let p = Harmony::calls(&self.tools).parse(text, from, s, partial);
                return Parsed {
                    segs: p.segs,
                    safe: p.safe,
                    state: ToolState::Harmony(p.state),
                };
            }
        };
        let tagged = |p: Parsed<Prev>| Parsed {
            segs: p.segs,
            safe: p.safe,
            state: ToolState::Tagged(p.state),
        };
        tagged(self.parse_tagged(text, from, prev, partial))
    }
}

impl ToolParser {
    /// [`Parser::parse`] for the formats with call markers.
    fn parse_tagged(&self, text: &str, from: usize, prev: Prev, partial: bool) -> Parsed<Prev> {
        let tools = &self.tools;
        if from == 0 && prev == Prev::Start {
            let bare = match self.format {
                Format::Hermes => bare_json(text, partial, tools, false),
                Format::Llama3Json => bare_json(text, partial, tools, true),
                Format::Pythonic => pythonic::bare(text, partial, tools),
                Format::Mistral | Format::Qwen3Coder | Format::Harmony => Bare::NotBare,
            };
            match bare {
                Bare::Calls(calls) => {
                    let segs = calls
                        .into_iter()
                        .map(|(name, arguments)| Seg::Call { name, arguments })
                        .collect();
                    return Parsed {
                        segs,
                        safe: text.len(),
                        state: Prev::Call,
                    };
                }
                Bare::Undecided => {
                    return Parsed {
                        segs: Vec::new(),
                        safe: 0,
                        state: Prev::Start,
                    }
                }
                Bare::NotBare => {}
            }
        }
        match self.format {
            Format::Hermes => drive(&hermes::Hermes { tools }, text, from, prev, partial),
            Format::Llama3Json => {
                drive(&llama3_json::PythonTag { tools }, text, from, prev, partial)
            }
            Format::Mistral => drive(&mistral::Mistral { tools }, text, from, prev, partial),
            Format::Qwen3Coder => drive(
                &qwen3_coder::Qwen3Coder { tools },
                text,
                from,
                prev,
                partial,
            ),
            Format::Pythonic => drive(&pythonic::PythonStart { tools }, text, from, prev, partial),
            // Parsed by `Parser::parse` before this.
            Format::Harmony => Parsed {
                segs: Vec::new(),
                safe: from,
                state: prev,
            },
        }
    }
}

/// Part of a parsed call block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Item {
    Call {
        name: String,
        arguments: String,
    },
    /// The original text `start..end` of a call that failed.
    Invalid(usize, usize),
}

/// What a format makes of the text at one of its markers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    /// Calls (or per-call failures) and the offset where the block ends.
    Parsed(Vec<Item>, usize),
    /// The whole block from the marker to this offset is an invalid call.
    Invalid(usize),
    /// Not decidable yet (partial mode only; final mode always decides).
    Incomplete,
}

/// A format with call markers.
pub trait Tagged {
    /// Strings that start a call.
    fn markers(&self) -> &'static [&'static str];
    /// Parses the call block at `m` (where a marker starts). In partial
    /// mode it may return `Parsed`/`Invalid` only when no continuation of
    /// the text could change them.
    fn attempt(&self, text: &str, m: usize, partial: bool) -> Attempt;
}

/// Runs a tagged format over `text[from..]`.
pub fn drive<T: Tagged>(
    format: &T,
    text: &str,
    from: usize,
    prev: Prev,
    partial: bool,
) -> Parsed<Prev> {
    let markers = format.markers();
    let mut out = Out {
        text,
        partial,
        segs: Vec::new(),
        safe: from,
        prev,
    };
    let mut pos = from;
    loop {
        let Some((m, which)) = find_any(text, pos, markers) else {
            let hold = if partial {
                held_from(text, pos, markers)
            } else {
                text.len()
            };
            return out.tail(pos, hold);
        };
        let end = match format.attempt(text, m, partial) {
            // The text before the marker is certain, but its trailing
            // whitespace waits for the block's outcome.
            Attempt::Incomplete if partial => return out.tail(pos, m),
            Attempt::Parsed(items, end) => {
                out.text(pos, m, matches!(items.first(), Some(Item::Call { .. })));
                for item in items {
                    match item {
                        Item::Call { name, arguments } => out.push(Seg::Call { name, arguments }),
                        Item::Invalid(a, b) => out.push(Seg::Invalid(text[a..b].to_string())),
                    }
                }
                end
            }
            Attempt::Invalid(end) => {
                out.text(pos, m, false);
                out.push(Seg::Invalid(text[m..end].to_string()));
                end
            }
            // Final mode always decides; should a format not, the rest is
            // one invalid call rather than lost.
            Attempt::Incomplete => {
                out.text(pos, m, false);
                out.push(Seg::Invalid(text[m..].to_string()));
                text.len()
            }
        };
        // Always make progress past the marker (markers are ASCII).
        pos = end.max(m + markers[which].len()).min(text.len());
        out.safe = pos;
    }
}

/// Collects segments with the whitespace rules of the module docs: the
/// whitespace between text and a *call* is dropped; an invalid call is
/// content, so the text around it is kept whole.
struct Out<'a> {
    text: &'a str,
    partial: bool,
    segs: Vec<Seg>,
    safe: usize,
    prev: Prev,
}

impl Out<'_> {
    /// Text `a..m`, followed by a decided block at `m` that starts with a
    /// call when `before_call`.
    fn text(&mut self, a: usize, m: usize, before_call: bool) {
        let mut s = &self.text[a..m];
        if self.prev == Prev::Call {
            s = s.trim_start();
        }
        if before_call {
            s = s.trim_end();
        }
        if !s.is_empty() {
            self.segs.push(Seg::Text(s.to_string()));
            self.prev = Prev::Text;
        }
    }

    /// A call or invalid call.
    fn push(&mut self, seg: Seg) {
        self.prev = if matches!(seg, Seg::Call { .. }) {
            Prev::Call
        } else {
            Prev::Text
        };
        self.segs.push(seg);
    }

    /// Text from `a` up to `hold`, with nothing decided after it: in
    /// partial mode `hold..` may still become a marker (or is a block not
    /// decided yet), and trailing whitespace waits too.
    fn tail(mut self, a: usize, hold: usize) -> Parsed<Prev> {
        let s = &self.text[a..hold];
        let lead = if self.prev == Prev::Call {
            s.len() - s.trim_start().len()
        } else {
            0
        };
        let end = if self.partial {
            a + s.trim_end().len()
        } else {
            hold
        };
        if a + lead < end {
            self.segs
                .push(Seg::Text(self.text[a + lead..end].to_string()));
            self.prev = Prev::Text;
            self.safe = end;
        } else {
            self.safe = if self.partial { a } else { hold };
        }
        Parsed {
            segs: self.segs,
            safe: self.safe,
            state: self.prev,
        }
    }
}

/// The span of a call block (marker at `m`) that failed at `from`: up to
/// and including the first `close` at or after `from`, unless the next
/// marker comes first, in which case up to that marker; with neither, to
/// the end of the output (final mode) or undecided (partial). Both searches
/// start at `from`, so a close tag or marker inside the part already read
/// (e.g. in a JSON string) does not count.
pub fn failed_block(
    text: &str,
    m: usize,
    from: usize,
    close: &str,
    markers: &[&str],
    marker_len: usize,
    partial: bool,
) -> Attempt {
    let from = from.max(m + marker_len).min(text.len());
    let next = find_any(text, from, markers).map(|(n, _)| n);
    match (crate::text::find(text, from, close), next) {
        // A close tag or marker found now stays the first one found: one
        // not found yet could only start after the text's current end.
        (Some(c), n) if n.is_none_or(|n| c < n) => Attempt::Invalid(c + close.len()),
        (_, Some(n)) => Attempt::Invalid(n),
        _ if partial => Attempt::Incomplete,
        _ => Attempt::Invalid(text.len()),
    }
}

/// The result of checking whether the whole output is a bare call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bare {
    /// It is (final mode only): (name, arguments) per call.
    Calls(Vec<(String, String)>),
    /// It may still become one (partial mode only): hold everything.
    Undecided,
    /// It is not; parse it as tagged text.
    NotBare,
}

/// Whether the whole output (whitespace around it aside) is a bare JSON
/// call object naming a declared tool, optionally in a ```` ```json ````
/// (or ```` ``` ````) fence; with `several`, objects separated by `;`
/// (Llama 3). Anything else, including a call of an undeclared function,
/// is not a call: the output stays text.
pub fn bare_json(text: &str, partial: bool, tools: &Tools, several: bool) -> Bare {
    // "Cut short here": undecided while streaming, not a call at the end.
    let short = if partial {
        Bare::Undecided
    } else {
        Bare::NotBare
    };
    let mut p = skip_ws(text, 0);
    if p == text.len() {
        return short;
    }
    let fenced = text[p..].starts_with('`');
    if fenced {
        let rest = &text[p..];
        if could_become(rest, "```") {
            return short;
        }
        if !rest.starts_with("```") {
            return Bare::NotBare;
        }
        p += 3;
        let word_len = text[p..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
            .unwrap_or(text.len() - p);
        let word = text[p..p + word_len].to_ascii_lowercase();
        p += word_len;
        if p == text.len() {
            return if partial && "json".starts_with(&word) {
                Bare::Undecided
            } else {
                Bare::NotBare
            };
        }
        if !(word.is_empty() || word == "json") {
            return Bare::NotBare;
        }
    }
    let mut calls = Vec::new();
    loop {
        p = skip_ws(text, p);
        if p == text.len() {
            return short;
        }
        let end = match json::scan(text, p) {
            Scan::Complete(end) => end,
            Scan::Incomplete => return short,
            Scan::Malformed => return Bare::NotBare,
        };
        match json::call_from_text(&text[p..end]) {
            Some((name, arguments)) if tools.declared(&name) => calls.push((name, arguments)),
            _ => return Bare::NotBare,
        }
        p = skip_ws(text, end);
        if several && text[p..].starts_with(';') {
            p = skip_ws(text, p + 1);
            if p == text.len() {
                // A trailing `;` ends the list.
                break;
            }
            continue;
        }
        break;
    }
    if fenced {
        let rest = &text[p..];
        if could_become(rest, "```") {
            return short;
        }
        if !rest.starts_with("```") {
            return Bare::NotBare;
        }
        p = skip_ws(text, p + 3);
    }
    if p < text.len() {
        Bare::NotBare
    } else if partial {
        Bare::Undecided
    } else {
        Bare::Calls(calls)
    }
}

#[cfg(test)]
mod tests;
