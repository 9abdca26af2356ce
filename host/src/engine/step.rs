//! One engine step over the running batch: one forward for every row that
//! has tokens to feed (prompt chunks beside single decode tokens), each row's
//! plugin chain on its own logits, then one evaluation of every row's token,
//! log-probabilities and alternatives.
//!
//! The forward is started with `async_eval` before the plugin chains run, so
//! their graph building overlaps the model's compute; a plugin that reads
//! back waits for the forward inside its own call. (Evaluating the whole
//! step once, after the chains, measured no faster on the H200 or this
//! CPU: docs/benchmarks.md, "Run 9".)
//!
//! **Decode lookahead** (`--decode-lookahead`): when every running row
//! decodes, the step also builds and starts the *next* step's forward
//! before reading this one's tokens: it feeds this step's tokens as device
//! arrays ([`crate::model::CausalLm::forward_device_ids`]), so the host
//! builds step N+1's graph while the device computes step N (as mlx-lm's
//! generate loop does). A row whose chain is history-free
//! ([`crate::plugin::TokenChain::history_free`]) runs its chain on those
//! logits at once, and the next call only reads its token (and starts the
//! step after). A row whose chain needs this step's token first (a
//! grammar's mask, a penalty over the history) keeps the logits as
//! [`Sequence::deferred`]: the next call runs its chain after the token is
//! taken, while the device still computes the forward, so a grammar's mask
//! overlaps the model instead of stopping every row's lookahead. A row's
//! cache holds one position beyond `fed` while its lookahead is in flight
//! ([`Sequence::fed_ahead`]); a row that finishes meanwhile has it dropped
//! at retirement. Outputs are the same as without lookahead: the same
//! graph, fed the same tokens, each chain called in the same order.
//!
//! **Verification** (`engine::speculative`): a row with drafts feeds its
//! token and the drafts as one chunk; its chain chooses the first position's
//! token here like any row's, and [`verify_round`] chooses each further
//! position's while the chosen tokens equal the drafts.

use std::time::{Duration, Instant};

use mlx_rs::{
    ops::{self, indexing::IndexOp},
    transforms::{async_eval, eval},
    Array, Dtype,
};

use std::rc::Rc;

use super::request::{GenerateError, TokenInfo};
use super::sequence::{Lookahead, Sequence};
use super::speculative::Verify;
use crate::model::{LoadedModel, RowInput};
use crate::plugin::session::Chosen;
use crate::plugin::PluginError;

/// At debug level (`MLXHOST_LOG=mlxhost::engine=debug`), the primitives of
/// the 20th step's forward by kind (`census`), to set beside `mlxhost
/// bench`'s `decode_step_primitives` (the step's reads add ~16 more). Once
/// per process.
fn log_census_once(arrays: &[&Array]) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    static FORWARDS: AtomicUsize = AtomicUsize::new(0);
    if !tracing::enabled!(tracing::Level::DEBUG) || FORWARDS.fetch_add(1, Ordering::Relaxed) != 20 {
        return;
    }
    match crate::census::graph_census(arrays) {
        Ok(c) => tracing::debug!(total = c.total, by_kind = ?c.by_kind, "step census"),
        Err(e) => tracing::debug!(error = %e, "step census failed"),
    }
}

/// What a step did for one row.
pub(crate) enum RowOutcome {
    /// The row was not part of this step (no budget left for its prefill).
    Idle,
    /// Prompt tokens were fed; no token was chosen yet.
    Fed,
    /// The row's logits are ready but its chain waits for the next step
    /// (this step's plugin bound was used up by other rows).
    Deferred,
    /// A token was chosen: its raw-distribution info, and its
    /// log-probability under the distribution the sampler drew from.
    Token(TokenInfo, f32),
    /// This row failed (its plugin trapped, missed its deadline, returned a
    /// bad token...); the other rows are unaffected.
    Failed(GenerateError),
}

