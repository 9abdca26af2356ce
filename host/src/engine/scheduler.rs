//! The continuous-batching scheduler: a queue of waiting requests and the
//! running batch of [`Sequence`]s, advanced one [`step`](Scheduler::step) at
//! a time.
//!
//! Each step:
//! 1. retires rows whose caller cancelled;
//! 2. under a memory budget, grows the running rows' KV reservations to
//!    what they will hold after this step, and preempts the youngest rows
//!    while the total is over the budget (`engine::admission`);
//! 3. resumes preempted rows (oldest first), then admits waiting requests
//!    (FIFO) while the batch has room (`max_batch`, `--batch`): validates
//!    the request, instantiates its plugin chain, and consults the prompt
//!    cache (both tiers) for the longest cached prefix;
//! 4. plans the forward: every decoding row feeds its one sampled token
//!    (and, when it speculates, the drafts its drafter proposed for this
//!    step: `engine::speculative`);
//!    prefilling rows feed prompt chunks from a per-step budget
//!    (`prefill_budget` tokens while other rows decode, so a long prompt
//!    does not freeze the streams already running; up to `prefill_chunk`
//!    per row when nothing decodes);
//! 5. runs the step (`step::run`: one forward, each row's chain, one
//!    evaluation);
//! 6. hands every chosen token to its row (for a row verifying drafts,
//!    position by position while the chosen tokens equal the drafts:
//!    `step::verify_round`) and retires rows that finished, stopped or
//!    failed; finished rows' KV goes to the prompt cache.
//!
//! The shape follows vLLM v1's scheduler (`v1/core/sched/interface.py`:
//! `schedule`, `update_from_output`, `finish_requests`) and mistral.rs's
//! `default_scheduler.rs` (waiting and running queues).

use std::collections::{BTreeMap, VecDeque};
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::admission::{self, MemoryBudget, RowShape};
use super::draft_model;
use super::request::{
    effective_params, lora_namespace, validate, FinishReason, GenerateError, GenerateEvent,
    GenerateRequest,
};
use super::sequence::{Phase, Sequence, SequenceSink};
use super::speculative::{RowSpec, SpecGate, SpecStats};
use super::step::{self, RowOutcome, StepTiming};
use crate::cache::prompt::{Reuse, ReuseSource};
use crate::cache::PrefixCache;
use crate::model::lora::LoraAdapter;
use crate::model::LoadedModel;
use crate::plugin::constraint::{ConstraintRequest, ConstraintSession, OpenError};
use crate::plugin::session::{RowChain, TokenChain};
use crate::plugin::{PluginError, PluginHost};
use crate::score::PREFILL_CHUNK;

/// How the scheduler fills a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most rows in the running batch (`--batch`, alias
    /// `--decode-concurrency`); 1 runs requests one after another.
    pub max_batch: usize,
    /// Prompt tokens prefilled per step while other rows decode
    /// (`--prefill-budget`).
    pub prefill_budget: usize,
    /// Most prompt tokens of one row in one forward (bounds attention
    /// memory, `[H, chunk, T]` scores per layer).
    pub prefill_chunk: usize,
    /// Bytes the running rows' KV caches and prefill activations may take
    /// together (`--memory-budget`; see [`super::admission`]), resolved
    /// when the scheduler is created.
    pub memory_budget: MemoryBudget,
    /// Start the next decode step before reading this one's tokens where
    /// every row allows it (`--decode-lookahead`; see `engine::step`).
    /// [`Lookahead::Auto`] is decided once the model is loaded
    /// ([`Lookahead::resolve`], by the engine worker); unresolved it is off.
    pub decode_lookahead: Lookahead,
    /// While rows share a step, the most each plugin call may take and the
    /// plugin time after which the step defers the remaining rows' chains
    /// to the next step (`--plugin-step-ms`; see `engine::step::run`).
    pub plugin_step: Duration,
}

/// The default `plugin_step`: far above a chain's usual cost (well under
/// a millisecond for the first-party plugins, a few for interpreted guests)
/// and a small stall for the rows that wait on a slow one.
pub const DEFAULT_PLUGIN_STEP: Duration = Duration::from_millis(50);

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            max_batch: DEFAULT_BATCH,
            prefill_budget: DEFAULT_PREFILL_BUDGET,
            prefill_chunk: PREFILL_CHUNK,
            memory_budget: MemoryBudget::Off,
            decode_lookahead: default_decode_lookahead(),
            plugin_step: DEFAULT_PLUGIN_STEP,
        }
    }
}

/// Whether decode steps start before the previous step's tokens are read
/// (`serve --decode-lookahead auto|on|off`, env `MLXHOST_DECODE_LOOKAHEAD`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookahead {
    /// Never.
    Off,
    /// Wherever every row's plugins allow it.
    On,
    /// On with a GPU backend for a model of at least
    /// [`LOOKAHEAD_MIN_WEIGHT_BYTES`], off otherwise (see [`Lookahead::resolve`]).
    Auto,
}

/// The weights from which [`Lookahead::Auto`] turns lookahead on with a GPU
/// backend, bytes (1 GiB). Measured on an H100 (docs/benchmarks.md, "Third
/// run"): a Qwen3-8B-shaped 4-bit model's batch-1 step fell from 6.67 to
/// 3.80 ms with it and a Qwen2.5-32B shape's from 16.10 to 11.94 ms, while
/// on an H200 SmolLM2-135M's (~0.1 GB) rose from 4.33 to 4.92 ms: a small
/// model's step is bound by launching its kernels, with no device time left
/// to hide the next step's building behind. No size between was measured;
/// 1 GiB sits between the two.
pub const LOOKAHEAD_MIN_WEIGHT_BYTES: u64 = 1 << 30;

impl Lookahead {
    /// Reads `auto`, `on`/`1`/`true`/`yes` or `off`/`0`/`false`/`no` (any
    /// case); `None` for anything else.
    pub fn parse(text: &str) -> Option<Lookahead> {
        match text.trim().to_ascii_lowercase().as_str() {
            "auto" => Some(Lookahead::Auto),
            "on" | "1" | "true" | "yes" => Some(Lookahead::On),
            "off" | "0" | "false" | "no" => Some(Lookahead::Off),
            _ => None,
        }
    }

    /// `Auto` decided for a model of `weights_bytes` on this backend
    /// (`gpu`: MLX runs on Metal or CUDA); `On` and `Off` stay.
    pub fn resolve(self, gpu: bool, weights_bytes: u64) -> Lookahead {
        match self {
            Lookahead::Auto if gpu && weights_bytes >= LOOKAHEAD_MIN_WEIGHT_BYTES => Lookahead::On,
            Lookahead::Auto => Lookahead::Off,
            other => other,
        }
    }

    /// Whether steps look ahead (an unresolved `Auto` does not).
    pub fn is_on(self) -> bool {
        self == Lookahead::On
    }
}

impl From<bool> for Lookahead {
    fn from(on: bool) -> Self {
        if on {
            Lookahead::On
        } else {
            Lookahead::Off
        }
    }
}

/// Decode lookahead where no flag says (`mlxhost generate`, `bench`):
/// what `MLXHOST_DECODE_LOOKAHEAD` says (as `serve --decode-lookahead`
/// reads it), off where it is unset or unreadable.
pub fn default_decode_lookahead() -> Lookahead {
    std::env::var("MLXHOST_DECODE_LOOKAHEAD")
        .ok()
        .and_then(|v| Lookahead::parse(&v))
        .unwrap_or(Lookahead::Off)
}

