//! `harmony`: gpt-oss's output format, where reasoning, answers and tool
//! calls are all messages of one stream:
//!
//! ```text
//! <|channel|>analysis<|message|>The user wants the weather.<|end|>
//! <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>
//! ```
//!
//! A message is an optional `<|start|>` and role, a header (`<|channel|>`
//! and its name, an optional recipient `to=NAME`, an optional content type
//! such as `<|constrain|>json`), `<|message|>`, then its body up to
//! `<|end|>`, `<|call|>` or `<|return|>` (the last two are gpt-oss's EOS
//! tokens, so they usually end the output instead), or up to the next
//! `<|start|>` or the end of the output. The first message's `<|start|>`
//! and role are in the prompt (`<|start|>assistant`), so the output starts
//! with its `<|channel|>` (or, with the recipient in the role header, with
//! ` to=`).
//!
//! One scanner, two parsers over it, cooperating in the host's pipeline
//! (reasoning parser, then tool-call parser, which sees only the first's
//! text):
//! - [`Role::Reasoning`] (the `harmony` reasoning parser): the `analysis`
//!   channel is reasoning; every other message without a recipient
//!   (`final`, and `commentary` preambles) is text; a message with a
//!   recipient is passed on as text in its original harmony form (header,
//!   body, terminator), so the tool-call parser can make a call of it.
//! - [`Role::Calls`] (the `harmony` tool-call parser): a message to
//!   `functions.NAME` with a JSON object body is a call of `NAME` (a
//!   declared function when the request declared tools); one to another
//!   recipient (gpt-oss's built-in `browser.*`, `python`), to an undeclared
//!   function, or with a body that is not a JSON object is an invalid call
//!   with its original text; a message without a recipient is its body as
//!   text (what it sees without the reasoning parser).
//!
//! Text outside messages is text; stray terminators outside a body are
//! dropped, and so is a header cut off before its `<|message|>` unless it
//! has a recipient (then it is passed on, and becomes an invalid call).
//! Whitespace between a call and text outside messages is dropped, as for
//! the other formats; bodies are kept exactly.

use crate::json;
use crate::segment::{Parsed, Parser, Seg};
use crate::text::{could_become, find, find_any, held_from};
use crate::tools::Tools;

const START: &str = "<|start|>";
const CHANNEL: &str = "<|channel|>";
const MESSAGE: &str = "<|message|>";
const CONSTRAIN: &str = "<|constrain|>";
const END: &str = "<|end|>";
const CALL: &str = "<|call|>";
const RETURN: &str = "<|return|>";

/// What may start a message or stand between messages.
const OUTSIDE: &[&str] = &[START, CHANNEL, MESSAGE, END, CALL, RETURN];
/// What ends a body.
const BODY_ENDS: &[&str] = &[END, CALL, RETURN, START];
/// The role header gpt-oss's prompt ends with: prefixed to a passed-on
/// message whose header began in the prompt.
const ASSISTANT: &str = "<|start|>assistant";

/// What the parser does with messages.
#[derive(Debug, Clone, Copy)]
pub enum Role<'a> {
    /// The reasoning parser: analysis is reasoning, recipients pass on.
    Reasoning,
    /// The tool-call parser: recipients are calls of these tools.
    Calls(&'a Tools),
}

/// Where a body's text goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Body {
    /// Reasoning (the analysis channel).
    Reasoning,
    /// Text (a message without a recipient).
    Text,
    /// Passed on in harmony form (the reasoning parser, a recipient).
    Raw,
}

/// Where the scanner is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// The start of the output: a header may begin without a marker (its
    /// role part was in the prompt).
    Start,
    /// Outside messages; `after_call`: a call was emitted last.
    Between { after_call: bool },
    /// Inside a message body.
    Body(Body),
}

/// A harmony parser (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct Harmony<'a> {
    role: Role<'a>,
    initial: State,
}

/// A parsed header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Header<'a> {
    channel: Option<&'a str>,
    recipient: Option<&'a str>,
}

/// The channel and recipient of the header text `h` (markers included).
fn header(h: &str) -> Header<'_> {
    let h = h.strip_prefix(START).unwrap_or(h);
    let (role_part, channel_part) = match h.find(CHANNEL) {
        Some(i) => (&h[..i], Some(&h[i + CHANNEL.len()..])),
        None => (h, None),
    };
    let channel = channel_part.and_then(|c| {
        c.split(CONSTRAIN)
            .next()
            .and_then(|c| c.split_whitespace().next())
            .filter(|w| !w.starts_with("to="))
    });
    let recipient = [Some(role_part), channel_part]
        .into_iter()
        .flatten()
        .flat_map(|part| part.split(CONSTRAIN))
        .flat_map(str::split_whitespace)
        .find_map(|w| w.strip_prefix("to="))
        .filter(|r| !r.is_empty());
    Header { channel, recipient }
}

