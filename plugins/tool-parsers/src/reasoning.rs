//! The reasoning parser a session runs, by its `format`: `think`
//! ([`Think`]) or `harmony` ([`Harmony::reasoning`]).

use crate::harmony::{self, Harmony};
use crate::options::ReasoningFormat;
use crate::segment::{Parsed, Parser};
use crate::think::{self, Think};

/// One of the reasoning parsers.
#[derive(Debug, Clone, Copy)]
pub enum Reasoner {
    Think(Think),
    Harmony(Harmony<'static>),
}

/// Its state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasonerState {
    Think(think::State),
    Harmony(harmony::State),
}

impl Reasoner {
    /// The parser of `format` for a prompt ending with `prompt_tail`.
    pub fn new(format: ReasoningFormat, prompt_tail: &str) -> Self {
        match format {
            ReasoningFormat::Think => Reasoner::Think(Think::new(prompt_tail)),
            ReasoningFormat::Harmony => Reasoner::Harmony(Harmony::reasoning(prompt_tail)),
        }
    }
}

fn map<S, T>(p: Parsed<S>, f: impl FnOnce(S) -> T) -> Parsed<T> {
    Parsed {
        segs: p.segs,
        safe: p.safe,
        state: f(p.state),
    }
}

impl Parser for Reasoner {
    type State = ReasonerState;

    fn initial(&self) -> ReasonerState {
        match self {
            Reasoner::Think(t) => ReasonerState::Think(t.initial()),
            Reasoner::Harmony(h) => ReasonerState::Harmony(h.initial()),
        }
    }

    fn parse(
        &self,
        text: &str,
        from: usize,
        state: ReasonerState,
        partial: bool,
    ) -> Parsed<ReasonerState> {
        match (self, state) {
            (Reasoner::Think(t), ReasonerState::Think(s)) => {
                map(t.parse(text, from, s, partial), ReasonerState::Think)
            }
            (Reasoner::Harmony(h), ReasonerState::Harmony(s)) => {
                map(h.parse(text, from, s, partial), ReasonerState::Harmony)
            }
            // Cannot happen: the stream hands back the state this parser
            // returned. Resume with the parser's own initial state.
            (p, _) => p.parse(text, from, p.initial(), partial),
        }
    }
}
