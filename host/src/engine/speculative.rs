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
//! Drawing from the target and keeping a draft only when the draw equals it
//! is speculative sampling's acceptance rule for a drafter that proposes
//! tokens (a point-mass draft distribution): the sampled distribution is
//! exactly the target's (`docs/speculative.md`).
//!
//! Scheduling ([`RowSpec`], [`SpecGate`]): the gate measures, per batch
//! size, what a plain decode step costs and what each verified draft token
//! adds; each row estimates the probability that a draft is accepted (from
//! its last verifications) and drafts the length that emits the most
//! tokens per second under those costs ([`RowSpec::best_k`]), or pauses
//! (with a doubling back-off, then a one-token probe) when no length beats
//! plain decoding. Where even fully accepted drafts cannot pay (a large
//! batch on a compute-bound device), the batch stops drafting for a while.
//! Before the costs are measured, the length grows by two after a fully
//! accepted draft and shrinks by one after a rejection.

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

/// What proposes a row's drafts: a drafter plugin, or the row's share of
/// the draft model ([`super::draft_model`]).
pub trait Drafter {
    /// Up to `k` tokens to follow `history` (prompt and accepted tokens;
    /// it only grows between calls).
    fn draft(&mut self, history: &[u32], k: usize) -> Result<Vec<u32>, String>;
    /// Names the drafter in logs.
    fn name(&self) -> &str;
    /// Time spent drafting.
    fn time(&self) -> Duration;
    /// The row's draft-model state, for a drafter the scheduler runs for
    /// all its rows at once ([`super::draft_model::draft_batch`]) instead
    /// of calling [`Drafter::draft`]; `None` for per-row drafters.
    fn draft_row(&mut self) -> Option<&mut super::draft_model::DraftRow> {
        None
    }
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
/// drafting while the batch's costs are not measured yet.
pub const MIN_ACCEPTANCE: f64 = 0.25;
/// Smoothing of a row's acceptance rate (weight of the newest step).
const ACCEPT_ALPHA: f64 = 0.3;
/// Decay of a row's accepted / rejected counts per verification (its
/// per-token acceptance estimate remembers the last few verifications).
const ACCEPT_DECAY: f64 = 0.7;
/// Steps a row first pauses for; each pause in a row doubles it up to
/// [`MAX_PAUSE`].
const FIRST_PAUSE: u32 = 8;
const MAX_PAUSE: u32 = 256;

/// What a step costs at the batch size of the step being planned
/// ([`SpecGate::cost`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCost {
    /// Seconds of a plain step per row: what one token costs without
    /// drafts.
    pub share: f64,
    /// Seconds a step takes more per draft token it verifies.
    pub per_draft: f64,
}

/// One row's speculation state.
pub struct RowSpec {
    drafter: Box<dyn Drafter>,
    /// The request's bound on the draft length.
    pub max_draft: usize,
    /// The draft length the row asks for next.
    pub k: usize,
    /// Smoothed acceptance rate (accepted / drafted).
    rate: f64,
    /// Decayed sums of accepted drafts and of rejections (a verification
    /// that stopped at a draft): the per-token acceptance probability is
    /// `accepted / (accepted + rejected)`.
    accepted_sum: f64,
    rejected_sum: f64,
    /// Steps left before the row drafts again.
    pause: u32,
    /// The next pause's length.
    next_pause: u32,
    /// After a pause: the next draft is one token, whatever the estimate.
    probing: bool,
    /// Whether the last draft length came from the cost model (else from
    /// the grow / shrink rule).
    modelled: bool,
    /// Tokens drafted and fed for verification.
    pub drafted: u64,
    /// Of those, accepted.
    pub accepted: u64,
    /// Smoothed seconds the drafter takes per draft token for this row
    /// (its share of the draft model's batched forwards; next to nothing
    /// for a plugin), added to the step's per-draft cost in
    /// [`RowSpec::best_k`].
    draft_per_token: f64,
    /// Drafts timed so far.
    draft_timed: u32,
}

