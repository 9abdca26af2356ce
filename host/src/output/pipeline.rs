//! One output pipeline per request, after the engine's detokenizer and
//! stop strings: reasoning parser -> tool-call parser -> control-token
//! filter -> canonical events for the adapter.
//!
//! Streamed and non-streamed responses are rendered from the same event
//! sequence: a stream renders each batch of events as it comes, a
//! non-streamed response renders [`merge`] of all of them, so they agree
//! by construction (vLLM's `output_processor.py` renders DELTA and
//! FINAL_ONLY from one request state the same way).

use super::parser::{GenerationEvent, ParserSession, ToolCallDelta};
use crate::plugin::PluginError;

/// The request's output stages.
pub struct OutputPipeline {
    reasoning: Option<ParserSession>,
    tools: Option<ParserSession>,
    /// Special-token texts users never see (what a parser did not consume).
    hidden: Vec<String>,
    /// Ids since the last text delta (the tokens that completed it).
    pending_ids: Vec<u32>,
    tool_calls: usize,
    invalid_calls: usize,
    /// `parallel_tool_calls: false`: the reply ends after its first call.
    single_call: bool,
    /// The reply ended (after its only allowed call); later output is not
    /// part of it.
    ended: bool,
}

impl OutputPipeline {
    /// A pipeline with the given parsers; `hidden` are special-token texts
    /// to remove from visible text (they reach the parsers first).
    pub fn new(
        reasoning: Option<ParserSession>,
        tools: Option<ParserSession>,
        hidden: Vec<String>,
    ) -> Self {
        OutputPipeline {
            reasoning,
            tools,
            hidden,
            pending_ids: Vec::new(),
            tool_calls: 0,
            invalid_calls: 0,
            single_call: false,
            ended: false,
        }
    }

    /// Ends the reply after its first complete call (`parallel_tool_calls:
    /// false`): what follows is dropped as text after a stop string is.
    pub fn single_call(mut self, on: bool) -> Self {
        self.single_call = on;
        self
    }

    /// Whether the reply already ended (the row can stop).
    pub fn ended(&self) -> bool {
        self.ended
    }

    /// A pipeline that passes text through (no parser).
    pub fn plain() -> Self {
        OutputPipeline::new(None, None, Vec::new())
    }

    /// Whether a parser runs (then the engine keeps special tokens' text).
    pub fn parses(&self) -> bool {
        self.reasoning.is_some() || self.tools.is_some()
    }

    /// The tool-call parser, when one runs (`call-prefix` for tool choice).
    pub fn tool_parser(&mut self) -> Option<&mut ParserSession> {
        self.tools.as_mut()
    }

    /// Complete tool calls so far.
    pub fn tool_calls(&self) -> usize {
        self.tool_calls
    }

    /// Calls a parser could not complete (returned as content).
    pub fn invalid_calls(&self) -> usize {
        self.invalid_calls
    }

    /// A generated token id (its text follows in [`OutputPipeline::text`]).
    pub fn token(&mut self, id: u32) {
        self.pending_ids.push(id);
    }

    /// A final text delta (stop strings already applied).
    ///
    /// Errors: a parser failed (trap, deadline, malformed events).
    pub fn text(&mut self, delta: &str) -> Result<Vec<GenerationEvent>, PluginError> {
        if self.ended {
            return Ok(Vec::new());
        }
        let ids = std::mem::take(&mut self.pending_ids);
        let stage1 = match &mut self.reasoning {
            Some(r) => r.feed(delta, &ids)?,
            None => vec![GenerationEvent::Text(delta.to_string())],
        };
        self.tool_stage(stage1, &ids, false)
    }

    /// End of output: flushes both parsers.
    ///
    /// Errors: as [`OutputPipeline::text`].
    pub fn finish(&mut self) -> Result<Vec<GenerationEvent>, PluginError> {
        if self.ended {
            return Ok(Vec::new());
        }
        let ids = std::mem::take(&mut self.pending_ids);
        let stage1 = match &mut self.reasoning {
            Some(r) => r.finish()?,
            None => Vec::new(),
        };
        self.tool_stage(stage1, &ids, true)
    }

    fn tool_stage(
        &mut self,
        events: Vec<GenerationEvent>,
        ids: &[u32],
        last: bool,
    ) -> Result<Vec<GenerationEvent>, PluginError> {
        let mut out = Vec::new();
        let mut ids = ids;
        for e in events {
            match (e, &mut self.tools) {
                (GenerationEvent::Text(t), Some(p)) => {
                    // The ids go with the first text of this delta.
                    out.extend(p.feed(&t, ids)?);
                    ids = &[];
                }
                (e, _) => out.push(e),
            }
        }
        if last {
            if let Some(p) = &mut self.tools {
                out.extend(p.finish()?);
            }
        }
        if self.single_call {
            if let Some(end) = out
                .iter()
                .position(|e| matches!(e, GenerationEvent::ToolCallEnd(_)))
            {
                out.truncate(end + 1);
                self.ended = true;
            }
        }
        for e in &mut out {
            match e {
                // Control tokens are hidden wherever output text lands.
                GenerationEvent::Text(t) | GenerationEvent::Reasoning(t) => {
                    strip_all(t, &self.hidden)
                }
                GenerationEvent::InvalidCall(t) => {
                    strip_all(t, &self.hidden);
                    self.invalid_calls += 1;
                }
                GenerationEvent::ToolCallArgumentsDelta(d) => {
                    strip_all(&mut d.arguments, &self.hidden)
                }
                // Ids are the host's: unique across requests and restarts,
                // whatever a parser derives them from (agents key tool
                // results by id over a whole conversation).
                GenerationEvent::ToolCallStart(s) => s.id = fresh_call_id(),
                GenerationEvent::ToolCallEnd(_) => self.tool_calls += 1,
                _ => {}
            }
        }
        out.retain(|e| !matches!(e, GenerationEvent::Text(t) | GenerationEvent::Reasoning(t) if t.is_empty()));
        if self.ended {
            // A call the reply no longer includes must not stay open in the
            // parser's checks; nothing more is fed.
            self.pending_ids.clear();
        }
        Ok(out)
    }
}

