//! One request inside the engine: a sequence owns everything that belongs
//! to its row of the batch, so rows never see each other's state.
//!
//! - its token history (prompt, then generated ids) and how much of it is
//!   already in its KV cache rows (`fed`); the tokens not yet fed are what
//!   the next step runs for this row (a prompt chunk while prefilling, the
//!   last sampled token while decoding);
//! - its plugin chain (processors and sampler sessions, each with its own
//!   store: per-row RNG, seeds, penalties over its own history, mirostat's
//!   and DRY's state);
//! - its output state (incremental detokenizer, stop-string matcher);
//! - its limits (`max_tokens`, the context) and its sink, which also says
//!   whether the caller cancelled;
//! - its speculation (drafter, adaptive draft length, a verification in
//!   progress; `engine::speculative`).

use std::time::{Duration, Instant};

use super::detokenize::{Detokenizer, StopMatcher};
use super::request::{FinishReason, GenerateError, GenerateEvent, GenerateSummary, TokenInfo};
use super::speculative::{RowSpec, Verify};
use crate::cache::KvCache;
use crate::model::{LoadedModel, TextTokenizer};
use crate::plugin::session::TokenChain;

/// Where a sequence's events go. Implemented by the server (a channel per
/// HTTP request), by `mlxhost generate` (stdout) and by tests.
pub trait SequenceSink {
    /// An event, in order: `Started`, then `Token` / `Text` interleaved.
    fn event(&mut self, event: GenerateEvent);
    /// Polled once per step: true stops the sequence (finish reason
    /// `Cancelled`) at the next step boundary.
    fn cancelled(&self) -> bool;
    /// Exactly once, last: the summary, or why the sequence failed.
    fn finished(&mut self, result: Result<GenerateSummary, GenerateError>);
}

/// Where a sequence is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Prompt tokens remain to be fed.
    Prefill,
    /// Exactly one sampled token waits to be fed.
    Decode,
}

/// A request admitted into the running batch.
pub struct Sequence<'s> {
    /// Scheduler-assigned id (admission order), for logs.
    pub id: u64,
    /// The row's token chooser (plugin chain, or a native benchmark chain).
    pub(crate) chain: Box<dyn TokenChain + 's>,
    pub(crate) sink: Box<dyn SequenceSink + 's>,
    /// The row's KV cache; `cache.offset() == fed`.
    pub(crate) cache: KvCache,
    /// Prompt then generated ids. Every id here is fed to the model except
    /// a final EOS, which ends the sequence instead.
    pub(crate) ids: Vec<u32>,
    pub(crate) prompt_len: usize,
    /// Positions of `ids` whose KV is in `cache`.
    pub(crate) fed: usize,
    /// Prompt tokens whose KV came from the prompt cache (or a running
    /// row: `reused_from`).
    pub(crate) cached_tokens: usize,
    /// Where those tokens' KV came from.
    pub(crate) reused_from: crate::cache::prompt::ReuseSource,
    /// The LoRA adapter the row runs with, held for its whole life (a
    /// reload of the adapter's folder never changes a running row's).
    pub lora: Option<std::rc::Rc<crate::model::lora::LoraAdapter>>,
    pub(crate) generated: usize,
    /// `max_tokens` capped by the context left after the prompt.
    pub(crate) max_new: usize,
    pub(crate) top_logprobs: usize,
    detok: Detokenizer,
    stops: StopMatcher,
    /// The stop string that ended the sequence (held-back text is dropped).
    stopped_by: Option<String>,
    admitted: Instant,
    prefill_done: Option<Instant>,
    /// Bytes the scheduler reserved for this row under `--memory-budget`
    /// (KV for `reserved_tokens` positions, plus prefill activations while
    /// it prefills; 0 when no budget).
    pub(crate) reserved_bytes: u64,
    /// Positions of KV the reservation covers; the scheduler grows it as
    /// the row decodes (see `engine::admission`).
    pub(crate) reserved_tokens: usize,
    /// After a preemption, the row re-feeds its whole history up to here
    /// (prompt and generated ids) before it decodes again; 0 otherwise.
    refill_end: usize,
    /// Times the scheduler paused this row to free memory.
    pub(crate) preemptions: u32,
    /// The row's next token, already being computed by a decode lookahead
    /// step (see `engine::step`); the next step reads it instead of
    /// feeding anything.
    pub(crate) lookahead: Option<Lookahead>,
    /// The cache holds one position beyond `fed`: a lookahead step fed the
    /// token the current step chose before the host read it. It becomes
    /// `fed` when that token is taken ([`Sequence::take_token`]); a row that
    /// ends first drops it ([`Sequence::settle_cache`]).
    pub(crate) fed_ahead: bool,
    /// Logits the row's last forward produced whose chain a step deferred
    /// (its plugin bound was used up by other rows, or a decode lookahead
    /// fed the row before its chain could see the token it needs): the
    /// next step runs the chain on them first, feeding nothing for the row.
    pub(crate) deferred: Option<mlx_rs::Array>,
    /// Steps in a row this row's chain was deferred (the longest-deferred
    /// row runs first in the next step).
    pub(crate) deferrals: u32,
    /// The guest time of the row's last chain (its calls less their waits on
    /// the forward): the step runs fast chains first.
    pub(crate) last_chain_time: std::time::Duration,
    /// The row's drafter and draft-length state; `None`: no speculation
    /// (never asked for, or its drafter failed).
    pub(crate) spec: Option<RowSpec>,
    /// Drafts the scheduler proposed for this step (fed after the row's
    /// token; empty: a plain decode step).
    pub(crate) drafts: Vec<u32>,
    /// A verification in progress: the cache holds the fed drafts'
    /// positions beyond `fed` until they are accepted or trimmed.
    pub(crate) verify: Option<Verify>,
}