impl RowSpec {
    /// Speculation with `drafter`, at most `max_draft` tokens per step.
    pub fn new(drafter: Box<dyn Drafter>, max_draft: usize) -> Self {
        RowSpec {
            drafter,
            max_draft,
            k: max_draft.clamp(1, 4),
            rate: 0.5,
            accepted_sum: 1.0,
            rejected_sum: 1.0,
            pause: 0,
            next_pause: FIRST_PAUSE,
            probing: false,
            modelled: false,
            drafted: 0,
            accepted: 0,
            draft_per_token: 0.0,
            draft_timed: 0,
        }
    }

    /// The row's per-token acceptance probability estimate.
    pub fn acceptance(&self) -> f64 {
        (self.accepted_sum / (self.accepted_sum + self.rejected_sum)).clamp(0.0, 0.99)
    }

    /// The draft length that emits the most tokens per second at `cost`,
    /// with each draft accepted with probability `a` until the first
    /// rejection: a step of `k` drafts emits `(1 - a^(k+1)) / (1 - a)`
    /// tokens (the accepted drafts and the token after them) for
    /// `share + k * (per_draft + drafting)` seconds of the batch's time
    /// (`drafting`: what the drafter takes per draft token for this row,
    /// [`RowSpec::record_draft_time`]), against one token per `share`
    /// without drafts. `None` when no length beats that.
    pub fn best_k(&self, cost: StepCost) -> Option<usize> {
        let a = self.acceptance();
        let plain = 1.0 / cost.share;
        let per_draft = cost.per_draft + self.draft_per_token;
        (1..=self.max_draft.max(1))
            .map(|k| {
                let tokens = (1.0 - a.powi(k as i32 + 1)) / (1.0 - a);
                (k, tokens / (cost.share + k as f64 * per_draft))
            })
            .filter(|&(_, v)| v > plain)
            .max_by(|x, y| x.1.total_cmp(&y.1))
            .map(|(k, _)| k)
    }

    /// Drafts for the row's next step: up to `min(k, room)` tokens, or
    /// none while paused. With the batch's `cost` measured, `k` is
    /// [`RowSpec::best_k`] and a row for which no length pays pauses;
    /// before that, `k` grows by two after a fully accepted draft and
    /// shrinks by one after a rejection, and a row whose acceptance rate
    /// falls below [`MIN_ACCEPTANCE`] pauses. A drafter failure is
    /// returned (the caller drops the drafter).
    pub fn propose(
        &mut self,
        history: &[u32],
        room: usize,
        cost: Option<StepCost>,
    ) -> Result<Vec<u32>, String> {
        let Some(k) = self.plan(room, cost) else {
            return Ok(Vec::new());
        };
        let started = std::time::Instant::now();
        let drafts = self.drafter.draft(history, k)?;
        self.record_draft_time(started.elapsed(), k);
        Ok(drafts)
    }

    /// The drafter took `took` of the batch's time to draft `k` tokens for
    /// this row: updates the per-token drafting cost [`RowSpec::best_k`]
    /// weighs (a draft model's forwards are a real part of what a draft
    /// costs).
    pub fn record_draft_time(&mut self, took: Duration, k: usize) {
        if k == 0 {
            return;
        }
        let per = took.as_secs_f64() / k as f64;
        self.draft_per_token = if self.draft_timed == 0 {
            per
        } else {
            (1.0 - GATE_ALPHA) * self.draft_per_token + GATE_ALPHA * per
        };
        self.draft_timed = self.draft_timed.saturating_add(1);
    }

    /// The draft length for the row's next step (see
    /// [`RowSpec::propose`], which drafts it): `None` while paused, when
    /// no length pays at `cost`, or without `room`.
    pub fn plan(&mut self, room: usize, cost: Option<StepCost>) -> Option<usize> {
        if self.pause > 0 {
            self.pause -= 1;
            return None;
        }
        self.modelled = false;
        if self.probing {
            self.probing = false;
            self.k = 1;
        } else if let Some(cost) = cost {
            match self.best_k(cost) {
                Some(k) => {
                    self.k = k;
                    self.modelled = true;
                }
                None => {
                    self.back_off();
                    return None;
                }
            }
        }
        let k = self.k.min(room);
        (k > 0).then_some(k)
    }