/// Default `--batch` (chosen by measurement: `docs/benchmarks.md`).
pub const DEFAULT_BATCH: usize = 16;
/// Default `--prefill-budget`, tokens per step.
pub const DEFAULT_PREFILL_BUDGET: usize = 256;
/// `--prefill-budget` and the prefill chunk on a GPU backend: mlx-lm's
/// prefill step. Measured on an H200 (docs/benchmarks.md): a ~3.7k-token
/// prompt took 0.56-0.66 s to its first token in 512-token chunks, 2.7x
/// mlx_lm.server's 0.24 s.
pub const GPU_PREFILL_BUDGET: usize = 2048;

/// Who chooses a request's tokens.
pub enum ChainSource<'s> {
    /// The request's plugins (sampler and processors named in the request),
    /// instantiated from this snapshot when the request is admitted.
    Plugins(Arc<PluginHost>),
    /// A chain built by the caller (benchmarks' native chain).
    Ready(Box<dyn TokenChain + 's>),
    /// A chain and a drafter built by the caller (`mlxhost generate`
    /// with `--drafter`).
    ReadyDrafting(Box<dyn TokenChain + 's>, RowSpec),
    /// The request's plugins, under a grammar: a session of the constraint
    /// plugin masks each step's logits first ([`super::grammar`]).
    Constrained(Arc<PluginHost>, ConstraintRequest),
}

/// A request waiting for a batch slot.
pub struct Pending<'s> {
    /// The canonical request.
    pub request: GenerateRequest,
    /// Its chain.
    pub chain: ChainSource<'s>,
    /// Where its events go.
    pub sink: Box<dyn SequenceSink + 's>,
}

/// Per batch size: how many steps ran with that many rows and where their
/// time went (the plugin share of a step at each batch size).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct BatchSizeStats {
    /// Rows in the step's forward.
    pub rows: usize,
    /// Steps with that many rows.
    pub steps: u64,
    /// Mean wall time of such a step, ms.
    pub step_ms: f64,
    /// Mean time inside plugin chains per step, ms.
    pub plugin_ms: f64,
    /// `plugin_ms / step_ms`.
    pub plugin_share: f64,
    /// Mean time building the forward's graph and handing it to MLX's
    /// evaluation per step, ms (host work; on a GPU the hand-off launches
    /// the kernels).
    pub forward_graph_ms: f64,
    /// Of `forward_graph_ms`, building the graph before handing it to
    /// MLX's evaluation (the rest is the hand-off: launching kernels).
    pub forward_build_ms: f64,
    /// Mean time in the step's evaluation and read-back per step, ms (on a
    /// GPU: kernel launches and waiting for the device).
    pub eval_ms: f64,
    /// Steps that also started the next step before reading their tokens
    /// (`--decode-lookahead`).
    pub lookahead_steps: u64,
}

/// The scheduler's counters (`GET /stats` under `"batch"`).
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct SchedulerStats {
    /// `--batch`.
    pub max_batch: usize,
    /// Rows in the running batch now.
    pub running: usize,
    /// Requests waiting for a slot.
    pub waiting: usize,
    /// Steps run.
    pub steps: u64,
    /// Prompt tokens prefilled by the last step.
    pub prefill_tokens_last_step: usize,
    /// Prompt tokens prefilled, all steps.
    pub prefill_tokens: u64,
    /// Tokens chosen, all steps.
    pub decode_tokens: u64,
    /// Mean over steps of rows in the forward / `max_batch`.
    pub batch_occupancy: f64,
    /// Rows paused to free memory (`--memory-budget`), all steps.
    pub preemptions: u64,
    /// Rows paused now, waiting to resume.
    pub preempted: usize,
    /// `--memory-budget` in effect, bytes (`null`: no admission check).
    pub memory_budget_bytes: Option<u64>,
    /// Bytes the running rows reserve now (KV and prefill activations).
    pub reserved_bytes: u64,
    /// KV bytes per position of a row, all layers (0 before the first
    /// admission under a budget).
    pub kv_bytes_per_token: u64,
    /// Prompt tokens whose KV was taken from a running row's (a shared
    /// prefix prefilled once), all admissions.
    pub tokens_from_running_rows: u64,
    /// The last 32 admissions' prompt reuse, oldest first.
    pub recent: Vec<RecentRequest>,
    /// Step timing per number of rows in the step, ascending.
    pub by_batch_size: Vec<BatchSizeStats>,
    /// Speculative decoding: drafted, accepted, acceptance rate.
    pub speculative: SpecStats,
}

#[derive(Default)]
struct SizeAcc {
    steps: u64,
    time: Duration,
    plugins: Duration,
    forward: Duration,
    forward_build: Duration,
    eval: Duration,
    lookahead_steps: u64,
}

/// What one [`Scheduler::step`] did.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepReport {
    /// Rows in the forward.
    pub rows: usize,
    /// Prompt tokens fed.
    pub prefill_tokens: usize,
    /// Rows retired (finished, cancelled or failed).
    pub retired: usize,
    /// Where the time went.
    pub timing: StepTiming,
}

/// Waiting requests and the running batch.
pub struct Scheduler<'s> {
    config: SchedulerConfig,
    /// `config.memory_budget` in bytes, resolved at creation.
    budget: Option<u64>,
    /// The model's shape for admission estimates (set on first use).
    shape: Option<RowShape>,
    /// The draft model's (`--draft-model`), likewise.
    draft_shape: Option<RowShape>,
    waiting: VecDeque<Pending<'s>>,
    running: Vec<Sequence<'s>>,
    /// Rows paused to free memory, oldest (lowest id) first; they resume
    /// before any waiting request is admitted.
    preempted: VecDeque<Sequence<'s>>,
    preemptions: u64,
    /// The last admissions' prompt reuse, oldest first.
    recent: VecDeque<RecentRequest>,
    /// Prompt tokens seeded from running rows' KV, all admissions.
    tokens_from_running_rows: u64,
    next_id: u64,
    steps: u64,
    occupancy_sum: f64,
    prefill_tokens: u64,
    decode_tokens: u64,
    last_prefill: usize,
    by_size: BTreeMap<usize, SizeAcc>,
    /// Whether speculation pays at each batch size.
    gate: SpecGate,
    spec: SpecStats,
}

impl<'s> Scheduler<'s> {
    /// An empty scheduler. `max_batch`, `prefill_budget` and
    /// `prefill_chunk` are raised to at least 1.
    pub fn new(config: SchedulerConfig) -> Self {
        Scheduler {
            config: SchedulerConfig {
                max_batch: config.max_batch.max(1),
                prefill_budget: config.prefill_budget.max(1),
                prefill_chunk: config.prefill_chunk.max(1),
                memory_budget: config.memory_budget,
                decode_lookahead: config.decode_lookahead,
                plugin_step: config.plugin_step,
            },
            budget: config.memory_budget.resolve(),
            shape: None,
            draft_shape: None,
            waiting: VecDeque::new(),
            running: Vec::new(),
            preempted: VecDeque::new(),
            preemptions: 0,
            recent: VecDeque::new(),
            tokens_from_running_rows: 0,
            next_id: 0,
            steps: 0,
            occupancy_sum: 0.0,
            prefill_tokens: 0,
            decode_tokens: 0,
            last_prefill: 0,
            by_size: BTreeMap::new(),
            gate: SpecGate::default(),
            spec: SpecStats::default(),
        }
    }