impl Harmony<'static> {
    /// The reasoning parser, for a prompt ending with `prompt_tail`: when
    /// the prompt opened a message's body (it ends with `<|message|>`), the
    /// output starts inside it.
    pub fn reasoning(prompt_tail: &str) -> Self {
        let initial = match prompt_tail.strip_suffix(MESSAGE) {
            Some(before) => {
                let from = [before.rfind(START), before.rfind(CHANNEL)]
                    .into_iter()
                    .flatten()
                    .max()
                    .unwrap_or(0);
                let h = header(&before[from..]);
                if h.recipient.is_some() {
                    // Its header is not in the output to pass on.
                    State::Body(Body::Text)
                } else if h.channel == Some("analysis") {
                    State::Body(Body::Reasoning)
                } else {
                    State::Body(Body::Text)
                }
            }
            None => State::Start,
        };
        Harmony {
            role: Role::Reasoning,
            initial,
        }
    }
}

impl<'a> Harmony<'a> {
    /// The tool-call parser for the request's `tools`.
    pub fn calls(tools: &'a Tools) -> Self {
        Harmony {
            role: Role::Calls(tools),
            initial: State::Start,
        }
    }

    /// A call of `recipient` with body `body`, if it is one: `(name,
    /// compact arguments)`.
    fn call(tools: &Tools, recipient: &str, body: &str) -> Option<(String, String)> {
        let name = recipient.strip_prefix("functions.")?;
        if name.is_empty() || !tools.allows(name) {
            return None;
        }
        let arguments = if body.trim().is_empty() {
            "{}".to_string()
        } else {
            json::object_text(body.trim())?
        };
        Some((name.to_string(), arguments))
    }
}

/// Collects segments: adjacent text merged, whitespace between a call and
/// text outside messages dropped.
struct Out<'a> {
    text: &'a str,
    partial: bool,
    segs: Vec<Seg>,
    after_call: bool,
}

impl Out<'_> {
    fn push(&mut self, seg: Seg) {
        if matches!(&seg, Seg::Text(s) | Seg::Reasoning(s) if s.is_empty()) {
            return;
        }
        self.after_call = matches!(seg, Seg::Call { .. });
        match (self.segs.last_mut(), seg) {
            (Some(Seg::Text(a)), Seg::Text(b)) => a.push_str(&b),
            (Some(Seg::Reasoning(a)), Seg::Reasoning(b)) => a.push_str(&b),
            (_, seg) => self.segs.push(seg),
        }
    }

    /// Text outside messages `a..b`, followed by a call when `before_call`;
    /// returns where the text decided so far ends (in partial mode without
    /// `before_call`, trailing whitespace waits: a call may follow).
    fn outside(&mut self, a: usize, b: usize, before_call: bool, undecided_after: bool) -> usize {
        let mut s = &self.text[a..b];
        let mut start = a;
        if self.after_call {
            let trimmed = s.trim_start();
            start += s.len() - trimmed.len();
            s = trimmed;
        }
        let mut end = b;
        if before_call || (undecided_after && self.partial) {
            let trimmed = s.trim_end();
            end = start + trimmed.len();
            s = trimmed;
        }
        if !s.is_empty() {
            self.push(Seg::Text(s.to_string()));
        }
        if before_call || (undecided_after && self.partial) {
            end
        } else {
            b
        }
    }

    fn body(&mut self, kind: Body, s: &str) {
        let seg = match kind {
            Body::Reasoning => Seg::Reasoning(s.to_string()),
            Body::Text | Body::Raw => Seg::Text(s.to_string()),
        };
        self.push(seg);
    }

    fn done<S>(self, safe: usize, state: S) -> Parsed<S> {
        Parsed {
            segs: self.segs,
            safe,
            state,
        }
    }
}

/// How a message at `m` turned out.
enum Message {
    /// Not decidable yet: hold from the message's start.
    Hold,
    /// Continue at `pos` in `state`.
    Next(usize, State),
}