    /// The row's draft-model state when its drafter is the draft model
    /// (drafted in a batch by the scheduler).
    pub fn draft_row(&mut self) -> Option<&mut super::draft_model::DraftRow> {
        self.drafter.draft_row()
    }

    /// After a verification that fed `drafted` drafts of which `accepted`
    /// were taken: updates the acceptance estimates, adapts `k` and
    /// pauses a row whose drafts keep failing.
    pub fn record(&mut self, drafted: usize, accepted: usize) {
        if drafted == 0 {
            return;
        }
        self.drafted += drafted as u64;
        self.accepted += accepted as u64;
        self.accepted_sum = ACCEPT_DECAY * self.accepted_sum + accepted as f64;
        self.rejected_sum =
            ACCEPT_DECAY * self.rejected_sum + f64::from(u8::from(accepted < drafted));
        let rate = accepted as f64 / drafted as f64;
        self.rate = (1.0 - ACCEPT_ALPHA) * self.rate + ACCEPT_ALPHA * rate;
        self.k = if accepted == drafted {
            (self.k + 2).min(self.max_draft)
        } else {
            self.k.saturating_sub(1).max(1)
        };
        if !self.modelled && self.rate < MIN_ACCEPTANCE {
            self.back_off();
        } else if accepted > 0 {
            self.next_pause = FIRST_PAUSE;
        }
    }