    /// Queues a request; it is admitted at a later step.
    pub fn submit(&mut self, pending: Pending<'s>) {
        self.waiting.push_back(pending);
    }

    /// Nothing waiting and nothing running.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.preempted.is_empty()
    }

    /// Rows running now.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting for a slot (preempted rows included).
    pub fn waiting(&self) -> usize {
        self.waiting.len() + self.preempted.len()
    }

    /// The memory budget in effect, bytes (`None`: no admission check).
    pub fn memory_budget(&self) -> Option<u64> {
        self.budget
    }

    /// The configuration in effect.
    pub fn config(&self) -> SchedulerConfig {
        self.config
    }

    /// Admits, runs one step and retires (see the module doc). A no-op when
    /// idle. Rows fail one by one (their sink gets the error); an error that
    /// breaks the whole step fails every running row.
    pub fn step(
        &mut self,
        model: &LoadedModel,
        mut caches: Option<&mut PrefixCache>,
    ) -> StepReport {
        let mut report = StepReport::default();
        report.retired += self.retire_cancelled(model, caches.as_deref_mut());
        report.retired += self.grow_reservations(model, caches.as_deref_mut());
        self.admit(model, caches.as_deref_mut());
        if self.running.is_empty() {
            return report;
        }
        let take = self.plan();
        let drafted = self.propose_drafts(&take, model);
        self.spec.verify_steps += u64::from(drafted > 0);
        // Rows fed this step, and rows reading a token a lookahead chose.
        report.rows = self
            .running
            .iter()
            .zip(&take)
            .filter(|(s, &n)| n > 0 || s.lookahead.is_some() || s.deferred.is_some())
            .count();
        report.prefill_tokens = self
            .running
            .iter()
            .zip(&take)
            .filter(|(s, _)| s.phase() == Phase::Prefill)
            .map(|(_, &n)| n)
            .sum();
        let started = Instant::now();
        let lookahead = self.config.decode_lookahead.is_on();
        let outcomes = match step::run(
            model,
            &mut self.running,
            &take,
            lookahead,
            self.config.plugin_step,
        ) {
            Ok((outcomes, timing)) => {
                report.timing = timing;
                outcomes
            }
            Err(e) => {
                let message = e.to_string();
                tracing::error!(error = %message, rows = self.running.len(), "the batch step failed; its rows fail");
                self.running
                    .iter()
                    .map(|_| RowOutcome::Failed(GenerateError::Internal(message.clone())))
                    .collect()
            }
        };
        let mut retire: Vec<(usize, Result<FinishReason, GenerateError>)> = Vec::new();
        let mut chosen = 0u64;
        let mut outcomes: Vec<(usize, RowOutcome)> = outcomes.into_iter().enumerate().collect();
        // Verifying rows choose position after position while their chosen
        // tokens equal their drafts (one round per position, all such rows
        // evaluated together).
        loop {
            let mut verifying: Vec<usize> = Vec::new();
            for (i, outcome) in outcomes.drain(..) {
                match outcome {
                    // A deferred row's verification resumes next step.
                    RowOutcome::Idle | RowOutcome::Fed | RowOutcome::Deferred => continue,
                    RowOutcome::Failed(e) => retire.push((i, Err(e))),
                    RowOutcome::Token(info, sampled) => {
                        chosen += 1;
                        match self.running[i].take_token(info, sampled, model) {
                            Ok(Some(finish)) => retire.push((i, Ok(finish))),
                            Ok(None) => {
                                if self.running[i]
                                    .verify
                                    .as_ref()
                                    .is_some_and(|v| v.continues())
                                {
                                    verifying.push(i);
                                }
                            }
                            Err(e) => retire.push((i, Err(e))),
                        }
                    }
                }
                if !verifying.contains(&i) {
                    self.end_verify(i);
                }
            }
            if verifying.is_empty() {
                break;
            }
            outcomes = match step::verify_round(
                model,
                &mut self.running,
                &verifying,
                self.config.plugin_step,
            ) {
                Ok(o) => o,
                Err(e) => {
                    let message = e.to_string();
                    tracing::error!(error = %message, rows = verifying.len(), "a verification round failed; its rows fail");
                    verifying
                        .iter()
                        .map(|&i| {
                            (
                                i,
                                RowOutcome::Failed(GenerateError::Internal(message.clone())),
                            )
                        })
                        .collect()
                }
            };
        }
        retire.sort_by_key(|(i, _)| *i);
        let elapsed = started.elapsed();
        self.record(&report, chosen, elapsed);
        // The gate measures the target's side (the drafters' time is each
        // row's own: `RowSpec::record_draft_time`).
        if report.prefill_tokens == 0 && report.rows > 0 {
            self.gate.record(report.rows, drafted, elapsed);
        }
        report.retired += retire.len();
        // Highest index first, so the indices left stay valid.
        for (i, result) in retire.into_iter().rev() {
            let seq = self.running.remove(i);
            finish(seq, result, model, caches.as_deref_mut());
        }
        report
    }

    /// Fails every waiting and running request with `message` (the engine
    /// is stopping, or it caught a panic and its rows' state is unknown).
    pub fn fail_all(&mut self, message: &str) {
        for mut p in self.waiting.drain(..) {
            p.sink
                .finished(Err(GenerateError::Internal(message.to_string())));
        }
        for mut s in self.running.drain(..).chain(self.preempted.drain(..)) {
            s.sink
                .finished(Err(GenerateError::Internal(message.to_string())));
        }
    }

    /// Zeroes the step counters (after the warm-up, so `/stats` counts
    /// only served requests).
    pub fn reset_stats(&mut self) {
        self.steps = 0;
        self.occupancy_sum = 0.0;
        self.prefill_tokens = 0;
        self.decode_tokens = 0;
        self.last_prefill = 0;
        self.preemptions = 0;
        self.recent.clear();
        self.tokens_from_running_rows = 0;
        self.by_size.clear();
        self.spec = SpecStats::default();
        self.gate = SpecGate::default();
    }

    /// Asks the drafter of every row that may speculate this step for its
    /// drafts (none while the batch gate says drafting does not pay at
    /// this batch size; each row's draft length from its acceptance and
    /// the gate's measured costs, [`RowSpec::best_k`]). Rows drafting with
    /// the draft model draft together, in one batch of draft forwards
    /// ([`draft_model::draft_batch`]). A drafter that fails is dropped: its
    /// row decodes on without drafts (a failed draft-model batch drops the
    /// draft model for every row in it).
    fn propose_drafts(&mut self, take: &[usize], model: &LoadedModel) -> usize {
        for s in &mut self.running {
            s.drafts.clear();
        }
        let mut proposed = 0;
        let candidates: Vec<usize> = (0..self.running.len())
            .filter(|&i| take[i] > 0 && self.running[i].can_draft())
            .collect();
        if candidates.is_empty() {
            return 0;
        }
        // The gate judges decode-only steps by their row count.
        let prefilling = self.running.iter().any(|s| s.phase() == Phase::Prefill);
        let rows = take.iter().filter(|&&n| n > 0).count();
        if !prefilling && !self.gate.allows(rows) {
            return 0;
        }
        let cost = self.gate.cost(rows);
        // Rows of the draft model and their draft lengths.
        let mut batched: Vec<(usize, usize)> = Vec::new();
        for i in candidates {
            let seq = &mut self.running[i];
            let room = seq.draft_room();
            let Some(spec) = seq.spec.as_mut() else {
                continue;
            };
            if spec.draft_row().is_some() {
                if let Some(k) = spec.plan(room, cost) {
                    batched.push((i, k));
                }
                continue;
            }
            match spec.propose(&seq.ids, room, cost) {
                Ok(drafts) => {
                    proposed += drafts.len();
                    seq.drafts = drafts;
                }
                Err(e) => {
                    tracing::warn!(row = seq.id, drafter = spec.drafter_name(), error = %e, "the drafter failed; the row decodes without drafts");
                    self.spec.drafter_failures += 1;
                    seq.spec = None;
                }
            }
        }
        if let (false, Some(draft)) = (batched.is_empty(), model.draft.as_deref()) {
            proposed += self.draft_with_model(draft, model, &batched);
        }
        proposed
    }

    /// Drafts rows `batched` (index, draft length) with the draft model,
    /// all together; on failure every one of them drops the draft model.
    /// Returns the number of drafts.
    fn draft_with_model(
        &mut self,
        draft: &LoadedModel,
        model: &LoadedModel,
        batched: &[(usize, usize)],
    ) -> usize {
        let mut proposed = 0;
        let vocab = model.model.config().vocab_size;
        let mut asks: Vec<draft_model::DraftAsk<'_>> = Vec::with_capacity(batched.len());
        let mut members: Vec<usize> = Vec::with_capacity(batched.len());
        let mut by_index: Vec<Option<&mut Sequence<'s>>> =
            self.running.iter_mut().map(Some).collect();
        for &(i, k) in batched {
            let Some(seq) = by_index.get_mut(i).and_then(Option::take) else {
                continue;
            };
            let Some(row) = seq.spec.as_mut().and_then(RowSpec::draft_row) else {
                continue;
            };
            asks.push(draft_model::DraftAsk {
                history: &seq.ids,
                row,
                k,
            });
            members.push(i);
        }
        let result = draft_model::draft_batch(draft, vocab, &mut asks);
        drop(asks);
        drop(by_index);
        match result {
            Ok(batch) => {
                self.spec.draft_model_ms += 1e3 * batch.took.as_secs_f64();
                // Each row's share of the forwards is its drafting cost,
                // except where it caught up with more than a step's tokens
                // (its first draft prefills the prompt): that is not what
                // steady drafting costs.
                let share = batch.took / members.len().max(1) as u32;
                for ((i, drafts), long) in members.into_iter().zip(batch.drafts).zip(batch.long) {
                    proposed += drafts.len();
                    let seq = &mut self.running[i];
                    if let (false, Some(spec)) = (long, seq.spec.as_mut()) {
                        let k = batched.iter().find(|b| b.0 == i).map_or(0, |b| b.1);
                        spec.record_draft_time(share, k);
                    }
                    seq.drafts = drafts;
                }
            }
            Err(e) => {
                tracing::warn!(rows = members.len(), error = %e, "the draft model failed; its rows decode without drafts");
                for i in members {
                    self.spec.drafter_failures += 1;
                    self.running[i].spec = None;
                }
            }
        }
        proposed
    }

    /// Ends row `i`'s verification if one is in progress (trims rejected
    /// drafts from its KV) and counts it.
    fn end_verify(&mut self, i: usize) {
        if let Some((drafted, accepted)) = self.running[i].end_verify() {
            self.spec.drafted += drafted as u64;
            self.spec.accepted += accepted as u64;
        }
    }

    /// The counters now.
    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            max_batch: self.config.max_batch,
            running: self.running.len(),
            waiting: self.waiting.len() + self.preempted.len(),
            preemptions: self.preemptions,
            preempted: self.preempted.len(),
            memory_budget_bytes: self.budget,
            reserved_bytes: self.running.iter().map(|s| s.reserved_bytes).sum(),
            kv_bytes_per_token: self.shape.as_ref().map_or(0, |s| s.kv_bytes(1)),
            tokens_from_running_rows: self.tokens_from_running_rows,
            recent: self.recent.iter().cloned().collect(),
            steps: self.steps,
            prefill_tokens_last_step: self.last_prefill,
            prefill_tokens: self.prefill_tokens,
            decode_tokens: self.decode_tokens,
            batch_occupancy: if self.steps > 0 {
                self.occupancy_sum / self.steps as f64
            } else {
                0.0
            },
            by_batch_size: self
                .by_size
                .iter()
                .map(|(&rows, acc)| {
                    let n = acc.steps.max(1) as f64;
                    let step_ms = acc.time.as_secs_f64() * 1e3 / n;
                    let plugin_ms = acc.plugins.as_secs_f64() * 1e3 / n;
                    BatchSizeStats {
                        forward_graph_ms: acc.forward.as_secs_f64() * 1e3 / n,
                        forward_build_ms: acc.forward_build.as_secs_f64() * 1e3 / n,
                        eval_ms: acc.eval.as_secs_f64() * 1e3 / n,
                        lookahead_steps: acc.lookahead_steps,
                        rows,
                        steps: acc.steps,
                        step_ms,
                        plugin_ms,
                        plugin_share: if step_ms > 0.0 {
                            plugin_ms / step_ms
                        } else {
                            0.0
                        },
                    }
                })
                .collect(),
            speculative: SpecStats {
                acceptance_rate: if self.spec.drafted > 0 {
                    self.spec.accepted as f64 / self.spec.drafted as f64
                } else {
                    0.0
                },
                gate_off_steps: self.gate.off_steps,
                by_batch_size: self.gate.table(),
                ..self.spec.clone()
            },
        }
    }

    fn record(&mut self, report: &StepReport, chosen: u64, elapsed: Duration) {
        if report.rows == 0 {
            return;
        }
        self.steps += 1;
        self.occupancy_sum += report.rows as f64 / self.config.max_batch as f64;
        self.prefill_tokens += report.prefill_tokens as u64;
        self.decode_tokens += chosen;
        self.last_prefill = report.prefill_tokens;
        let acc = self.by_size.entry(report.rows).or_default();
        acc.steps += 1;
        acc.time += elapsed;
        acc.plugins += report.timing.plugins;
        acc.forward += report.timing.forward;
        acc.forward_build += report.timing.forward_build;
        acc.eval += report.timing.eval;
        acc.lookahead_steps += u64::from(report.timing.lookahead);
    }

    /// Retires waiting and running requests whose caller cancelled.
    fn retire_cancelled(
        &mut self,
        model: &LoadedModel,
        mut caches: Option<&mut PrefixCache>,
    ) -> usize {
        let mut n = 0;
        let mut i = 0;
        while i < self.waiting.len() {
            if self.waiting[i].sink.cancelled() {
                if let Some(mut p) = self.waiting.remove(i) {
                    p.sink.finished(Ok(super::request::GenerateSummary {
                        finish_reason: FinishReason::Cancelled,
                        prompt_tokens: p.request.prompt_ids.len(),
                        cached_tokens: 0,
                        completion_tokens: 0,
                        stop_sequence: None,
                        prefill: Duration::ZERO,
                        decode: Duration::ZERO,
                        plugin_time: Duration::ZERO,
                    }));
                }
                n += 1;
            } else {
                i += 1;
            }
        }
        // Paused and running rows alike (each list keeps its order).
        let (gone_paused, paused): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut self.preempted)
            .into_iter()
            .partition(|s| s.sink.cancelled());
        let (gone_running, running): (Vec<_>, Vec<_>) = std::mem::take(&mut self.running)
            .into_iter()
            .partition(|s| s.sink.cancelled());
        self.preempted = paused;
        self.running = running;
        for seq in gone_paused.into_iter().chain(gone_running) {
            finish(
                seq,
                Ok(FinishReason::Cancelled),
                model,
                caches.as_deref_mut(),
            );
            n += 1;
        }
        n
    }

    /// Under a memory budget: sets every running row's reservation to
    /// cover what it holds after this step (grown in whole
    /// [`admission::KV_GROWTH_TOKENS`]), then, while the total is over the
    /// budget, preempts the youngest row (its KV goes to the prompt cache;
    /// it resumes later). A row whose own KV is over the budget finishes
    /// with `length`, as at the end of the context. Returns the rows
    /// retired or preempted (either may have evicted prompt-cache entries
    /// for the worker to spill).
    fn grow_reservations(
        &mut self,
        model: &LoadedModel,
        mut caches: Option<&mut PrefixCache>,
    ) -> usize {
        let Some(budget) = self.budget else {
            return 0;
        };
        let shape = self.shape.get_or_insert_with(|| row_shape(model)).clone();
        let draft_shape = self.draft_shape(model);
        let chunk = self.config.prefill_chunk;
        let reserve = |seq: &mut Sequence<'_>, tokens: usize| {
            seq.reserved_tokens = tokens;
            seq.reserved_bytes = shape.reservation_left(tokens, seq.prefill_target(), chunk)
                + draft_kv_bytes(draft_shape.as_ref(), uses_draft_model(seq), tokens);
        };
        // After this step a row holds its whole history; a lookahead may
        // feed one more.
        let needed = |seq: &Sequence<'_>| seq.positions_after_feed() + 1;
        for seq in &mut self.running {
            let need = needed(seq);
            let tokens = if need > seq.reserved_tokens {
                admission::grown_tokens(need, seq.final_positions() + 1)
            } else {
                seq.reserved_tokens
            };
            reserve(seq, tokens);
        }
        // Short of whole growth steps, every row keeps only what it needs
        // before anyone is preempted.
        let total = |rows: &[Sequence<'_>]| rows.iter().map(|s| s.reserved_bytes).sum::<u64>();
        if total(&self.running) > budget {
            for seq in &mut self.running {
                let need = needed(seq);
                reserve(seq, need);
            }
        }
        let mut retired = 0;
        // A row whose own KV outgrew the budget can never continue:
        // preempting others would not save it. It finishes with `length`,
        // as at the end of the context. (Transient prefill activations
        // alone never end a row: they are gone after its chunk.)
        let mut i = 0;
        while i < self.running.len() {
            if shape.kv_bytes(needed(&self.running[i])) > budget {
                let seq = self.running.remove(i);
                tracing::warn!(
                    row = seq.id,
                    positions = seq.positions_after_feed(),
                    budget = %admission::gib(budget),
                    "a row's KV outgrew the memory budget (--memory-budget): it finishes with length"
                );
                finish(seq, Ok(FinishReason::Length), model, caches.as_deref_mut());
                retired += 1;
            } else {
                i += 1;
            }
        }
        loop {
            // One row left always runs (over the budget only by its
            // transient prefill activations).
            if total(&self.running) <= budget || self.running.len() <= 1 {
                return retired;
            }
            // The youngest row that has no lookahead in flight, else the
            // youngest (vLLM preempts the lowest-priority, latest request).
            let victim = self
                .running
                .iter()
                .enumerate()
                .filter(|(_, s)| s.preemptible())
                .max_by_key(|(_, s)| s.id)
                .or_else(|| self.running.iter().enumerate().max_by_key(|(_, s)| s.id))
                .map(|(i, _)| i)
                .unwrap_or(0);
            let mut seq = self.running.remove(victim);
            let (tokens, kv) = seq.preempt();
            // The draft KV goes too; the row re-feeds it when it drafts again.
            if let Some(row) = seq.spec.as_mut().and_then(RowSpec::draft_row) {
                row.reset();
            }
            let namespace = lora_namespace(model, seq.lora.as_deref());
            tracing::info!(
                row = seq.id,
                positions = tokens.len(),
                budget = %admission::gib(budget),
                "preempted a row to stay within the memory budget; it resumes when memory frees"
            );
            if let Some(c) = caches.as_deref_mut() {
                c.insert(&namespace, tokens, kv);
            }
            // Counted as retired, so the worker spills what the insert
            // evicted to the SSD tier now, while memory is short.
            retired += 1;
            self.preemptions += 1;
            let at = self.preempted.partition_point(|p| p.id < seq.id);
            self.preempted.insert(at, seq);
        }
    }

    /// The adapters waiting requests name (kept served until they start).
    pub fn waiting_loras(&self) -> Vec<String> {
        self.waiting
            .iter()
            .filter_map(|p| p.request.lora.clone())
            .collect()
    }

    /// Resumes preempted rows while their reservations fit (oldest first),
    /// then moves waiting requests into the batch while it has room and,
    /// under a memory budget, while their reservations fit beside the
    /// running rows' (the first that does not waits, keeping arrival order;
    /// one that could never fit fails with
    /// [`GenerateError::OverMemoryBudget`]).
    fn admit(&mut self, model: &LoadedModel, mut caches: Option<&mut PrefixCache>) {
        while self.running.len() < self.config.max_batch {
            if let Some(seq) = self.preempted.front() {
                let (history, final_positions) =
                    (seq.positions_after_feed(), seq.final_positions());
                // What the caches give back is not refilled: only the rest's
                // activations are reserved.
                let namespace = lora_namespace(model, seq.lora.as_deref());
                let reused = caches
                    .as_deref()
                    .map_or(0, |c| c.peek(&namespace, seq.history()));
                let drafts = uses_draft_model(seq);
                let reserve =
                    self.resume_reservation(model, history, reused, final_positions, drafts);
                let Some((bytes, tokens)) = reserve else {
                    return;
                };
                let Some(mut seq) = self.preempted.pop_front() else {
                    return;
                };
                if let Err(e) = resume_one(&mut seq, model, caches.as_deref_mut()) {
                    seq.sink.finished(Err(e));
                    continue;
                }
                seq.reserved_bytes = bytes;
                seq.reserved_tokens = tokens;
                self.running.push(seq);
                continue;
            }
            let Some(i) = self.next_to_admit(model, caches.as_deref()) else {
                return;
            };
            let Some(mut pending) = self.waiting.remove(i) else {
                return;
            };
            let (reserve, reserve_tokens) = match self.reservation(model, &pending.request) {
                Reservation::Fits(bytes, tokens) => (bytes, tokens),
                Reservation::Wait => {
                    self.waiting.insert(i, pending);
                    return;
                }
                Reservation::Never(message) => {
                    pending
                        .sink
                        .finished(Err(GenerateError::OverMemoryBudget(message)));
                    continue;
                }
            };
            let id = self.next_id;
            self.next_id += 1;
            let lora = pending_lora(model, &pending.request);
            let live = self.running_prefix(&pending.request.prompt_ids, lora.as_deref());
            let cached = caches.as_deref().map_or(0, |c| {
                c.peek(
                    &lora_namespace(model, lora.as_deref()),
                    &pending.request.prompt_ids,
                )
            });
            // A running row's KV, where it covers more than the cache: the
            // shared prefix is not prefilled twice.
            let seed = live.now.filter(|&(_, n)| n > cached).map(|(row, n)| {
                let mut kv = self.running[row].cache.clone();
                kv.truncate(n);
                Reuse {
                    kv,
                    reused: n,
                    source: ReuseSource::RunningRow,
                }
            });
            if let Some(mut seq) = admit_one(id, pending, model, seed, caches.as_deref_mut()) {
                seq.reserved_bytes = reserve;
                seq.reserved_tokens = reserve_tokens;
                self.record_reuse(&seq);
                self.running.push(seq);
            }
        }
    }

    /// The first waiting request to admit: in arrival order, passing over
    /// requests whose prompt shares a longer prefix with a row still
    /// prefilling it than the caches or running rows hold now. They wait
    /// for that row's KV (prefilling the prefix themselves would take no
    /// less time: both would share the step's prefill budget).
    fn next_to_admit(&self, model: &LoadedModel, caches: Option<&PrefixCache>) -> Option<usize> {
        self.waiting.iter().position(|p| {
            let prompt = &p.request.prompt_ids;
            let lora = pending_lora(model, &p.request);
            let live = self.running_prefix(prompt, lora.as_deref());
            let now = live.now.map_or(0, |(_, n)| n);
            let namespace = lora_namespace(model, lora.as_deref());
            let cached = caches.map_or(0, |c| c.peek(&namespace, prompt));
            live.later < now.max(cached) + SHARED_PREFIX_WAIT_MIN
        })
    }

    /// What running rows' KV covers of `prompt` (at most all but its last
    /// token): now, and once prefilling rows have fed their shared part.
    /// Only rows under the same LoRA adapter (`lora`) count.
    fn running_prefix(&self, prompt: &[u32], lora: Option<&LoraAdapter>) -> RunningPrefix {
        let limit = prompt.len().saturating_sub(1);
        let mut out = RunningPrefix::default();
        let uid = lora.map(|a| a.uid);
        for (i, row) in self.running.iter().enumerate() {
            if row.lora.as_ref().map(|a| a.uid) != uid {
                continue;
            }
            let shared = crate::cache::common_prefix(row.history(), prompt).min(limit);
            let now = row.cache.reusable(shared.min(row.fed));
            if now > out.now.map_or(0, |(_, n)| n) {
                out.now = Some((i, now));
            }
            // Only a row still short of the shared part will add to it
            // (one past it may no longer be trimmable back to it).
            if row.phase() == Phase::Prefill && row.fed < shared {
                out.later = out.later.max(shared);
            }
        }
        out
    }

    /// Keeps the last [`RECENT_REQUESTS`] admissions' reuse for `/stats`.
    fn record_reuse(&mut self, seq: &Sequence<'_>) {
        if seq.reused_from == ReuseSource::RunningRow {
            self.tokens_from_running_rows += seq.cached_tokens as u64;
        }
        if self.recent.len() == RECENT_REQUESTS {
            self.recent.pop_front();
        }
        self.recent.push_back(RecentRequest {
            row: seq.id,
            prompt_tokens: seq.prompt_len,
            reused_tokens: seq.cached_tokens,
            reused_from: seq.reused_from,
        });
    }

    /// Whether `request` fits the memory budget now, later or never: its
    /// prompt's KV and a first growth step, plus its largest prefill chunk
    /// (not its whole `max_tokens`: the reservation grows as it decodes).
    fn reservation(&mut self, model: &LoadedModel, request: &GenerateRequest) -> Reservation {
        let Some(budget) = self.budget else {
            return Reservation::Fits(0, 0);
        };
        let shape = self.shape.get_or_insert_with(|| row_shape(model));
        let context = model.model.config().max_position_embeddings;
        let prompt = request.prompt_ids.len();
        let max_new = request.max_tokens.min(context.saturating_sub(prompt));
        let tokens = admission::grown_tokens(prompt + 1, prompt + max_new + 1);
        let drafts = request.speculative.enabled()
            && request.speculative.drafter.as_deref() == Some(draft_model::DRAFTER_NAME);
        let need = shape.reservation_bytes(tokens, Some(prompt), self.config.prefill_chunk)
            + draft_kv_bytes(self.draft_shape(model).as_ref(), drafts, tokens);
        if need > budget {
            return Reservation::Never(format!(
                "this request needs about {} for its prompt's KV cache and activations ({prompt} \
                 prompt tokens), over the server's memory budget of {} (--memory-budget): \
                 shorten the prompt",
                admission::gib(need),
                admission::gib(budget)
            ));
        }
        if self.fits_beside_running(need, budget) {
            Reservation::Fits(need, tokens)
        } else {
            Reservation::Wait
        }
    }

    /// Whether `need` more bytes fit beside the running rows' reservations
    /// (always, into an empty batch).
    fn fits_beside_running(&self, need: u64, budget: u64) -> bool {
        let reserved: u64 = self.running.iter().map(|s| s.reserved_bytes).sum();
        self.running.is_empty() || reserved + need <= budget
    }

    /// The reservation (bytes, positions) a preempted row resumes with,
    /// or `None` while it does not fit beside the running rows.
    fn resume_reservation(
        &mut self,
        model: &LoadedModel,
        history: usize,
        reused: usize,
        final_positions: usize,
        drafts: bool,
    ) -> Option<(u64, usize)> {
        let Some(budget) = self.budget else {
            return Some((0, 0));
        };
        let draft_shape = self.draft_shape(model);
        let shape = self.shape.get_or_insert_with(|| row_shape(model));
        let tokens = admission::grown_tokens(history + 1, final_positions + 1);
        let left = history.saturating_sub(reused).max(1);
        let need = shape.reservation_left(tokens, Some((history, left)), self.config.prefill_chunk)
            + draft_kv_bytes(draft_shape.as_ref(), drafts, tokens);
        self.fits_beside_running(need, budget)
            .then_some((need, tokens))
    }

    /// The draft model's admission shape (set on first use; `None`
    /// without a draft model).
    fn draft_shape(&mut self, model: &LoadedModel) -> Option<RowShape> {
        let draft = model.draft.as_deref()?;
        Some(
            self.draft_shape
                .get_or_insert_with(|| row_shape(draft))
                .clone(),
        )
    }

    /// Tokens each running row feeds this step (see the module doc).
    fn plan(&self) -> Vec<usize> {
        let decoding = self.running.iter().any(|s| s.phase() == Phase::Decode);
        let mut budget = if decoding {
            self.config.prefill_budget
        } else {
            self.config.prefill_budget.max(self.config.prefill_chunk)
        };
        self.running
            .iter()
            .map(|s| match s.phase() {
                Phase::Decode => s.unfed().len(),
                Phase::Prefill => {
                    let n = s.prefill_left().min(self.config.prefill_chunk).min(budget);
                    budget -= n;
                    n
                }
            })
            .collect()
    }
}

