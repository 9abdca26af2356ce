//! Speculative decoding: drafts proposed by a drafter, verified by the
//! target model inside the ordinary batch step, so output never changes.
//!
//! A row that speculates feeds its next token and up to `k` draft tokens in
//! one step, as a short prefill chunk in the ragged batch (`engine::step`).
//! Its plugin chain then chooses tokens position by position, exactly as it
//! would without drafts: the first position's token is chosen from the
//! logits after the row's last token; while the chosen token equals the
//! draft at that position, the next position's logits (computed with that
//! draft in the context) choose the next token, and so on. The first token
//! that differs from its draft, or the token after the last draft (the
//! bonus), ends the row's step; the KV of the drafts after the last one
//! accepted is trimmed ([`crate::cache::KvCache::truncate`]). Every token
//! is chosen once, by the row's own chain, with the history it would have
//! without speculation (the chain's `accept` runs between positions), so
//! greedy and seeded output are unchanged up to the numerics of a
//! multi-token forward, and stateful plugins see the same histories.
//!
//! Scheduling ([`RowSpec`], [`SpecGate`]): each row adapts its draft length
//! from its acceptance (grown by two after a fully accepted draft, cut by
//! one after a rejection), pauses drafting (with a doubling back-off) while
//! its acceptance rate stays low, and the batch stops drafting at a batch
//! size where measured verify steps give fewer tokens per second than
//! plain decode steps (probing again after a while).

use std::collections::BTreeMap;
use std::time::Duration;

use serde::Serialize;

use crate::plugin::drafter::PluginDrafter;

/// The default most drafts per step (`--draft-max`): prompt lookup's
/// matches in code edits run long, and the adaptive length stays below it
/// where they do not.
pub const DEFAULT_DRAFT_MAX: usize = 8;

/// A request's speculation settings, resolved against the server's
/// defaults.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecRequest {
    /// The drafter plugin; `None`: no speculation.
    pub drafter: Option<String>,
    /// The most draft tokens per step (0: no speculation).
    pub max_draft: usize,
}

impl SpecRequest {
    /// No speculation.
    pub fn off() -> Self {
        SpecRequest::default()
    }

    /// Whether the request speculates at all.
    pub fn enabled(&self) -> bool {
        self.drafter.is_some() && self.max_draft > 0
    }
}

/// What proposes a row's drafts: a drafter plugin (a native draft model
/// would implement it too).
pub trait Drafter {
    /// Up to `k` tokens to follow `history` (prompt and accepted tokens;
    /// it only grows between calls).
    fn draft(&mut self, history: &[u32], k: usize) -> Result<Vec<u32>, String>;
    /// Names the drafter in logs.
    fn name(&self) -> &str;
    /// Time spent drafting.
    fn time(&self) -> Duration;
}

impl Drafter for PluginDrafter {
    fn draft(&mut self, history: &[u32], k: usize) -> Result<Vec<u32>, String> {
        PluginDrafter::draft(self, history, k).map_err(|e| e.to_string())
    }
    fn name(&self) -> &str {
        PluginDrafter::name(self)
    }
    fn time(&self) -> Duration {
        self.plugin_time
    }
}

/// Below this acceptance rate (accepted / drafted, smoothed) a row pauses
/// drafting.
pub const MIN_ACCEPTANCE: f64 = 0.25;
/// Smoothing of a row's acceptance rate (weight of the newest step).
const ACCEPT_ALPHA: f64 = 0.3;
/// Steps a row first pauses for; each pause in a row doubles it up to
/// [`MAX_PAUSE`].
const FIRST_PAUSE: u32 = 8;
const MAX_PAUSE: u32 = 256;

/// One row's speculation state.
pub struct RowSpec {
    drafter: Box<dyn Drafter>,
    /// The request's bound on the draft length.
    pub max_draft: usize,
    /// The draft length the row asks for next.
    pub k: usize,
    /// Smoothed acceptance rate.
    rate: f64,
    /// Steps left before the row drafts again.
    pause: u32,
    /// The next pause's length.
    next_pause: u32,
    /// Tokens drafted and fed for verification.
    pub drafted: u64,
    /// Of those, accepted.
    pub accepted: u64,
}

impl RowSpec {
    /// Speculation with `drafter`, at most `max_draft` tokens per step.
    pub fn new(drafter: Box<dyn Drafter>, max_draft: usize) -> Self {
        RowSpec {
            drafter,
            max_draft,
            k: max_draft.clamp(1, 4),
            rate: 0.5,
            pause: 0,
            next_pause: FIRST_PAUSE,
            drafted: 0,
            accepted: 0,
        }
    }

