//! What a parser makes of the output, and the contract that makes streaming
//! equal to parsing the whole text at once.
//!
//! A parser is a left-to-right scanner over the accumulated output. In
//! *partial* mode (while output is still arriving) it returns only what can
//! no longer change however the output continues, plus `safe`: the byte
//! offset where the next parse resumes, with the scanner state there. In
//! *final* mode (at `finish`) it decides everything that is left. The
//! stream ([`crate::stream`]) feeds it `text[safe..]` again after every
//! delta, so the events of any split are the partial results followed by
//! the final one, which is what the whole text gives.

/// One decided piece of output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seg {
    /// Visible text (adjacent pieces concatenate).
    Text(String),
    /// Reasoning text (adjacent pieces concatenate).
    Reasoning(String),
    /// A complete call; `arguments` is a compact JSON object.
    Call { name: String, arguments: String },
    /// The original text of a call that could not be completed.
    Invalid(String),
}

/// The result of one parse.
#[derive(Debug)]
pub struct Parsed<S> {
    /// Newly decided segments, in order.
    pub segs: Vec<Seg>,
    /// Where the next parse resumes (a char boundary).
    pub safe: usize,
    /// The scanner state at `safe`.
    pub state: S,
}

/// A resumable output parser.
pub trait Parser {
    /// What the scanner must know about the text before a resume point.
    type State: Copy;
    /// The state at the start of the output.
    fn initial(&self) -> Self::State;
    /// Parses `text[from..]` given the state at `from` (both from the
    /// previous partial parse, or 0 and [`Parser::initial`]).
    fn parse(
        &self,
        text: &str,
        from: usize,
        state: Self::State,
        partial: bool,
    ) -> Parsed<Self::State>;
}