/// A waiting request defers to a prefilling row only for at least this
/// many more shared tokens (a chat template's first few tokens are common
/// to every request).
const SHARED_PREFIX_WAIT_MIN: usize = 32;

/// Admissions `/stats` lists (`batch.recent`).
const RECENT_REQUESTS: usize = 32;

/// What running rows' KV covers of a prompt.
#[derive(Debug, Default)]
struct RunningPrefix {
    /// The row whose KV covers most of it now, and how much.
    now: Option<(usize, usize)>,
    /// The most a prefilling row will cover once it has fed its shared part.
    later: usize,
}

/// One admission's prompt reuse (`GET /stats`, `batch.recent`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct RecentRequest {
    /// The row's id (admission order).
    pub row: u64,
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Of those, tokens whose KV was reused instead of prefilled.
    pub reused_tokens: usize,
    /// Where the reused KV came from.
    pub reused_from: ReuseSource,
}

/// Whether a request fits the memory budget.
enum Reservation {
    /// Now, reserving this many bytes for this many KV positions.
    Fits(u64, usize),
    /// Once running rows retire.
    Wait,
    /// Never (the message says why).
    Never(String),
}

/// Bytes a row's draft KV takes at `tokens` positions: it follows the
/// row's history (`engine::draft_model`), so it is reserved beside the
/// row's own KV, for rows drafting with the draft model (`drafts`).
fn draft_kv_bytes(shape: Option<&RowShape>, drafts: bool, tokens: usize) -> u64 {
    match shape {
        Some(s) if drafts => s.kv_bytes(tokens),
        _ => 0,
    }
}