    /// Drafts for the row's next step: up to `min(k, room)` tokens, or
    /// none while paused. A drafter failure is returned (the caller drops
    /// the drafter).
    pub fn propose(&mut self, history: &[u32], room: usize) -> Result<Vec<u32>, String> {
        if self.pause > 0 {
            self.pause -= 1;
            return Ok(Vec::new());
        }
        let k = self.k.min(room);
        if k == 0 {
            return Ok(Vec::new());
        }
        self.drafter.draft(history, k)
    }

    /// After a verification that fed `drafted` drafts of which `accepted`
    /// were taken: adapts `k` and pauses a row whose drafts keep failing.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        let rate = accepted as f64 / drafted as f64;
        self.rate = (1.0 - ACCEPT_ALPHA) * self.rate + ACCEPT_ALPHA * rate;
        self.k = if accepted == drafted {
            (self.k + 2).min(self.max_draft)
        } else {
            self.k.saturating_sub(1).max(1)
        };
        if self.rate < MIN_ACCEPTANCE {
            self.pause = self.next_pause;
            self.next_pause = (self.next_pause * 2).min(MAX_PAUSE);
            // Probe again from the threshold with one token.
            self.rate = MIN_ACCEPTANCE;
            self.k = 1;
        } else if accepted > 0 {
            self.next_pause = FIRST_PAUSE;
        }
    }

    /// The drafter's name.
    pub fn drafter_name(&self) -> &str {
        self.drafter.name()
    }

    /// Time the drafter took.
    pub fn drafter_time(&self) -> Duration {
        self.drafter.time()
    }
}

/// A verification in progress: the drafts a step fed after the row's
/// token, the logits of every fed position from that token on, and where
/// the row's chain is.
pub struct Verify {
    /// The drafts fed.
    pub drafts: Vec<u32>,
    /// Raw logits `[1 + drafts, V]`: row `j` predicts the token after
    /// draft `j` (row 0: after the row's own token).
    pub logits: mlx_rs::Array,
    /// The logits row the chain uses next.
    pub next: usize,
    /// Drafts accepted so far.
    pub accepted: usize,
    /// Whether the last chosen token equalled its draft.
    pub matched: bool,
}

impl Verify {
    /// Whether the row's chain chooses another token in this step.
    pub fn continues(&self) -> bool {
        self.matched && self.next <= self.drafts.len()
    }
}

/// Steps of each kind at a batch size before the gate judges it.
const GATE_MIN_SAMPLES: u32 = 6;
/// Steps drafting stays off at a batch size once it did not pay; then
/// verify steps are measured again.
const GATE_OFF_STEPS: u32 = 128;
/// A plain (draft-free) step is forced this often while drafting pays, so
/// the plain rate stays measured.
const GATE_PROBE_EVERY: u64 = 64;
/// Smoothing of the gate's rates.
const GATE_ALPHA: f64 = 0.2;

#[derive(Debug, Default, Clone)]
struct GateEntry {
    /// Tokens per second of decode steps without drafts.
    plain: f64,
    plain_n: u32,
    /// ... of steps with drafts.
    spec: f64,
    spec_n: u32,
    /// Steps left with drafting off.
    off: u32,
}

/// The batch-wide judgement: at each batch size, whether steps with
/// drafts emit more tokens per second than steps without (measured on the
/// running server, decode-only steps).
#[derive(Debug, Default)]
pub struct SpecGate {
    by_rows: BTreeMap<usize, GateEntry>,
    steps: u64,
    /// Steps the gate turned drafting off for.
    pub off_steps: u64,
}

impl SpecGate {
    /// Whether rows may draft in a step of `rows` rows.
    pub fn allows(&mut self, rows: usize) -> bool {
        self.steps += 1;
        let e = self.by_rows.entry(rows).or_default();
        if e.off > 0 {
            e.off -= 1;
            self.off_steps += 1;
            if e.off == 0 {
                // Measure both again.
                e.spec_n = 0;
                e.plain_n = 0;
            }
            return false;
        }
        // Keep the plain rate measured.
        !(self.steps.is_multiple_of(GATE_PROBE_EVERY)
            || (e.plain_n < 2 && e.spec_n >= GATE_MIN_SAMPLES))
    }