/// `call_` + 24 lowercase alphanumerics (OpenAI's shape), unique per
/// process (a counter) and across restarts (the start time).
fn fresh_call_id() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    // splitmix64 scrambles the two words so ids do not look sequential.
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let (a, b) = (
        mix(nanos ^ n.rotate_left(32)),
        mix(n ^ nanos.rotate_left(17)),
    );
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyz0123456789";
    let mut id = String::with_capacity(29);
    id.push_str("call_");
    let mut bits = (u128::from(a) << 64) | u128::from(b);
    for _ in 0..24 {
        id.push(ALPHABET[(bits % 36) as usize] as char);
        bits /= 36;
    }
    id
}

fn strip_all(text: &mut String, hidden: &[String]) {
    for h in hidden {
        if text.contains(h.as_str()) {
            *text = text.replace(h.as_str(), "");
        }
    }
}

/// Merges a whole generation's events for a non-streamed response:
/// adjacent text joined, adjacent reasoning joined, a call's argument
/// fragments joined. Order is kept otherwise.
pub fn merge(events: Vec<GenerationEvent>) -> Vec<GenerationEvent> {
    let mut out: Vec<GenerationEvent> = Vec::with_capacity(events.len());
    for e in events {
        match (out.last_mut(), e) {
            (Some(GenerationEvent::Text(a)), GenerationEvent::Text(b)) => a.push_str(&b),
            (Some(GenerationEvent::Reasoning(a)), GenerationEvent::Reasoning(b)) => a.push_str(&b),
            (
                Some(GenerationEvent::ToolCallArgumentsDelta(a)),
                GenerationEvent::ToolCallArgumentsDelta(ToolCallDelta { index, arguments }),
            ) if a.index == index => a.arguments.push_str(&arguments),
            (_, e) => out.push(e),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_joins_text_and_fragments_per_call() {
        let d = |index, a: &str| {
            GenerationEvent::ToolCallArgumentsDelta(ToolCallDelta {
                index,
                arguments: a.into(),
            })
        };
        let merged = merge(vec![
            GenerationEvent::Reasoning("a".into()),
            GenerationEvent::Reasoning("b".into()),
            GenerationEvent::Text("x".into()),
            GenerationEvent::Text("y".into()),
            d(0, "{\"a\""),
            d(0, ":1}"),
            GenerationEvent::ToolCallEnd(0),
            d(1, "{}"),
        ]);
        assert_eq!(merged.len(), 5);
        assert!(matches!(&merged[0], GenerationEvent::Reasoning(t) if t == "ab"));
        assert!(matches!(&merged[1], GenerationEvent::Text(t) if t == "xy"));
        assert!(
            matches!(&merged[2], GenerationEvent::ToolCallArgumentsDelta(d) if d.arguments == "{\"a\":1}")
        );
    }

    #[test]
    fn plain_pipeline_passes_text_and_hides_nothing() {
        let mut p = OutputPipeline::plain();
        assert!(!p.parses());
        p.token(5);
        let out = p.text("hello").expect("text");
        assert!(matches!(&out[..], [GenerationEvent::Text(t)] if t == "hello"));
        assert!(p.finish().expect("finish").is_empty());
    }

    #[test]
    fn call_ids_are_unique_and_shaped_like_openai_ids() {
        let ids: std::collections::HashSet<String> = (0..1000).map(|_| fresh_call_id()).collect();
        assert_eq!(ids.len(), 1000);
        assert!(ids.iter().all(|i| i.len() == 29
            && i.starts_with("call_")
            && i[5..]
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())));
    }

    #[test]
    fn hidden_control_tokens_are_removed_from_text() {
        let mut p = OutputPipeline::new(None, None, vec!["<|eot|>".into()]);
        let out = p.text("a<|eot|>b").expect("text");
        assert!(matches!(&out[..], [GenerationEvent::Text(t)] if t == "ab"));
        assert!(p.text("<|eot|>").expect("text").is_empty());
    }

    #[test]
    fn stripping_reaches_invalid_calls_and_arguments() {
        let hidden = vec!["<|x|>".to_string()];
        let mut events = vec![
            GenerationEvent::InvalidCall("a<|x|>b".into()),
            GenerationEvent::ToolCallArgumentsDelta(ToolCallDelta {
                index: 0,
                arguments: "{\"c\":\"P<|x|>\"}".into(),
            }),
        ];
        for e in &mut events {
            match e {
                GenerationEvent::InvalidCall(t) => strip_all(t, &hidden),
                GenerationEvent::ToolCallArgumentsDelta(d) => strip_all(&mut d.arguments, &hidden),
                _ => {}
            }
        }
        assert!(matches!(&events[0], GenerationEvent::InvalidCall(t) if t == "ab"));
        assert!(
            matches!(&events[1], GenerationEvent::ToolCallArgumentsDelta(d) if d.arguments == "{\"c\":\"P\"}")
        );
    }
}