/// Whether the row drafts with the draft model.
fn uses_draft_model(seq: &Sequence<'_>) -> bool {
    seq.spec
        .as_ref()
        .is_some_and(|s| s.drafter_name() == draft_model::DRAFTER_NAME)
}

/// The admission shape of `model` (its config, cache kinds and dtype).
fn row_shape(model: &LoadedModel) -> RowShape {
    let elem = match model.model.dtype() {
        mlx_rs::Dtype::Float32 => 4,
        _ => 2,
    };
    RowShape::new(
        model.model.config(),
        model.model.new_cache().kinds(),
        model.model.kv_shapes(),
        elem,
    )
    .with_kv_quant(model.model.new_cache().quant())
}

/// The request's sampler and processors, instantiated from `host`.
fn plugin_chain(
    model: &LoadedModel,
    request: &GenerateRequest,
    host: &PluginHost,
) -> Result<RowChain, PluginError> {
    let params = effective_params(model, request);
    RowChain::new(
        host,
        &request.sampler,
        &request.processors,
        &params,
        &request.plugin_params,
    )
}

/// A session of the request's constraint plugin for its grammar. A grammar
/// the plugin rejects is the client's fault, named by the field it came
/// from ([`PluginError::Grammar`]).
fn open_constraint(
    host: &PluginHost,
    c: &ConstraintRequest,
    plugin_params: &serde_json::Value,
) -> Result<ConstraintSession, PluginError> {
    let shared = host.constraint(&c.plugin)?;
    let defaults = host
        .get(&c.plugin, crate::plugin::Kind::Constraint)?
        .manifest
        .defaults_json();
    let extra = crate::plugin::session::merged_params(&c.plugin, defaults, plugin_params);
    ConstraintSession::open(shared, c.grammar.clone(), extra.to_string()).map_err(|e| match e {
        OpenError::Rejected(cause) => PluginError::Grammar {
            plugin: c.plugin.clone(),
            field: c.field.clone(),
            cause,
        },
        OpenError::Failed(e) => e,
    })
}