impl Harmony<'_> {
    /// The message whose header starts at `m` (its marker `marker_len`
    /// long; 0 for a header continued from the prompt).
    fn message(&self, out: &mut Out<'_>, pos: usize, m: usize, marker_len: usize) -> Message {
        let text = out.text;
        let partial = out.partial;
        let from = m + marker_len;
        let next_start = find(text, from, START);
        let header_end = find(text, from, MESSAGE).filter(|&e| next_start.is_none_or(|s| e < s));
        let Some(he) = header_end else {
            // A header without its `<|message|>`: cut off, or broken by the
            // next message.
            if partial && next_start.is_none() {
                return Message::Hold;
            }
            let stop = next_start.unwrap_or(text.len());
            let h = header(&text[m..stop]);
            match (self.role, h.recipient) {
                (Role::Reasoning, Some(_)) => {
                    out.outside(pos, m, false, false);
                    let prefix = if marker_len == 0 { ASSISTANT } else { "" };
                    out.push(Seg::Text(format!("{prefix}{}", &text[m..stop])));
                }
                (Role::Calls(_), Some(_)) => {
                    out.outside(pos, m, false, false);
                    out.push(Seg::Invalid(text[m..stop].to_string()));
                }
                (_, None) => {
                    out.outside(pos, m, false, false);
                }
            }
            return Message::Next(
                stop,
                State::Between {
                    after_call: out.after_call,
                },
            );
        };
        let body = he + MESSAGE.len();
        let h = header(&text[m..he]);
        match (self.role, h.recipient) {
            (Role::Reasoning, Some(_)) => {
                out.outside(pos, m, false, false);
                let prefix = if marker_len == 0 { ASSISTANT } else { "" };
                out.push(Seg::Text(format!("{prefix}{}", &text[m..body])));
                Message::Next(body, State::Body(Body::Raw))
            }
            (Role::Reasoning, None) => {
                out.outside(pos, m, false, false);
                let kind = if h.channel == Some("analysis") {
                    Body::Reasoning
                } else {
                    Body::Text
                };
                Message::Next(body, State::Body(kind))
            }
            (Role::Calls(_), None) => {
                out.outside(pos, m, false, false);
                Message::Next(body, State::Body(Body::Text))
            }
            (Role::Calls(tools), Some(recipient)) => {
                let (end, block_end) = match find_any(text, body, BODY_ENDS) {
                    Some((t, k)) => (
                        t,
                        if BODY_ENDS[k] == START {
                            t
                        } else {
                            t + BODY_ENDS[k].len()
                        },
                    ),
                    None if partial => return Message::Hold,
                    None => (text.len(), text.len()),
                };
                match Self::call(tools, recipient, &text[body..end]) {
                    Some((name, arguments)) => {
                        out.outside(pos, m, true, false);
                        out.push(Seg::Call { name, arguments });
                    }
                    None => {
                        out.outside(pos, m, false, false);
                        out.push(Seg::Invalid(text[m..block_end].to_string()));
                    }
                }
                Message::Next(
                    block_end,
                    State::Between {
                        after_call: out.after_call,
                    },
                )
            }
        }
    }
}

impl Parser for Harmony<'_> {
    type State = State;

    fn initial(&self) -> State {
        self.initial
    }

    fn parse(&self, text: &str, from: usize, mut state: State, partial: bool) -> Parsed<State> {
        let mut out = Out {
            text,
            partial,
            segs: Vec::new(),
            after_call: matches!(state, State::Between { after_call: true }),
        };
        let mut pos = from;
        loop {
            match state {
                State::Start => {
                    // The role header continued from the prompt
                    // (`<|start|>assistant` then ` to=functions.f...`).
                    let rest = &text[pos..];
                    if rest.starts_with(" to=") || rest.starts_with("to=") {
                        match self.message(&mut out, pos, pos, 0) {
                            Message::Hold => return out.done(pos, state),
                            Message::Next(p, s) => (pos, state) = (p, s),
                        }
                    } else if partial && (could_become(rest, " to=") || could_become(rest, "to=")) {
                        return out.done(pos, state);
                    } else {
                        state = State::Between { after_call: false };
                    }
                }
                State::Between { .. } => {
                    let Some((m, k)) = find_any(text, pos, OUTSIDE) else {
                        if !partial {
                            out.outside(pos, text.len(), false, false);
                            let state = State::Between {
                                after_call: out.after_call,
                            };
                            return out.done(text.len(), state);
                        }
                        let hold = held_from(text, pos, OUTSIDE);
                        let safe = out.outside(pos, hold, false, true);
                        let state = State::Between {
                            after_call: out.after_call,
                        };
                        return out.done(safe, state);
                    };
                    match OUTSIDE[k] {
                        // Stray terminators outside a body.
                        END | CALL | RETURN => {
                            out.outside(pos, m, false, false);
                            pos = m + OUTSIDE[k].len();
                            state = State::Between {
                                after_call: out.after_call,
                            };
                        }
                        marker => {
                            // `<|message|>` alone: a body with no header.
                            let marker_len = if marker == MESSAGE { 0 } else { marker.len() };
                            match self.message(&mut out, pos, m, marker_len) {
                                Message::Hold => {
                                    let safe = out.outside(pos, m, false, true);
                                    let state = State::Between {
                                        after_call: out.after_call,
                                    };
                                    return out.done(safe, state);
                                }
                                Message::Next(p, s) => (pos, state) = (p, s),
                            }
                        }
                    }
                }
                State::Body(kind) => match find_any(text, pos, BODY_ENDS) {
                    Some((t, k)) => {
                        out.body(kind, &text[pos..t]);
                        let marker = BODY_ENDS[k];
                        pos = if marker == START { t } else { t + marker.len() };
                        if kind == Body::Raw && marker != START {
                            out.body(kind, marker);
                        }
                        state = State::Between {
                            after_call: out.after_call,
                        };
                    }
                    None if partial => {
                        let hold = held_from(text, pos, BODY_ENDS);
                        out.body(kind, &text[pos..hold]);
                        return out.done(hold, state);
                    }
                    None => {
                        out.body(kind, &text[pos..]);
                        return out.done(text.len(), state);
                    }
                },
            }
        }
    }
}