/// Where one step's time went.
#[derive(Debug, Clone, Copy, Default)]
pub struct StepTiming {
    /// Building the forward's graph and handing its logits to MLX's
    /// evaluation (on a GPU that launches the kernels).
    pub forward: Duration,
    /// Of `forward`, building the graph alone (before the hand-off).
    pub forward_build: Duration,
    /// Inside the rows' plugin chains (graph building, read-backs).
    pub plugins: Duration,
    /// The step's evaluation and reading its results back.
    pub eval: Duration,
    /// Whether the step started the next one before reading its tokens
    /// (decode lookahead).
    pub lookahead: bool,
}

/// Runs one step. `take[i]` is how many of sequence `i`'s unfed tokens to
/// feed (0: the row sits this step out); rows whose token is already in
/// flight from the previous call's lookahead feed nothing and read it.
/// `lookahead`: start the next step before reading this one where every row
/// allows it (see the module doc). `plugin_step` bounds the plugin chains
/// while rows share the step (`--plugin-step-ms`): each call's deadline is
/// capped at it, and rows whose chain has not started once the chains have
/// taken it are deferred to the next step (chains run fastest first, the
/// longest-deferred row before all). Returns one outcome per sequence.
///
/// Errors (the whole step failed, so every row in it fails): an MLX error
/// while building or evaluating the forward.
pub(crate) fn run(
    model: &LoadedModel,
    seqs: &mut [Sequence<'_>],
    take: &[usize],
    lookahead: bool,
    plugin_step: Duration,
) -> Result<(Vec<RowOutcome>, StepTiming), GenerateError> {
    let mut timing = StepTiming::default();
    let started = Instant::now();
    let vocab = model.model.config().vocab_size;
    // Rows in the forward, in order: (sequence index, tokens fed, wants logits).
    let mut members: Vec<(usize, usize, bool)> = Vec::new();
    // A row with drafts feeds its unfed token(s) and then its drafts.
    let feeds: Vec<Option<Vec<u32>>> = seqs
        .iter()
        .enumerate()
        .map(|(i, seq)| {
            let n = take[i].min(seq.ids.len() - seq.fed);
            (n > 0 && seq.fed + n == seq.ids.len() && !seq.drafts.is_empty()).then(|| {
                let mut feed = seq.ids[seq.fed..].to_vec();
                feed.extend_from_slice(&seq.drafts);
                feed
            })
        })
        .collect();
    let logits = {
        let mut rows: Vec<RowInput<'_>> = Vec::new();
        for ((i, seq), feed) in seqs.iter_mut().enumerate().zip(&feeds) {
            let n = take[i].min(seq.ids.len() - seq.fed);
            if n == 0 {
                continue;
            }
            let completes = seq.fed + n == seq.ids.len();
            let tokens = match feed {
                Some(feed) => feed.as_slice(),
                None => &seq.ids[seq.fed..seq.fed + n],
            };
            rows.push(RowInput {
                tokens,
                cache: &mut seq.cache,
                logits_from: if completes { n - 1 } else { n },
                lora: seq.lora.as_deref(),
            });
            members.push((i, n, completes));
        }
        let verifies = |&(i, _, _): &(usize, usize, bool)| feeds[i].is_some();
        if rows.is_empty() {
            Vec::new()
        } else if model.model.fast_one_token_path()
            && members.iter().any(verifies)
            && rows
                .iter()
                .zip(&members)
                .all(|(r, m)| r.tokens.len() == 1 || verifies(m))
            && rows.iter().any(|r| r.tokens.len() == 1)
        {
            forward_verifications_apart(model, rows)?
        } else {
            model.model.forward(&mut rows)?
        }
    };
    // Rows whose token the previous call's lookahead already chose.
    let in_flight: Vec<(usize, Lookahead)> = seqs
        .iter_mut()
        .enumerate()
        .filter_map(|(i, s)| s.lookahead.take().map(|l| (i, l)))
        .collect();
    // Rows whose logits an earlier step computed but whose chain it
    // deferred (the step's plugin bound ran out): their chains run first.
    let deferred: Vec<(usize, Array)> = seqs
        .iter_mut()
        .enumerate()
        .filter_map(|(i, s)| s.deferred.take().map(|l| (i, l)))
        .collect();
    if members.is_empty() && in_flight.is_empty() && deferred.is_empty() {
        return Ok((seqs.iter().map(|_| RowOutcome::Idle).collect(), timing));
    }
    for &(i, n, _) in &members {
        seqs[i].fed(n);
    }
    timing.forward_build = started.elapsed();
    let wanted: Vec<&Array> = logits.iter().filter(|l| l.shape()[0] > 0).collect();
    log_census_once(&wanted);
    async_eval(wanted)?;
    timing.forward = started.elapsed();

    let mut outcomes: Vec<RowOutcome> = seqs.iter().map(|_| RowOutcome::Idle).collect();
    // Rows whose chain produced a token this step.
    let mut chosen: Vec<Chose> = Vec::new();
    let plugins_started = Instant::now();
    // Rows choosing a token this step, in the order their chains run.
    let mut choosing: Vec<(usize, Array)> = deferred;
    for (&(i, _, completes), row_logits) in members.iter().zip(&logits) {
        if completes {
            choosing.push((i, row_logits.index(0)));
            let seq = &mut seqs[i];
            if feeds[i].is_some() {
                seq.verify = Some(Verify {
                    drafts: std::mem::take(&mut seq.drafts),
                    logits: row_logits.clone(),
                    next: 1,
                    accepted: 0,
                    matched: true,
                });
            }
        } else {
            outcomes[i] = RowOutcome::Fed;
        }
    }
    // While rows share the step (every row in the batch waits for it,
    // prefilling ones too), each chain's calls are capped at the bound and,
    // once the chains have used the bound (their own time, not time waiting
    // on the forward), the rest wait for the next step: the step never
    // waits on plugins much longer than twice the bound.
    let shared = seqs.len() > 1;
    // Progress for all: the row deferred longest runs first, then the rest
    // by how long their chain took last time (the fast first), so a slow
    // row defers itself, not the rows behind it.
    let longest_deferred = choosing
        .iter()
        .map(|(i, _)| *i)
        .filter(|&i| seqs[i].deferrals > 0)
        .max_by_key(|&i| (seqs[i].deferrals, std::cmp::Reverse(i)));
    choosing.sort_by_key(|(i, _)| (Some(*i) != longest_deferred, seqs[*i].last_chain_time));
    let mut plugin_time = Duration::ZERO;
    for (i, raw) in choosing {
        let seq = &mut seqs[i];
        if shared && plugin_time >= plugin_step {
            seq.deferred = Some(raw);
            seq.deferrals += 1;
            outcomes[i] = RowOutcome::Deferred;
            continue;
        }
        seq.deferrals = 0;
        seq.chain.set_step_cap(shared.then_some(plugin_step));
        let (started, waited) = (Instant::now(), seq.chain.host_wait());
        let result = choose(seq, raw.clone(), vocab, seq.generated as u32);
        seq.last_chain_time = started
            .elapsed()
            .saturating_sub(seq.chain.host_wait().saturating_sub(waited));
        plugin_time += seq.last_chain_time;
        match result {
            Ok((token, sampled)) => chosen.push(Chose {
                seq: i,
                raw,
                sampled,
                token,
            }),
            Err(e) => outcomes[i] = RowOutcome::Failed(e),
        }
    }
    timing.plugins = plugins_started.elapsed();

    let eval_started = Instant::now();
    let current = if chosen.is_empty() {
        None
    } else {
        let reads = Rc::new(build_reads(&chosen, seqs)?);
        if lookahead {
            // Queued before any lookahead, so reading them waits for this
            // step only. (Without one, the read below evaluates everything
            // in one call, which costs less on the CPU.)
            let mut arrays = reads.arrays();
            arrays.extend(members.iter().flat_map(|&(i, _, _)| seqs[i].cache.arrays()));
            async_eval(arrays)?;
        }
        Some(reads)
    };
    if lookahead {
        let lookahead_started = Instant::now();
        timing.lookahead = start_lookahead(
            model,
            seqs,
            &chosen,
            current.as_ref(),
            &in_flight,
            &outcomes,
        )?;
        // The lookahead's forward and chains are the next step's work done
        // early; they count as this step's forward.
        timing.forward += lookahead_started.elapsed();
    }

    if let Some(reads) = &current {
        let caches = members
            .iter()
            .flat_map(|&(i, _, _)| seqs[i].cache.arrays())
            .collect();
        let read = reads.read(caches)?;
        for (r, c) in chosen.iter().enumerate() {
            outcomes[c.seq] =
                token_outcome(&seqs[c.seq], read.row(r, seqs[c.seq].top_logprobs), vocab);
        }
    } else if !members.is_empty() {
        let caches: Vec<&Array> = members
            .iter()
            .flat_map(|&(i, _, _)| seqs[i].cache.arrays())
            .collect();
        eval(caches)?;
    }
    // Rows in flight: one read per lookahead step (all rows share one).
    let mut read_cache: Vec<(Rc<PendingReads>, ReadBack)> = Vec::new();
    for (i, ahead) in in_flight {
        outcomes[i] = match ahead {
            Lookahead::Failed(e) => RowOutcome::Failed(e),
            Lookahead::Row { reads, row } => {
                let at = match read_cache.iter().position(|(r, _)| Rc::ptr_eq(r, &reads)) {
                    Some(at) => at,
                    None => {
                        let back = reads.read(Vec::new())?;
                        read_cache.push((reads.clone(), back));
                        read_cache.len() - 1
                    }
                };
                let want = seqs[i].top_logprobs;
                token_outcome(&seqs[i], read_cache[at].1.row(row, want), vocab)
            }
        };
    }
    timing.eval = eval_started.elapsed();
    Ok((outcomes, timing))
}

/// The forward of a step whose rows are one-token decodes and speculative
/// verifications, on a model with a faster one-token path
/// ([`crate::model::CausalLm::fast_one_token_path`]): the one-token rows
/// through that path, the verifications (a token and its drafts each) as
/// a forward of their own, so drafting rows do not take every row of the
/// batch off the fast path. Returns the logits in `rows`' order.
///
/// Errors: MLX errors from either forward.
fn forward_verifications_apart(
    model: &LoadedModel,
    rows: Vec<RowInput<'_>>,
) -> Result<Vec<Array>, GenerateError> {
    let single: Vec<bool> = rows.iter().map(|r| r.tokens.len() == 1).collect();
    let (mut one, mut many): (Vec<RowInput<'_>>, Vec<RowInput<'_>>) =
        rows.into_iter().partition(|r| r.tokens.len() == 1);
    let mut one = model.model.forward(&mut one)?.into_iter();
    let mut many = model.model.forward(&mut many)?.into_iter();
    single
        .into_iter()
        .map(|s| if s { one.next() } else { many.next() })
        .collect::<Option<Vec<Array>>>()
        .ok_or_else(|| GenerateError::Internal("a forward returned too few rows".into()))
}

/// One verification round: for each row in `rows` (whose verification
/// [`continues`](Verify::continues): the token chosen last equalled its
/// draft), runs its chain on the next fed position's logits, then evaluates
/// and reads every row's token at once. Returns `(row, outcome)` pairs.
///
/// Errors (every row in the round fails): an MLX error while evaluating.
pub(crate) fn verify_round(
    model: &LoadedModel,
    seqs: &mut [Sequence<'_>],
    rows: &[usize],
    plugin_step: Duration,
) -> Result<Vec<(usize, RowOutcome)>, GenerateError> {
    let vocab = model.model.config().vocab_size;
    let shared = seqs.len() > 1;
    let mut out: Vec<(usize, RowOutcome)> = Vec::new();
    let mut chosen: Vec<Chose> = Vec::new();
    for &i in rows {
        let seq = &mut seqs[i];
        let Some(v) = seq.verify.as_mut() else {
            continue;
        };
        let raw = v.logits.index(v.next as i32);
        v.next += 1;
        seq.chain.set_step_cap(shared.then_some(plugin_step));
        match choose(seq, raw.clone(), vocab, seq.generated as u32) {
            Ok((token, sampled)) => chosen.push(Chose {
                seq: i,
                raw,
                sampled,
                token,
            }),
            Err(e) => out.push((i, RowOutcome::Failed(e))),
        }
    }
    if !chosen.is_empty() {
        let read = build_reads(&chosen, seqs)?.read(Vec::new())?;
        for (r, c) in chosen.iter().enumerate() {
            let want = seqs[c.seq].top_logprobs;
            out.push((c.seq, token_outcome(&seqs[c.seq], read.row(r, want), vocab)));
        }
    }
    Ok(out)
}

/// A chosen row's outcome: its token, or a failure when the chain returned
/// an id outside the vocabulary.
fn token_outcome(seq: &Sequence<'_>, read: RowRead, vocab: usize) -> RowOutcome {
    let (id, raw_lp, sampled_lp, top) = read;
    if id as usize >= vocab {
        return RowOutcome::Failed(
            PluginError::Failed {
                plugin: seq.chain.sampler_name().to_string(),
                cause: format!("returned token id {id}, outside the vocabulary (size {vocab})"),
            }
            .into(),
        );
    }
    RowOutcome::Token(
        TokenInfo {
            id,
            logprob: raw_lp,
            top,
        },
        sampled_lp,
    )
}

/// Builds and starts the next step for every row when all of them allow it:
/// each running row chose a token this call (its forward ran now, or its
/// chain ran on deferred logits) or reads one in flight from an earlier
/// lookahead, decodes, and has room for another token. The forward feeds
/// those tokens as device arrays. A row with a history-free chain also runs
/// its chain now ([`Sequence::lookahead`]); any other row (a grammar, a
/// penalty over the history) keeps the forward's logits as
/// [`Sequence::deferred`], and the next call runs its chain once this
/// step's token is taken, while the device computes the forward. Sets
/// `fed_ahead` on every row and returns true; does nothing otherwise
/// (false).
fn start_lookahead(
    model: &LoadedModel,
    seqs: &mut [Sequence<'_>],
    chosen: &[Chose],
    current: Option<&Rc<PendingReads>>,
    in_flight: &[(usize, Lookahead)],
    outcomes: &[RowOutcome],
) -> Result<bool, GenerateError> {
    // Where each row's token comes from: (sequence index, source, row in
    // that source's results).
    let mut sources: Vec<&Rc<PendingReads>> = Vec::new();
    let mut picks: Vec<(usize, usize, usize)> = Vec::with_capacity(seqs.len());
    if let Some(reads) = current {
        sources.push(reads);
        picks.extend(chosen.iter().enumerate().map(|(r, c)| (c.seq, 0, r)));
    }
    for (i, ahead) in in_flight {
        let Lookahead::Row { reads, row } = ahead else {
            return Ok(false);
        };
        let source = match sources.iter().position(|s| Rc::ptr_eq(s, reads)) {
            Some(at) => at,
            None => {
                sources.push(reads);
                sources.len() - 1
            }
        };
        picks.push((*i, source, *row));
    }
    // Every running row, each once.
    let mut rows: Vec<usize> = picks.iter().map(|&(i, _, _)| i).collect();
    rows.sort_unstable();
    rows.dedup();
    if picks.is_empty() || rows.len() != picks.len() || rows.len() != seqs.len() {
        return Ok(false);
    }
    let allowed = picks.iter().all(|&(i, _, _)| {
        let s = &seqs[i];
        !matches!(outcomes[i], RowOutcome::Failed(_))
            && !s.fed_ahead
            && s.spec.is_none()
            && s.verify.is_none()
            && s.deferred.is_none()
            && s.generated + 1 < s.max_new
    });
    // `MLXHOST_LOOKAHEAD_DEFER=off`: a row whose chain needs this step's
    // token keeps the whole batch out of the lookahead (the policy before
    // deferred chains; for measuring one against the other).
    let defers = picks.iter().any(|&(i, _, _)| !seqs[i].chain.history_free());
    if !allowed || (defers && !deferring_allowed()) {
        return Ok(false);
    }
    let vocab = model.model.config().vocab_size;
    // The forward's rows go source by source, each source's rows in order.
    picks.sort_unstable_by_key(|&(_, source, row)| (source, row));
    let mut parts: Vec<Array> = Vec::with_capacity(sources.len());
    for (s, source) in sources.iter().enumerate() {
        let at: Vec<i32> = picks
            .iter()
            .filter(|p| p.1 == s)
            .map(|p| p.2 as i32)
            .collect();
        let whole = at.iter().enumerate().all(|(k, &r)| k as i32 == r)
            && at.len() == source.tokens.shape()[0] as usize;
        parts.push(if whole {
            source.tokens.clone()
        } else {
            source
                .tokens
                .take_axis(Array::from_slice(&at, &[at.len() as i32]), 0)?
        });
    }
    let mut ids = match parts.len() {
        1 => parts.swap_remove(0),
        _ => ops::concatenate(&parts, 0)?,
    };
    // Rows go to the forward in sequence order, whatever order their tokens
    // were chosen in (deferred chains run fastest first, so that order
    // changes from step to step): the decode slab keeps its slots only while
    // the same rows come in the same order, and a new order rebuilds it,
    // copying every row's KV (the likely cause of constrained batch-16
    // steps of the Qwen3-8B shape taking 2.7x a free one on an H100;
    // docs/benchmarks.md, fourth run).
    if picks.windows(2).any(|w| w[0].0 > w[1].0) {
        let mut order: Vec<usize> = (0..picks.len()).collect();
        order.sort_unstable_by_key(|&k| picks[k].0);
        let at: Vec<i32> = order.iter().map(|&k| k as i32).collect();
        ids = ids.take_axis(Array::from_slice(&at, &[at.len() as i32]), 0)?;
        picks = order.iter().map(|&k| picks[k]).collect();
    }
    // This step's tokens as the next forward's ids, clamped into the
    // vocabulary: a bad id fails its row when read, and must not index
    // outside the embedding meanwhile.
    let ids = ops::minimum(
        &ids,
        Array::from_int((vocab - 1) as i32).as_dtype(Dtype::Uint32)?,
    )?;
    static ONE_TOKEN: [u32; 1] = [0];
    let logits = {
        // Rows go to the forward in `picks` order (the ids' order).
        let mut by_index: Vec<Option<&mut Sequence<'_>>> = seqs.iter_mut().map(Some).collect();
        let mut rows: Vec<RowInput<'_>> = Vec::with_capacity(picks.len());
        for &(i, _, _) in &picks {
            let Some(seq) = by_index[i].take() else {
                return Ok(false);
            };
            rows.push(RowInput {
                tokens: &ONE_TOKEN,
                cache: &mut seq.cache,
                logits_from: 0,
                lora: seq.lora.as_deref(),
            });
        }
        model.model.forward_device_ids(&mut rows, &ids)?
    };
    let mut next: Vec<Chose> = Vec::with_capacity(picks.len());
    let mut failed: Vec<(usize, GenerateError)> = Vec::new();
    // Logits whose chains wait for the next call: evaluated now all the same.
    let mut waiting: Vec<Array> = Vec::new();
    for (&(i, _, _), row_logits) in picks.iter().zip(&logits) {
        let seq = &mut seqs[i];
        seq.fed_ahead = true;
        let raw = row_logits.index(0);
        if !seq.chain.history_free() {
            waiting.push(raw.clone());
            seq.deferred = Some(raw);
            continue;
        }
        // The token being read now is number `generated`; this one follows.
        match choose(seq, raw.clone(), vocab, seq.generated as u32 + 1) {
            Ok((token, sampled)) => next.push(Chose {
                seq: i,
                raw,
                sampled,
                token,
            }),
            Err(e) => failed.push((i, e)),
        }
    }
    let reads = if next.is_empty() {
        None
    } else {
        Some(Rc::new(build_reads(&next, seqs)?))
    };
    let mut arrays: Vec<&Array> = reads.as_ref().map(|r| r.arrays()).unwrap_or_default();
    arrays.extend(waiting.iter());
    arrays.extend(picks.iter().flat_map(|&(i, _, _)| seqs[i].cache.arrays()));
    async_eval(arrays)?;
    if let Some(reads) = reads {
        for (row, c) in next.iter().enumerate() {
            seqs[c.seq].lookahead = Some(Lookahead::Row {
                reads: reads.clone(),
                row,
            });
        }
    }
    for (i, e) in failed {
        seqs[i].lookahead = Some(Lookahead::Failed(e));
    }
    Ok(true)
}

/// Whether a lookahead may defer a row's chain to the next call (see
/// [`start_lookahead`]); `MLXHOST_LOOKAHEAD_DEFER=off` says no.
fn deferring_allowed() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MLXHOST_LOOKAHEAD_DEFER").as_deref() != Ok("off"))
}

/// One row's choice before evaluation.
struct Chose {
    seq: usize,
    /// The row's raw logits `[V]`.
    raw: Array,
    /// The logits the token was drawn from `[V]` (after every processor).
    sampled: Array,
    /// The chosen id, `[1]` uint32.
    token: Array,
}

/// Runs the row's chain; checks the shapes it returned so a bad plugin
/// fails its own row, not the batched evaluation.
fn choose(
    seq: &mut Sequence<'_>,
    raw: Array,
    vocab: usize,
    step: u32,
) -> Result<(Array, Array), GenerateError> {
    let out = seq.chain.step(raw, &seq.ids, seq.prompt_len, step)?;
    let name = || seq.chain.sampler_name().to_string();
    let token = match out.token {
        Chosen::Device(a) => {
            if a.size() != 1 {
                return Err(PluginError::Failed {
                    plugin: name(),
                    cause: format!("returned a token array of shape {:?}", a.shape()),
                }
                .into());
            }
            a.as_dtype(Dtype::Uint32)?.reshape(&[1])?
        }
        Chosen::Host(id) => Array::from_slice(&[id], &[1]),
    };
    if out.final_logits.shape() != [vocab as i32] {
        return Err(PluginError::Failed {
            plugin: name(),
            cause: format!(
                "left logits of shape {:?} (expected [{vocab}])",
                out.final_logits.shape()
            ),
        }
        .into());
    }
    Ok((token, out.final_logits.as_dtype(Dtype::Float32)?))
}

/// What one chosen row read back: `(id, raw logprob, sampled logprob, top
/// alternatives)`.
type RowRead = (u32, f32, f32, Vec<(u32, f32)>);

/// One step's results for its chosen rows, built lazily (tokens, both
/// log-probabilities, the top alternatives), read back with
/// [`PendingReads::read`].
pub(crate) struct PendingReads {
    /// Chosen ids `[R]` uint32, in row order.
    tokens: Array,
    /// Each row's token's log-probability under the raw logits `[R]`.
    raw_at: Array,
    /// ... and under the logits it was drawn from `[R]`.
    sampled_at: Array,
    /// The top `k` alternatives `([R, k] ids, [R, k] logprobs)`, `k` the
    /// most any row asked for; `None` when none did.
    top: Option<(Array, Array)>,
    k: usize,
    vocab: usize,
}

impl PendingReads {
    /// The arrays to evaluate.
    fn arrays(&self) -> Vec<&Array> {
        let mut out = vec![&self.tokens, &self.raw_at, &self.sampled_at];
        if let Some((i, v)) = &self.top {
            out.extend([i, v]);
        }
        out
    }

    /// Evaluates the results and `with` (the step's KV buffers) in one
    /// call (waits for the step) and copies the results to the host.
    fn read(&self, with: Vec<&Array>) -> Result<ReadBack, GenerateError> {
        let mut arrays = self.arrays();
        arrays.extend(with);
        eval(arrays)?;
        let read_err = |what: &str, e: mlx_rs::error::AsSliceError| {
            GenerateError::Internal(format!("reading the step's {what}: {e}"))
        };
        let slice_u32 = |a: &Array, what: &str| -> Result<Vec<u32>, GenerateError> {
            Ok(a.try_as_slice::<u32>()
                .map_err(|e| read_err(what, e))?
                .to_vec())
        };
        let slice_f32 = |a: &Array, what: &str| -> Result<Vec<f32>, GenerateError> {
            Ok(a.try_as_slice::<f32>()
                .map_err(|e| read_err(what, e))?
                .to_vec())
        };
        let (top_ids, top_vals) = match &self.top {
            Some((i, v)) => (slice_u32(i, "top logprobs")?, slice_f32(v, "top logprobs")?),
            None => (Vec::new(), Vec::new()),
        };
        Ok(ReadBack {
            ids: slice_u32(&self.tokens, "tokens")?,
            raw: slice_f32(&self.raw_at, "logprobs")?,
            sampled: slice_f32(&self.sampled_at, "logprobs")?,
            top_ids,
            top_vals,
            k: self.k,
            vocab: self.vocab,
        })
    }
}

/// [`PendingReads`] on the host.
struct ReadBack {
    ids: Vec<u32>,
    raw: Vec<f32>,
    sampled: Vec<f32>,
    top_ids: Vec<u32>,
    top_vals: Vec<f32>,
    k: usize,
    vocab: usize,
}

impl ReadBack {
    /// Row `r`'s results, with its `top_logprobs` best alternatives.
    fn row(&self, r: usize, top_logprobs: usize) -> RowRead {
        let want = top_logprobs.min(self.vocab);
        let k = self.k;
        let top = if want > 0 && k > 0 {
            let mut pairs = crate::logprobs::sorted_pairs(
                &self.top_ids[r * k..(r + 1) * k],
                &self.top_vals[r * k..(r + 1) * k],
            );
            pairs.truncate(want);
            pairs
        } else {
            Vec::new()
        };
        (self.ids[r], self.raw[r], self.sampled[r], top)
    }
}

/// Builds the lazy results of every chosen row (one batched op each, not
/// one per row).
fn build_reads(chosen: &[Chose], seqs: &[Sequence<'_>]) -> Result<PendingReads, GenerateError> {
    // One row (a GPU's batch-1 decode, bound by kernel launches) takes
    // views, not the copies `stack` and `concatenate` make.
    let stack = |arrays: Vec<&Array>| -> Result<Array, GenerateError> {
        Ok(match arrays.as_slice() {
            [one] => one.expand_dims(0)?,
            _ => ops::stack(&arrays, 0)?,
        })
    };
    let tokens = match chosen {
        [one] => one.token.clone(),
        _ => ops::concatenate(&chosen.iter().map(|c| &c.token).collect::<Vec<_>>(), 0)?,
    };
    let at = tokens.reshape(&[-1, 1])?;
    // log_softmax(x)[i] = x[i] - logsumexp(x): only the picked entries are
    // formed, not two [R, V] log-softmax arrays (a full pass each per step).
    let raw = stack(chosen.iter().map(|c| &c.raw).collect())?;
    let raw_lse = crate::logprobs::logsumexp_rows(&raw)?;
    let sampled = stack(chosen.iter().map(|c| &c.sampled).collect())?;
    let log_prob_at = |logits: &Array, lse: &Array| -> Result<Array, GenerateError> {
        Ok(ops::subtract(&logits.take_along_axis(&at, -1)?, lse)?.reshape(&[-1])?)
    };
    let raw_at = log_prob_at(&raw, &raw_lse)?;
    let sampled_at = log_prob_at(&sampled, &crate::logprobs::logsumexp_rows(&sampled)?)?;
    let vocab = raw.shape()[1] as usize;
    let k = chosen
        .iter()
        .map(|c| seqs[c.seq].top_logprobs.min(vocab))
        .max()
        .unwrap_or(0);
    let top = if k > 0 {
        // The same ids as on the log-softmax (a per-row shift keeps the order).
        let (ids, values) = crate::logprobs::top_k(&raw, k as i32)?;
        Some((ids, ops::subtract(&values, &raw_lse)?))
    } else {
        None
    };
    Ok(PendingReads {
        tokens,
        raw_at,
        sampled_at,
        top,
        k,
        vocab,
    })
}