/// The adapter a waiting request names, as served now (`None`: the base,
/// or a name no longer served, which fails at admission).
fn pending_lora(model: &LoadedModel, request: &GenerateRequest) -> Option<Rc<LoraAdapter>> {
    request.lora.as_deref().and_then(|n| model.lora.get(n))
}

/// Validates and instantiates one request; `None` when it failed (its sink
/// has the error).
fn admit_one<'s>(
    id: u64,
    pending: Pending<'s>,
    model: &LoadedModel,
    seed: Option<Reuse>,
    caches: Option<&mut PrefixCache>,
) -> Option<Sequence<'s>> {
    let Pending {
        request,
        chain,
        mut sink,
    } = pending;
    if let Err(e) = validate(model, &request) {
        sink.finished(Err(e));
        return None;
    }
    let host: Option<Arc<PluginHost>> = match &chain {
        ChainSource::Ready(_) | ChainSource::ReadyDrafting(..) => None,
        ChainSource::Plugins(h) | ChainSource::Constrained(h, _) => Some(h.clone()),
    };
    let mut given_spec = None;
    let chain: Box<dyn TokenChain + 's> = match chain {
        ChainSource::Ready(c) => c,
        ChainSource::ReadyDrafting(c, spec) => {
            given_spec = Some(spec);
            c
        }
        ChainSource::Plugins(host) => match plugin_chain(model, &request, &host) {
            Ok(c) => Box::new(c),
            Err(e) => {
                sink.finished(Err(e.into()));
                return None;
            }
        },
        ChainSource::Constrained(host, constraint) => {
            let constrained = plugin_chain(model, &request, &host).and_then(|c| {
                let session = open_constraint(&host, &constraint, &request.plugin_params)?;
                Ok(super::grammar::GrammarConstraint::new(c, session))
            });
            match constrained {
                Ok(c) => Box::new(c),
                Err(e) => {
                    sink.finished(Err(e.into()));
                    return None;
                }
            }
        }
    };
    let chain: Box<dyn TokenChain + 's> = if request.forced_choices.is_empty() {
        chain
    } else {
        Box::new(super::constrain::ChoiceConstraint::new(
            chain,
            request.forced_choices.clone(),
        ))
    };
    let lora = match request.lora.as_deref() {
        None => None,
        Some(name) => match model.lora.get(name) {
            Some(a) => Some(a),
            None => {
                sink.finished(Err(GenerateError::InvalidRequest(format!(
                    "no LoRA adapter `{name}` is served (adapters: {})",
                    model.lora.names().join(", ")
                ))));
                return None;
            }
        },
    };
    let namespace = lora_namespace(model, lora.as_deref());
    let reuse = seed.or_else(|| caches.and_then(|c| c.lookup(&namespace, &request.prompt_ids)));
    let (mut cache, cached, source) = match reuse {
        Some(r) => (r.kv, r.reused, r.source),
        None => (model.model.new_cache(), 0, ReuseSource::None),
    };
    // A hit shares the entry's buffers; the row's decode steps write its
    // cache in place, so it gets its own copy.
    if cached > 0 && crate::model::decode_attention::enabled() {
        if let Err(e) = cache.make_exclusive() {
            sink.finished(Err(e.into()));
            return None;
        }
    }
    sink.event(GenerateEvent::Started {
        cached_tokens: cached,
    });
    let mut seq = Sequence::new(
        id,
        request.prompt_ids,
        request.max_tokens,
        model.model.config().max_position_embeddings,
        &request.stop,
        request.keep_special,
        request.top_logprobs,
        chain,
        sink,
        cache,
        cached,
    );
    seq.reused_from = source;
    seq.lora = lora;
    seq.spec = match &host {
        Some(host) => row_spec(
            host,
            model,
            &request.speculative,
            seq.history().len(),
            &request.plugin_params,
        ),
        None => given_spec.filter(|_| model.model.new_cache().trimmable()),
    };
    Some(seq)
}

