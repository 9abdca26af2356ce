//! `think`: splits `<think>...</think>` reasoning (Qwen3, QwQ, DeepSeek-R1
//! and its distills) from the answer.
//!
//! - A `<think>` is recognised only at the start of the output (after
//!   whitespace); elsewhere it is answer text.
//! - When the prompt already opened the block (its tail ends in `<think>`,
//!   perhaps followed by whitespace), the output starts inside it.
//! - One newline right after `<think>` and one right before `</think>` are
//!   dropped, and so is the whitespace after `</think>`.
//! - Without `</think>` by the end, everything after `<think>` was
//!   reasoning (what Qwen3 and DeepSeek-R1 mean when a reply is cut short);
//!   a second `<think>` or `</think>` after the first block is answer text.

use crate::segment::{Parsed, Parser, Seg};
use crate::text::{could_become, find, held_from, skip_ws};

const OPEN: &str = "<think>";
const CLOSE: &str = "</think>";

/// Where the scanner is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Before the first non-whitespace text: a `<think>` may come.
    Start,
    /// Inside the block; `fresh`: right after `<think>` (a newline there is
    /// dropped).
    Reasoning { fresh: bool },
    /// Right after `</think>` (whitespace there is dropped).
    Closed,
    /// The answer: everything else is text.
    Answer,
}

/// The reasoning parser for one request.
#[derive(Debug, Clone, Copy)]
pub struct Think {
    initial: State,
}

impl Think {
    /// A parser for a prompt whose rendered text ends with `prompt_tail`.
    pub fn new(prompt_tail: &str) -> Self {
        let trimmed = prompt_tail.trim_end();
        let initial = if trimmed.ends_with(OPEN) {
            // The tail's own whitespace after `<think>` counts as the
            // newline to drop.
            Self::reasoning(trimmed.len() == prompt_tail.len())
        } else {
            State::Start
        };
        Think { initial }
    }

    fn reasoning(fresh: bool) -> State {
        State::Reasoning { fresh }
    }
}

impl Parser for Think {
    type State = State;

    fn initial(&self) -> State {
        self.initial
    }

    fn parse(&self, text: &str, from: usize, mut state: State, partial: bool) -> Parsed<State> {
        let mut segs = Vec::new();
        let mut pos = from;
        loop {
            match state {
                State::Start => {
                    let p = skip_ws(text, pos);
                    let rest = &text[p..];
                    if rest.starts_with(OPEN) {
                        pos = p + OPEN.len();
                        state = State::Reasoning { fresh: true };
                    } else if partial && could_become(rest, OPEN) {
                        return Parsed {
                            segs,
                            safe: pos,
                            state,
                        };
                    } else {
                        state = State::Answer;
                    }
                }
                State::Reasoning { fresh } => {
                    if fresh {
                        if pos == text.len() && partial {
                            return Parsed {
                                segs,
                                safe: pos,
                                state,
                            };
                        }
                        if text[pos..].starts_with('\n') {
                            pos += 1;
                        }
                        state = State::Reasoning { fresh: false };
                        continue;
                    }
                    if let Some(c) = find(text, pos, CLOSE) {
                        let r = &text[pos..c];
                        push(
                            &mut segs,
                            Seg::Reasoning(r.strip_suffix('\n').unwrap_or(r).to_string()),
                        );
                        pos = c + CLOSE.len();
                        state = State::Closed;
                    } else if partial {
                        // Hold a possible `</think>` start, and a newline
                        // that may be the one before it.
                        let mut hold = held_from(text, pos, &[CLOSE]);
                        if text[pos..hold].ends_with('\n') {
                            hold -= 1;
                        }
                        push(&mut segs, Seg::Reasoning(text[pos..hold].to_string()));
                        return Parsed {
                            segs,
                            safe: hold,
                            state,
                        };
                    } else {
                        push(&mut segs, Seg::Reasoning(text[pos..].to_string()));
                        return Parsed {
                            segs,
                            safe: text.len(),
                            state,
                        };
                    }
                }
                State::Closed => {
                    let p = skip_ws(text, pos);
                    if p == text.len() {
                        return Parsed {
                            segs,
                            safe: pos,
                            state,
                        };
                    }
                    pos = p;
                    state = State::Answer;
                }
                State::Answer => {
                    push(&mut segs, Seg::Text(text[pos..].to_string()));
                    return Parsed {
                        segs,
                        safe: text.len(),
                        state,
                    };
                }
            }
        }
    }
}

/// Pushes a text or reasoning segment unless it is empty.
fn push(segs: &mut Vec<Seg>, seg: Seg) {
    if !matches!(&seg, Seg::Text(s) | Seg::Reasoning(s) if s.is_empty()) {
        segs.push(seg);
    }
}