    /// Pauses drafting (each pause in a row twice the last), then probes
    /// again with one token.
    fn back_off(&mut self) {
        self.pause = self.next_pause;
        self.next_pause = (self.next_pause * 2).min(MAX_PAUSE);
        self.rate = MIN_ACCEPTANCE;
        self.probing = true;
        self.k = 1;
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

/// Drafted steps at a batch size before the gate judges it.
const GATE_MIN_SAMPLES: u32 = 4;
/// Steps drafting first stays off at a batch size where even fully
/// accepted drafts would not pay; then verify steps are measured again,
/// and each time they still do not pay the next off period doubles, up to
/// [`GATE_MAX_OFF_STEPS`].
const GATE_OFF_STEPS: u32 = 128;
const GATE_MAX_OFF_STEPS: u32 = 4096;
/// A plain (draft-free) step is forced this often while rows draft, so
/// the plain step time stays measured.
const GATE_PROBE_EVERY: u64 = 64;
/// Smoothing of the gate's measurements (weight of the newest step).
const GATE_ALPHA: f64 = 0.2;

#[derive(Debug, Default, Clone)]
struct GateEntry {
    /// Seconds per decode-only step without drafts.
    plain: f64,
    plain_n: u32,
    /// Seconds a step takes more per draft token it verifies (the extra
    /// positions of the forward and the verification rounds).
    per_draft: f64,
    spec_n: u32,
    /// Steps left with drafting off.
    off: u32,
    /// The next off period (0: [`GATE_OFF_STEPS`]).
    next_off: u32,
}

impl GateEntry {
    /// The acceptance rate at which drafting breaks even at `rows` rows:
    /// a plain step emits `rows` tokens in `plain` seconds, so a token
    /// costs `plain / rows`; a draft costs `per_draft` and returns a token
    /// with the row's acceptance probability `p`. Drafting pays when
    /// `p * plain / rows > per_draft`. `None` until both are measured.
    fn break_even(&self, rows: usize) -> Option<f64> {
        (self.plain_n > 0 && self.spec_n >= GATE_MIN_SAMPLES && self.plain > 0.0)
            .then(|| self.per_draft * rows as f64 / self.plain)
    }
}

/// The batch-wide cost model: per number of rows in a decode-only step,
/// what a plain step takes and what each verified draft token adds
/// (measured on the running server). From them, each row's draft length
/// ([`RowSpec::best_k`]: rows for which no length pays stop drafting, with
/// their back-off), and where even a fully
/// accepted draft would not pay (a big batch on a GPU is compute-bound:
/// the extra positions cost what a step saves), no row drafts for a while.
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
                // Measure the verify cost again.
                e.spec_n = 0;
            }
            return false;
        }
        // Keep the plain step time measured (the first step at a batch
        // size is plain).
        !(self.steps.is_multiple_of(GATE_PROBE_EVERY) || e.plain_n == 0)
    }

    /// What a step of `rows` rows costs per plain token and per draft;
    /// `None` until measured.
    pub fn cost(&self, rows: usize) -> Option<StepCost> {
        let e = self.by_rows.get(&rows)?;
        e.break_even(rows)?;
        Some(StepCost {
            share: e.plain / rows as f64,
            per_draft: e.per_draft,
        })
    }

    /// A decode-only step of `rows` rows took `took` and verified
    /// `drafted` draft tokens (0: a plain step).
    pub fn record(&mut self, rows: usize, drafted: usize, took: Duration) {
        let secs = took.as_secs_f64();
        if rows == 0 || secs <= 0.0 {
            return;
        }
        let smooth = |old: f64, n: u32, new: f64| {
            if n == 0 {
                new
            } else {
                (1.0 - GATE_ALPHA) * old + GATE_ALPHA * new
            }
        };
        let e = self.by_rows.entry(rows).or_default();
        if drafted == 0 {
            e.plain = smooth(e.plain, e.plain_n, secs);
            e.plain_n = e.plain_n.saturating_add(1);
            return;
        }
        if e.plain_n == 0 {
            // The extra cost is only known against a plain step.
            return;
        }
        let extra = (secs - e.plain).max(0.0) / drafted as f64;
        e.per_draft = smooth(e.per_draft, e.spec_n, extra);
        e.spec_n = e.spec_n.saturating_add(1);
        match e.break_even(rows) {
            Some(b) if b >= 1.0 => {
                e.off = e.next_off.max(GATE_OFF_STEPS);
                e.next_off = (e.off * 2).min(GATE_MAX_OFF_STEPS);
                tracing::debug!(
                    rows,
                    plain_step_s = e.plain,
                    per_draft_s = e.per_draft,
                    off_steps = e.off,
                    "drafts cannot pay at this batch size; drafting off for a while"
                );
            }
            Some(_) => e.next_off = GATE_OFF_STEPS,
            None => {}
        }
    }

    /// The gate's measurements per batch size (`/stats`).
    pub fn table(&self) -> Vec<GateRow> {
        self.by_rows
            .iter()
            .map(|(&rows, e)| GateRow {
                rows,
                plain_step_ms: 1e3 * e.plain,
                per_draft_ms: 1e3 * e.per_draft,
                break_even_acceptance: e.break_even(rows),
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
    /// Smoothed milliseconds per decode-only step without drafts.
    pub plain_step_ms: f64,
    /// Smoothed milliseconds a step takes more per draft token verified.
    pub per_draft_ms: f64,
    /// The acceptance rate a row needs for drafting to pay at this batch
    /// size (`per_draft * rows / plain_step`); `null` until measured.
    pub break_even_acceptance: Option<f64>,
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
    /// Milliseconds in the draft model's forwards (`--draft-model`), all
    /// steps.
    pub draft_model_ms: f64,
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
            assert!(r.propose(&[1], 8, None).unwrap_or_default().is_empty());
        }
        assert_eq!(
            r.propose(&[1], 8, None).unwrap_or_default(),
            vec![1],
            "probes with one"
        );
        assert!(
            r.propose(&[1], 0, None).unwrap_or_default().is_empty(),
            "no room, no drafts"
        );
    }

    #[test]
    fn with_measured_costs_the_draft_length_follows_acceptance_and_cost() {
        let mut r = RowSpec::new(Box::new(Fixed(vec![1; 16])), 8);
        // Drafts a third of a plain token's cost each (a CPU at batch 1).
        let cpu = StepCost {
            share: 0.030,
            per_draft: 0.010,
        };
        let cheap = StepCost {
            share: 0.030,
            per_draft: 0.0005,
        };
        for _ in 0..10 {
            r.record(4, 4);
        }
        assert!(r.acceptance() > 0.95);
        let long = r.best_k(cpu).unwrap_or(0);
        assert!((5..=8).contains(&long), "{long}");
        assert_eq!(r.best_k(cheap), Some(8), "cheap drafts: the bound");
        for _ in 0..10 {
            r.record(4, 1);
        }
        assert!(r.acceptance() < 0.6);
        assert!(r.best_k(cpu).unwrap_or(0) <= 2);
        // At 20% acceptance no length pays at a third of a token per draft:
        // the row pauses, then probes with one token.
        for _ in 0..10 {
            r.record(5, 0);
        }
        assert_eq!(r.best_k(cpu), None);
        assert!(r.propose(&[1], 8, Some(cpu)).unwrap_or_default().is_empty());
        let paused = r.pause;
        assert!(paused > 0);
        for _ in 0..paused {
            assert!(r.propose(&[1], 8, Some(cpu)).unwrap_or_default().is_empty());
        }
        assert_eq!(r.propose(&[1], 8, Some(cpu)).unwrap_or_default(), vec![1]);
    }

    #[test]
    fn the_drafters_own_time_counts_in_the_draft_length() {
        let mut r = RowSpec::new(Box::new(Fixed(vec![1; 16])), 8);
        for _ in 0..10 {
            r.record(4, 4);
        }
        let cpu = StepCost {
            share: 0.030,
            per_draft: 0.010,
        };
        let free = r.best_k(cpu).unwrap_or(0);
        // A draft model as costly per token as a plain step: drafting
        // cannot pay even at 99% acceptance.
        r.record_draft_time(Duration::from_millis(120), 4);
        assert!(
            free >= 5 && r.best_k(cpu).is_none(),
            "{free} {:?}",
            r.best_k(cpu)
        );
        // A cheap one: long drafts again.
        for _ in 0..40 {
            r.record_draft_time(Duration::from_millis(4), 4);
        }
        assert!(r.best_k(cpu).unwrap_or(0) >= 4);
    }

    #[test]
    fn the_gate_measures_what_a_draft_costs_and_turns_drafting_off_where_none_can_pay() {
        let mut g = SpecGate::default();
        let ms = Duration::from_millis;
        assert!(!g.allows(1), "the first step at a batch size is plain");
        g.record(1, 0, ms(40));
        assert_eq!(g.cost(1), None, "not measured yet");
        for _ in 0..GATE_MIN_SAMPLES {
            assert!(g.allows(1));
            // 4 drafts add 8 ms: 2 ms each against 40 ms per token.
            g.record(1, 4, ms(48));
        }
        let c = g.cost(1).expect("measured");
        assert!(
            (c.share - 0.040).abs() < 1e-9 && (c.per_draft - 0.002).abs() < 1e-9,
            "{c:?}"
        );
        // At 8 rows a plain step emits 8 tokens in 50 ms (6.25 ms each); a
        // draft that adds 10 ms can never pay.
        assert!(!g.allows(8));
        g.record(8, 0, ms(50));
        for _ in 0..GATE_MIN_SAMPLES {
            assert!(g.allows(8));
            g.record(8, 8, ms(130));
        }
        assert!(!g.allows(8), "off at 8 rows");
        let table = g.table();
        assert!(table.iter().any(|r| r.rows == 1 && r.drafting));
        assert!(table.iter().any(|r| r.rows == 8 && !r.drafting));
        for _ in 1..GATE_OFF_STEPS {
            assert!(!g.allows(8));
        }
        assert!(g.allows(8), "measured again after a while");
    }
}