/// The row's speculation: a session of the request's drafter, or `None`
/// when it asks for none, when the model's cache cannot drop positions (a
/// recurrent state), or when the drafter fails to start (logged; the row
/// decodes without drafts).
fn row_spec(
    host: &PluginHost,
    model: &LoadedModel,
    spec: &super::speculative::SpecRequest,
    prompt_len: usize,
    plugin_params: &serde_json::Value,
) -> Option<RowSpec> {
    let name = spec.drafter.as_deref().filter(|_| spec.enabled())?;
    if !model.model.new_cache().trimmable() {
        return None;
    }
    if name == draft_model::DRAFTER_NAME {
        if model.draft.is_none() {
            tracing::warn!(
                drafter = name,
                "no draft model is loaded (--draft-model); the request decodes without drafts"
            );
            return None;
        }
        // Its draft cache is created when the row first drafts.
        let drafter = draft_model::DraftModelDrafter {
            row: draft_model::DraftRow::default(),
        };
        return Some(RowSpec::new(Box::new(drafter), spec.max_draft));
    }
    let vocab = model.model.config().vocab_size;
    match crate::plugin::drafter::PluginDrafter::new(host, name, prompt_len, vocab, plugin_params) {
        Ok(d) => Some(RowSpec::new(Box::new(d), spec.max_draft)),
        Err(e) => {
            tracing::warn!(drafter = name, error = %e, "the drafter did not start; the request decodes without drafts");
            None
        }
    }
}