    /// A decode-only step of `rows` rows emitted `tokens` in `took`;
    /// `drafted`: whether any row verified drafts in it.
    pub fn record(&mut self, rows: usize, tokens: usize, took: Duration, drafted: bool) {
        let secs = took.as_secs_f64();
        if rows == 0 || secs <= 0.0 {
            return;
        }
        let rate = tokens as f64 / secs;
        let e = self.by_rows.entry(rows).or_default();
        let (r, n) = if drafted {
            (&mut e.spec, &mut e.spec_n)
        } else {
            (&mut e.plain, &mut e.plain_n)
        };
        *r = if *n == 0 {
            rate
        } else {
            (1.0 - GATE_ALPHA) * *r + GATE_ALPHA * rate
        };
        *n = n.saturating_add(1);
        if e.spec_n >= GATE_MIN_SAMPLES && e.plain_n >= 2 && e.spec < e.plain {
            tracing::debug!(
                rows,
                spec_tok_s = e.spec,
                plain_tok_s = e.plain,
                "speculation does not pay at this batch size; off for a while"
            );
            e.off = GATE_OFF_STEPS;
        }
    }

    /// Per batch size: (rows, plain tok/s, spec tok/s, drafting now).
    pub fn table(&self) -> Vec<GateRow> {
        self.by_rows
            .iter()
            .map(|(&rows, e)| GateRow {
                rows,
                plain_tok_s: e.plain,
                spec_tok_s: e.spec,
                drafting: e.off == 0,
            })
            .collect()
    }
}

/// One batch size in the gate's table (`/stats`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct GateRow {
    /// Rows in the step.
    pub rows: usize,
    /// Smoothed tokens per second of decode steps without drafts.
    pub plain_tok_s: f64,
    /// ... with drafts.
    pub spec_tok_s: f64,
    /// Whether rows may draft at this batch size now.
    pub drafting: bool,
}

/// Speculation counters (`GET /stats` under `batch.speculative`).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct SpecStats {
    /// Draft tokens fed for verification.
    pub drafted: u64,
    /// Of those, accepted (emitted as they were drafted).
    pub accepted: u64,
    /// `accepted / drafted` (0 before any draft).
    pub acceptance_rate: f64,
    /// Steps in which at least one row verified drafts.
    pub verify_steps: u64,
    /// Drafter calls that failed (trap, deadline, error); the row then
    /// decoded without drafts.
    pub drafter_failures: u64,
    /// Steps in which the batch gate kept rows from drafting.
    pub gate_off_steps: u64,
    /// The gate's measurements per batch size.
    pub by_batch_size: Vec<GateRow>,
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed(Vec<u32>);
    impl Drafter for Fixed {
        fn draft(&mut self, _: &[u32], k: usize) -> Result<Vec<u32>, String> {
            Ok(self.0.iter().copied().take(k).collect())
        }
        fn name(&self) -> &str {
            "fixed"
        }
        fn time(&self) -> Duration {
            Duration::ZERO
        }
    }

    #[test]
    fn k_grows_on_full_acceptance_shrinks_on_rejection_and_pauses_when_low() {
        let mut r = RowSpec::new(Box::new(Fixed(vec![1; 16])), 8);
        assert_eq!(r.k, 4);
        r.record(4, 4);
        assert_eq!(r.k, 6);
        r.record(6, 6);
        assert_eq!(r.k, 8, "capped at max_draft");
        r.record(8, 3);
        assert_eq!(r.k, 7);
        for _ in 0..6 {
            r.record(r.k, 0);
        }
        assert!(r.pause > 0, "a row whose drafts keep failing pauses");
        assert_eq!(r.k, 1);
        let paused = r.pause;
        for _ in 0..paused {
            assert!(r.propose(&[1], 8).unwrap_or_default().is_empty());
        }
        assert_eq!(
            r.propose(&[1], 8).unwrap_or_default(),
            vec![1],
            "probes with one"
        );
        assert!(
            r.propose(&[1], 0).unwrap_or_default().is_empty(),
            "no room, no drafts"
        );
    }

    #[test]
    fn the_gate_turns_drafting_off_where_it_is_slower_and_probes_plain_steps() {
        let mut g = SpecGate::default();
        let ms = Duration::from_millis;
        for _ in 0..3 {
            g.record(8, 8, ms(100), false);
        }
        for _ in 0..GATE_MIN_SAMPLES {
            assert!(g.allows(8));
            g.record(8, 9, ms(150), true);
        }
        assert!(!g.allows(8), "60 tok/s with drafts < 80 without");
        for _ in 0..3 {
            g.record(1, 1, ms(10), false);
        }
        for _ in 0..GATE_MIN_SAMPLES {
            g.record(1, 3, ms(15), true);
        }
        assert!(g.table().iter().any(|r| r.rows == 1 && r.drafting));
    }
}