/// A token a lookahead step is choosing for a row.
pub(crate) enum Lookahead {
    /// Row `row` of that step's results (shared by its rows).
    Row {
        reads: std::rc::Rc<super::step::PendingReads>,
        row: usize,
    },
    /// The row's chain failed while building the lookahead step.
    Failed(GenerateError),
}

impl<'s> Sequence<'s> {
    /// A sequence for `prompt` whose first `cached_tokens` positions are
    /// already in `cache` (a prompt-cache hit; 0 and an empty cache on a
    /// miss). `cached_tokens < prompt.len()` (the last prompt token is
    /// always fed, so the first step has logits).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        id: u64,
        prompt: Vec<u32>,
        max_tokens: usize,
        context: usize,
        stop: &[String],
        keep_special: bool,
        top_logprobs: usize,
        chain: Box<dyn TokenChain + 's>,
        sink: Box<dyn SequenceSink + 's>,
        cache: KvCache,
        cached_tokens: usize,
    ) -> Self {
        let prompt_len = prompt.len();
        let detok = Detokenizer::with_context(&prompt[prompt_len.saturating_sub(5)..])
            .keeping_special(keep_special);
        Sequence {
            id,
            chain,
            sink,
            cache,
            max_new: max_tokens.min(context.saturating_sub(prompt_len)),
            ids: prompt,
            prompt_len,
            fed: cached_tokens,
            cached_tokens,
            reused_from: crate::cache::prompt::ReuseSource::None,
            lora: None,
            generated: 0,
            top_logprobs,
            detok,
            stops: StopMatcher::new(stop),
            stopped_by: None,
            admitted: Instant::now(),
            prefill_done: None,
            reserved_bytes: 0,
            reserved_tokens: 0,
            refill_end: 0,
            preemptions: 0,
            lookahead: None,
            fed_ahead: false,
            deferred: None,
            deferrals: 0,
            last_chain_time: std::time::Duration::ZERO,
            spec: None,
            drafts: Vec::new(),
            verify: None,
        }
    }

    /// Whether the row may draft this step: it decodes with exactly its
    /// sampled token to feed, nothing of an earlier step is in flight, and
    /// its drafter is not paused out of room.
    pub(crate) fn can_draft(&self) -> bool {
        self.spec.is_some()
            && self.phase() == Phase::Decode
            && self.fed + 1 == self.ids.len()
            && self.lookahead.is_none()
            && !self.fed_ahead
            && self.deferred.is_none()
            && self.verify.is_none()
    }

    /// Draft tokens the row may feed this step: one fewer than the tokens
    /// it may still generate (a fully accepted draft also emits a bonus
    /// token), within its KV reservation under a memory budget.
    pub(crate) fn draft_room(&self) -> usize {
        let left = self.max_new.saturating_sub(self.generated + 1);
        if self.reserved_tokens > 0 {
            left.min(self.reserved_tokens.saturating_sub(self.ids.len()))
        } else {
            left
        }
    }

    /// Ends a verification that will choose no more tokens this step:
    /// trims the drafts after the last accepted one from the KV, and
    /// tells the row's speculation how it went. Returns `(drafted,
    /// accepted)`; `None` when no verification was in progress.
    pub(crate) fn end_verify(&mut self) -> Option<(usize, usize)> {
        let v = self.verify.take()?;
        if self.cache.offset() > self.fed && !self.fed_ahead {
            if self.cache.reusable(self.fed) == self.fed {
                self.cache.truncate(self.fed);
            } else {
                // Cannot happen within KvCache::ROLLBACK; if it does, the
                // row re-feeds its history (as after a preemption).
                self.cache.truncate(0);
                self.fed = 0;
                self.refill_end = self.ids.len();
            }
        }
        if let Some(spec) = &mut self.spec {
            spec.record(v.drafts.len(), v.accepted);
        }
        Some((v.drafts.len(), v.accepted))
    }

    /// Prefill while prompt tokens (or, after a preemption, history) remain
    /// unfed, then decode.
    pub fn phase(&self) -> Phase {
        if self.fed < self.prefill_end() {
            Phase::Prefill
        } else {
            Phase::Decode
        }
    }

    /// Where prefill ends: the prompt's end, or after a preemption the end
    /// of the history it re-feeds.
    fn prefill_end(&self) -> usize {
        self.prompt_len.max(self.refill_end)
    }

    /// The positions this row holds in KV once its unfed ids are fed.
    pub(crate) fn positions_after_feed(&self) -> usize {
        self.ids.len()
    }

    /// Where prefill (or a refill after preemption) ends, for the
    /// scheduler's activation estimate; `None` while decoding.
    pub(crate) fn prefill_target(&self) -> Option<(usize, usize)> {
        (self.phase() == Phase::Prefill).then(|| (self.prefill_end(), self.prefill_left()))
    }

    /// The most positions this row can ever hold (prompt plus `max_new`).
    pub(crate) fn final_positions(&self) -> usize {
        self.prompt_len + self.max_new
    }

    /// Whether the row can be paused now without losing work a step has
    /// in flight for it (a lookahead token being chosen).
    pub(crate) fn preemptible(&self) -> bool {
        self.lookahead.is_none()
    }

    /// Pauses the row to free its memory: returns the ids its KV holds and
    /// the KV (for the prompt cache, so resuming is mostly a cache hit);
    /// the row keeps its chain, output state and sink, and re-feeds its
    /// whole history when resumed ([`Sequence::resume`]).
    pub(crate) fn preempt(&mut self) -> (Vec<u32>, KvCache) {
        self.settle_cache();
        // Deferred logits are recomputed by the refill's last position.
        self.deferred = None;
        let tokens = self.fed_ids().to_vec();
        let kv = std::mem::replace(&mut self.cache, KvCache::new(0));
        self.fed = 0;
        self.refill_end = self.ids.len();
        self.preemptions += 1;
        self.reserved_bytes = 0;
        self.reserved_tokens = 0;
        (tokens, kv)
    }

    /// Resumes a preempted row with `cache` holding its first `reused`
    /// ids (`reused < ids.len()`; an empty cache and 0 on a miss).
    pub(crate) fn resume(&mut self, cache: KvCache, reused: usize) {
        self.cache = cache;
        self.fed = reused.min(self.ids.len().saturating_sub(1));
    }

    /// The row's whole history (prompt and generated ids, the last one not
    /// yet fed while decoding).
    pub(crate) fn history(&self) -> &[u32] {
        &self.ids
    }

    /// Ids not yet in the KV cache (what the next step may feed).
    pub(crate) fn unfed(&self) -> &[u32] {
        &self.ids[self.fed..]
    }

    /// Prompt tokens (or, after a preemption, history) still to prefill.
    pub fn prefill_left(&self) -> usize {
        self.prefill_end().saturating_sub(self.fed)
    }

    /// Records that `n` more positions were fed (the step's forward ran).
    pub(crate) fn fed(&mut self, n: usize) {
        self.fed += n;
    }

    /// Handles the token the step chose for this row: tells the chain,
    /// streams it, and decides whether the sequence ends. Returns the finish
    /// reason when it does.
    ///
    /// Errors: a chain failure in `accept`, a detokenizer failure.
    pub(crate) fn take_token(
        &mut self,
        info: TokenInfo,
        sampled_logprob: f32,
        model: &LoadedModel,
    ) -> Result<Option<FinishReason>, GenerateError> {
        let id = info.id;
        // The first token's read ends the prefill (mlx-lm's prompt time):
        // the prefill step's evaluation counts there, not in decode.
        self.prefill_done.get_or_insert_with(Instant::now);
        self.chain.accept(id, info.logprob, sampled_logprob)?;
        self.generated += 1;
        self.sink.event(GenerateEvent::Token(info));
        if model.eos_ids.contains(&id) {
            return Ok(Some(FinishReason::Stop));
        }
        self.ids.push(id);
        if let Some(v) = &mut self.verify {
            // The token chosen at logits row `next - 1` is compared with the
            // draft fed at that position: equal, and its KV is already in
            // the cache (fed by the verification forward).
            let at = v.next - 1;
            if at < v.drafts.len() && v.drafts[at] == id {
                v.accepted += 1;
                self.fed += 1;
            } else {
                v.matched = false;
            }
        }
        if self.fed_ahead {
            // A lookahead step already fed this token.
            self.fed_ahead = false;
            self.fed += 1;
        }
        let delta = self.detok.push(&model.tokenizer, id)?;
        if !delta.is_empty() {
            let fed = self.stops.feed(&delta);
            if !fed.emit.is_empty() {
                self.sink.event(GenerateEvent::Text(fed.emit));
            }
            if fed.stopped.is_some() {
                self.stopped_by = fed.stopped;
                return Ok(Some(FinishReason::Stop));
            }
        }
        if self.generated >= self.max_new {
            return Ok(Some(FinishReason::Length));
        }
        Ok(None)
    }

    /// Emits text held back (an incomplete character, a possible stop-string
    /// prefix): real output unless a stop string ended generation. Returns
    /// the final finish reason (a stop string completed by the tail turns
    /// `Length` into `Stop`).
    pub(crate) fn flush_text(
        &mut self,
        tokenizer: &TextTokenizer,
        finish: FinishReason,
    ) -> Result<FinishReason, GenerateError> {
        if self.stopped_by.is_some() {
            return Ok(finish);
        }
        let tail = self.detok.flush(tokenizer)?;
        let mut rest = self.stops.feed(&tail);
        let finish = if rest.stopped.is_some() {
            self.stopped_by = rest.stopped.take();
            FinishReason::Stop
        } else {
            rest.emit.push_str(&self.stops.flush());
            finish
        };
        if !rest.emit.is_empty() {
            self.sink.event(GenerateEvent::Text(rest.emit));
        }
        Ok(finish)
    }

    /// The totals so far, finishing with `finish`.
    pub(crate) fn summary(&self, finish: FinishReason) -> GenerateSummary {
        let now = Instant::now();
        let prefill_done = self.prefill_done.unwrap_or(now);
        GenerateSummary {
            finish_reason: finish,
            prompt_tokens: self.prompt_len,
            cached_tokens: self.cached_tokens,
            completion_tokens: self.generated,
            stop_sequence: self.stopped_by.clone(),
            prefill: prefill_done.duration_since(self.admitted),
            decode: if self.prefill_done.is_some() {
                now.duration_since(prefill_done)
            } else {
                Duration::ZERO
            },
            plugin_time: self.chain.chain_time(),
        }
    }

    /// Drops a lookahead in flight and the cache position it fed ahead, so
    /// the cache holds exactly `fed_ids()` (before the row retires).
    pub(crate) fn settle_cache(&mut self) {
        self.lookahead = None;
        self.end_verify();
        self.drafts.clear();
        if self.fed_ahead || self.cache.offset() > self.fed {
            self.cache.truncate(self.fed);
            self.fed_ahead = false;
        }
    }

    /// The ids whose KV the cache holds, for the prompt cache.
    pub(crate) fn fed_ids(&self) -> &[u32] {
        &self.ids[..self.fed.min(self.ids.len())]
    }
}