/// Gives a preempted row its KV back: the longest cached prefix of its
/// history (its own KV, inserted when it was preempted, unless evicted
/// since), the rest re-fed as prefill.
fn resume_one(
    seq: &mut Sequence<'_>,
    model: &LoadedModel,
    caches: Option<&mut PrefixCache>,
) -> Result<(), GenerateError> {
    let namespace = lora_namespace(model, seq.lora.as_deref());
    let reuse = caches.and_then(|c| c.lookup(&namespace, seq.history()));
    let (mut cache, reused) = match reuse {
        Some(r) => (r.kv, r.reused),
        None => (model.model.new_cache(), 0),
    };
    if reused > 0 && crate::model::decode_attention::enabled() {
        cache.make_exclusive()?;
    }
    tracing::info!(
        row = seq.id,
        reused,
        history = seq.history().len(),
        "resumed a preempted row"
    );
    seq.resume(cache, reused);
    Ok(())
}

/// Retires a sequence: flushes its held-back text, stores its KV in the
/// prompt cache (unless it failed) and tells its sink.
fn finish(
    mut seq: Sequence<'_>,
    result: Result<FinishReason, GenerateError>,
    model: &LoadedModel,
    caches: Option<&mut PrefixCache>,
) {
    seq.settle_cache();
    let result = result.and_then(|finish| seq.flush_text(&model.tokenizer, finish));
    match result {
        Ok(finish) => {
            let summary = seq.summary(finish);
            if let Some(c) = caches {
                let tokens = seq.fed_ids().to_vec();
                let cache = std::mem::replace(&mut seq.cache, crate::cache::KvCache::new(0));
                c.insert(&lora_namespace(model, seq.lora.as_deref()), tokens, cache);
            }
            seq.sink.finished(Ok(summary));
        }
        Err(e) => seq.sink.finished(Err(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::KvCache;

    #[test]
    fn lookahead_auto_turns_on_only_for_large_models_on_a_gpu() {
        let big = LOOKAHEAD_MIN_WEIGHT_BYTES;
        assert_eq!(Lookahead::Auto.resolve(true, big), Lookahead::On);
        assert_eq!(Lookahead::Auto.resolve(true, big - 1), Lookahead::Off);
        assert_eq!(Lookahead::Auto.resolve(false, big * 8), Lookahead::Off);
        // Explicit settings stay whatever the backend and size.
        assert_eq!(Lookahead::On.resolve(false, 0), Lookahead::On);
        assert_eq!(Lookahead::Off.resolve(true, big * 8), Lookahead::Off);
        // Unresolved, auto looks ahead nowhere.
        assert!(!Lookahead::Auto.is_on());
        for (text, want) in [
            ("auto", Some(Lookahead::Auto)),
            (" ON ", Some(Lookahead::On)),
            ("1", Some(Lookahead::On)),
            ("yes", Some(Lookahead::On)),
            ("false", Some(Lookahead::Off)),
            ("0", Some(Lookahead::Off)),
            ("sometimes", None),
        ] {
            assert_eq!(Lookahead::parse(text), want, "{text}");
        }
    }
    use crate::engine::request::GenerateSummary;
    use crate::plugin::session::StepOutput;
    use crate::plugin::PluginError;

    struct NoChain;
    impl TokenChain for NoChain {
        fn step(
            &mut self,
            _: mlx_rs::Array,
            _: &[u32],
            _: usize,
            _: u32,
        ) -> Result<StepOutput, PluginError> {
            unreachable!("plan() never runs a chain")
        }
        fn accept(&mut self, _: u32, _: f32, _: f32) -> Result<(), PluginError> {
            Ok(())
        }
        fn sampler_name(&self) -> &str {
            "none"
        }
        fn chain_time(&self) -> Duration {
            Duration::ZERO
        }
    }

    struct NoSink;
    impl SequenceSink for NoSink {
        fn event(&mut self, _: GenerateEvent) {}
        fn cancelled(&self) -> bool {
            false
        }
        fn finished(&mut self, _: Result<GenerateSummary, GenerateError>) {}
    }

    /// A row with `prompt` tokens of which `fed` are in its KV; `decoding`
    /// rows have their whole prompt fed and one sampled token waiting.
    fn row(prompt: usize, fed: usize, decoding: bool) -> Sequence<'static> {
        let mut s = Sequence::new(
            0,
            vec![1; prompt],
            16,
            4096,
            &[],
            false,
            0,
            Box::new(NoChain),
            Box::new(NoSink),
            KvCache::new(1),
            0,
        );
        s.fed(if decoding { prompt } else { fed });
        if decoding {
            s.ids.push(7);
        }
        s
    }

    fn scheduler(budget: usize, chunk: usize, rows: Vec<Sequence<'static>>) -> Scheduler<'static> {
        let mut s = Scheduler::new(SchedulerConfig {
            max_batch: 8,
            prefill_budget: budget,
            prefill_chunk: chunk,
            memory_budget: MemoryBudget::Off,
            decode_lookahead: Lookahead::Off,
            plugin_step: DEFAULT_PLUGIN_STEP,
        });
        s.running = rows;
        s
    }

    #[test]
    fn decoding_rows_feed_one_token_and_prefill_shares_the_budget_in_order() {
        let s = scheduler(
            100,
            512,
            vec![row(10, 0, true), row(300, 0, false), row(50, 0, false)],
        );
        assert_eq!(
            s.plan(),
            vec![1, 100, 0],
            "the first prefill row takes the whole budget"
        );
        let s = scheduler(
            100,
            512,
            vec![row(10, 0, true), row(60, 20, false), row(50, 0, false)],
        );
        assert_eq!(
            s.plan(),
            vec![1, 40, 50],
            "what one row leaves goes to the next"
        );
    }

    #[test]
    fn with_nothing_decoding_prefill_runs_at_the_chunk_size() {
        let s = scheduler(100, 512, vec![row(2000, 0, false), row(30, 0, false)]);
        assert_eq!(s.plan(), vec![512, 0]);
        let s = scheduler(100, 512, vec![row(200, 0, false), row(30, 0, false)]);
        assert_eq!(s.plan(), vec![200, 30]);
    }
}
