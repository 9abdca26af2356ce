//! Incremental, UTF-8-safe detokenization and stop strings matched across
//! token boundaries.
//!
//! Detokenization re-decodes a short window of ids (the scheme of vLLM's
//! `detokenize_incrementally`): text is emitted only once the window's
//! decode no longer ends in U+FFFD (an incomplete multi-byte character).

use crate::model::{ModelError, TextTokenizer};

/// Turns a growing id sequence into text deltas.
#[derive(Debug)]
pub struct Detokenizer {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    /// Drop special tokens' text (the default); output parsers need it kept.
    skip_special: bool,
}

impl Default for Detokenizer {
    fn default() -> Self {
        Detokenizer::with_context(&[])
    }
}

impl Detokenizer {
    /// A detokenizer primed with the last few prompt ids, so decoders that
    /// strip a leading space (SentencePiece) keep the first generated
    /// token's space; the context itself is never emitted.
    pub fn with_context(context: &[u32]) -> Self {
        Detokenizer {
            ids: context.to_vec(),
            prefix_offset: 0,
            read_offset: context.len(),
            skip_special: true,
        }
    }

    /// Keeps special tokens' text (`<tool_call>`, `[TOOL_CALLS]`, ...) in
    /// the output, for the output pipeline's parsers.
    pub fn keeping_special(mut self, keep: bool) -> Self {
        self.skip_special = !keep;
        self
    }

    /// Appends `id` and returns the newly complete text (maybe empty).
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<String, ModelError> {
        self.ids.push(id);
        let prefix = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.starts_with(&prefix) {
            let delta = full[prefix.len()..].to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Text still held back (an incomplete character at the end), decoded
    /// as-is when generation ends.
    pub fn flush(&mut self, tok: &TextTokenizer) -> Result<String, ModelError> {
        let prefix = tok.decode(
            &self.ids[self.prefix_offset..self.read_offset],
            self.skip_special,
        )?;
        let full = tok.decode(&self.ids[self.prefix_offset..], self.skip_special)?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        Ok(full.get(prefix.len()..).unwrap_or("").to_string())
    }
}

/// Holds back text that could be the start of a stop string.
#[derive(Debug)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

/// Result of feeding text to a [`StopMatcher`].
#[derive(Debug, PartialEq, Eq)]
pub struct StopFeed {
    /// Text safe to emit now.
    pub emit: String,
    /// The stop string that matched (emit `emit`, then finish).
    pub stopped: Option<String>,
}

impl StopMatcher {
    /// Matcher for `stops` (empty strings ignored).
    pub fn new(stops: &[String]) -> Self {
        StopMatcher {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            pending: String::new(),
        }
    }

    /// Feeds a delta; returns what can be emitted and whether a stop matched
    /// (the stop text itself is never emitted).
    pub fn feed(&mut self, delta: &str) -> StopFeed {
        self.pending.push_str(delta);
        if self.stops.is_empty() {
            return StopFeed {
                emit: std::mem::take(&mut self.pending),
                stopped: None,
            };
        }
        // The earliest match wins; at the same position, the longer string
        // (it is what the text actually contains).
        if let Some((at, stop)) = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|(at, s)| (*at, std::cmp::Reverse(s.len())))
        {
            let emit = self.pending[..at].to_string();
            let stop = stop.clone();
            self.pending.clear();
            return StopFeed {
                emit,
                stopped: Some(stop),
            };
        }
        // Keep the longest suffix that is a prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.pending.ends_with(&s[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let split = self.pending.len() - keep;
        let emit = self.pending[..split].to_string();
        self.pending.drain(..split);
        StopFeed {
            emit,
            stopped: None,
        }
    }

    /// Everything still held back (at the end of generation).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_match_across_deltas_and_are_not_emitted() {
        let mut m = StopMatcher::new(&["</end>".to_string()]);
        assert_eq!(m.feed("hello </e").emit, "hello ");
        let f = m.feed("nd> tail");
        assert_eq!(f.stopped.as_deref(), Some("</end>"));
        assert_eq!(f.emit, "");
    }

    #[test]
    fn held_back_text_is_released_when_it_cannot_match() {
        let mut m = StopMatcher::new(&["STOP".to_string()]);
        assert_eq!(m.feed("a ST").emit, "a ");
        assert_eq!(m.feed("ART").emit, "START");
        assert_eq!(m.feed("x S").emit, "x ");
        assert_eq!(m.flush(), "S");
    }

    #[test]
    fn earliest_stop_wins() {
        let mut m = StopMatcher::new(&["b".to_string(), "a".to_string()]);
        let f = m.feed("xxaxb");
        assert_eq!(f.stopped.as_deref(), Some("a"));
        assert_eq!(f.emit, "xx");
    }
}