/// `call-prefix`: a call's header up to where its arguments begin, as
/// gpt-oss writes it (the prompt ends with `<|start|>assistant`).
pub fn call_prefix(name: &str) -> String {
    format!("{CHANNEL}commentary to=functions.{name} {CONSTRAIN}json{MESSAGE}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_give_channel_and_recipient_wherever_it_stands() {
        let h = header("<|channel|>commentary to=functions.get_weather <|constrain|>json");
        assert_eq!(h.channel, Some("commentary"));
        assert_eq!(h.recipient, Some("functions.get_weather"));
        let h = header("<|start|>assistant to=functions.f<|channel|>commentary json");
        assert_eq!(
            (h.channel, h.recipient),
            (Some("commentary"), Some("functions.f"))
        );
        let h = header("<|start|>assistant<|channel|>analysis");
        assert_eq!((h.channel, h.recipient), (Some("analysis"), None));
        let h = header("<|channel|>commentary to=functions.f<|constrain|>json");
        assert_eq!(h.recipient, Some("functions.f"));
        assert_eq!(header("").recipient, None);
    }

    #[test]
    fn a_prompt_that_opened_a_body_starts_inside_it() {
        let r = Harmony::reasoning("<|start|>assistant<|channel|>analysis<|message|>");
        assert_eq!(r.initial, State::Body(Body::Reasoning));
        let r = Harmony::reasoning("<|start|>assistant<|channel|>final<|message|>");
        assert_eq!(r.initial, State::Body(Body::Text));
        assert_eq!(
            Harmony::reasoning("<|start|>assistant").initial,
            State::Start
        );
    }

    use crate::stream::{Event, Stream};

    fn tools() -> Tools {
        Tools::new([("get_weather".to_string(), "{}".to_string())])
    }

    #[test]
    fn reasoning_and_answers_stream_as_they_come() {
        let mut s = Stream::new(Harmony::reasoning("<|start|>assistant"), "");
        assert!(s.feed("<|channel|>analy").is_empty());
        assert!(s.feed("sis<|message|>").is_empty());
        assert_eq!(s.feed("Think"), [Event::Reasoning("Think".into())]);
        // A possible terminator's start is held.
        assert_eq!(s.feed("ing<|e"), [Event::Reasoning("ing".into())]);
        assert!(s
            .feed("nd|><|start|>assistant<|channel|>final<|message|>")
            .is_empty());
        assert_eq!(s.feed("Hi"), [Event::Text("Hi".into())]);
        assert!(s.finish().is_empty());
    }

    #[test]
    fn a_call_is_held_until_its_body_ends() {
        let tools = tools();
        let mut s = Stream::new(Harmony::calls(&tools), "");
        let head = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>";
        assert!(s.feed(head).is_empty());
        assert!(s.feed("{\"city\": \"Paris\"}").is_empty());
        let events = s.finish();
        assert!(
            matches!(&events[..], [Event::CallStart { name, .. }, Event::CallArguments { arguments, .. }, Event::CallEnd(0)]
            if name == "get_weather" && arguments == "{\"city\":\"Paris\"}")
        );
    }

    #[test]
    fn without_the_reasoning_parser_bodies_are_text() {
        let tools = tools();
        let mut s = Stream::new(Harmony::calls(&tools), "");
        let mut events = s.feed(
            "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>commentary \
             to=functions.get_weather <|constrain|>json<|message|>{}<|call|>",
        );
        events.extend(s.finish());
        assert_eq!(events[0], Event::Text("hm".into()));
        assert!(matches!(&events[1], Event::CallStart { name, .. } if name == "get_weather"));
    }
}
