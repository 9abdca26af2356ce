//! One engine step over the running batch: one forward for every row that
//! has tokens to feed (prompt chunks beside single decode tokens), each row's
//! plugin chain on its own logits, then one evaluation of every row's token,
//! log-probabilities and alternatives.
//!
//! The forward is started with `async_eval` before the plugin chains run, so
//! their graph building overlaps the model's compute (as mlx-lm's generate
//! loop overlaps step N+1's graph with step N's compute); a plugin that
//! reads back waits for the forward inside its own call.

use std::time::{Duration, Instant};

use mlx_rs::{
    ops::{self, indexing::IndexOp},
    transforms::{async_eval, eval},
    Array, Dtype,
};

use super::request::{GenerateError, TokenInfo};
use super::sequence::Sequence;
use crate::model::{LoadedModel, RowInput};
use crate::plugin::session::Chosen;
use crate::plugin::PluginError;

/// What a step did for one row.
pub(crate) enum RowOutcome {
    /// The row was not part of this step (no budget left for its prefill).
    Idle,
    /// Prompt tokens were fed; no token was chosen yet.
    Fed,
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
    /// Building the forward's graph.
    pub forward: Duration,
    /// Inside the rows' plugin chains (graph building, read-backs).
    pub plugins: Duration,
    /// The step's evaluation and reading its results back.
    pub eval: Duration,
}

/// Runs one step. `take[i]` is how many of sequence `i`'s unfed tokens to
/// feed (0: the row sits this step out). Returns one outcome per sequence.
///
/// Errors (the whole step failed, so every row in it fails): an MLX error
/// while building or evaluating the forward.
pub(crate) fn run(
    model: &LoadedModel,
    seqs: &mut [Sequence<'_>],
    take: &[usize],
) -> Result<(Vec<RowOutcome>, StepTiming), GenerateError> {
    let mut timing = StepTiming::default();
    let started = Instant::now();
    let vocab = model.model.config().vocab_size;
    // Rows in the forward, in order: (sequence index, tokens fed, wants logits).
    let mut members: Vec<(usize, usize, bool)> = Vec::new();
    let logits = {
        let mut rows: Vec<RowInput<'_>> = Vec::new();
        for (i, seq) in seqs.iter_mut().enumerate() {
            let n = take[i].min(seq.ids.len() - seq.fed);
            if n == 0 {
                continue;
            }
            let completes = seq.fed + n == seq.ids.len();
            let tokens = &seq.ids[seq.fed..seq.fed + n];
            rows.push(RowInput {
                tokens,
                cache: &mut seq.cache,
                logits_from: if completes { n - 1 } else { n },
            });
            members.push((i, n, completes));
        }
        if rows.is_empty() {
            return Ok((seqs.iter().map(|_| RowOutcome::Idle).collect(), timing));
        }
        model.model.forward(&mut rows)?
    };
    for &(i, n, _) in &members {
        seqs[i].fed(n);
    }
    let wanted: Vec<&Array> = logits.iter().filter(|l| l.shape()[0] > 0).collect();
    async_eval(wanted)?;
    timing.forward = started.elapsed();

    let mut outcomes: Vec<RowOutcome> = seqs.iter().map(|_| RowOutcome::Idle).collect();
    // Rows whose chain produced a token this step.
    let mut chosen: Vec<Chose> = Vec::new();
    let plugins_started = Instant::now();
    for (&(i, _, completes), row_logits) in members.iter().zip(&logits) {
        if !completes {
            outcomes[i] = RowOutcome::Fed;
            continue;
        }
        let seq = &mut seqs[i];
        let raw = row_logits.index(0);
        match choose(seq, raw.clone(), vocab) {
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
    if !chosen.is_empty() {
        let read = evaluate(&chosen, seqs, &members)?;
        for (c, (id, raw_lp, sampled_lp, top)) in chosen.iter().zip(read) {
            outcomes[c.seq] = if id as usize >= vocab {
                RowOutcome::Failed(
                    PluginError::Failed {
                        plugin: seqs[c.seq].chain.sampler_name().to_string(),
                        cause: format!(
                            "returned token id {id}, outside the vocabulary (size {vocab})"
                        ),
                    }
                    .into(),
                )
            } else {
                RowOutcome::Token(
                    TokenInfo {
                        id,
                        logprob: raw_lp,
                        top,
                    },
                    sampled_lp,
                )
            };
        }
    } else {
        let caches: Vec<&Array> = members
            .iter()
            .flat_map(|&(i, _, _)| seqs[i].cache.arrays())
            .collect();
        eval(caches)?;
    }
    timing.eval = eval_started.elapsed();
    Ok((outcomes, timing))
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
) -> Result<(Array, Array), GenerateError> {
    let out = seq
        .chain
        .step(raw, &seq.ids, seq.prompt_len, seq.generated as u32)?;
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

/// One evaluation for every chosen row (tokens, both log-probabilities,
/// the top alternatives) plus every fed row's cache, then one read-back of
/// each result. Returns per chosen row `(id, raw logprob, sampled logprob,
/// top alternatives)`.
fn evaluate(
    chosen: &[Chose],
    seqs: &[Sequence<'_>],
    members: &[(usize, usize, bool)],
) -> Result<Vec<RowRead>, GenerateError> {
    let stack =
        |arrays: Vec<&Array>| -> Result<Array, GenerateError> { Ok(ops::stack(&arrays, 0)?) };
    let tokens = ops::concatenate(&chosen.iter().map(|c| &c.token).collect::<Vec<_>>(), 0)?;
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
    let mut to_eval = vec![&tokens, &raw_at, &sampled_at];
    if let Some((i, v)) = &top {
        to_eval.extend([i, v]);
    }
    to_eval.extend(members.iter().flat_map(|&(i, _, _)| seqs[i].cache.arrays()));
    eval(to_eval)?;
    let read_err = |what: &str, e: mlx_rs::error::AsSliceError| {
        GenerateError::Internal(format!("reading the step's {what}: {e}"))
    };
    let ids = tokens
        .try_as_slice::<u32>()
        .map_err(|e| read_err("tokens", e))?;
    let raw = raw_at
        .try_as_slice::<f32>()
        .map_err(|e| read_err("logprobs", e))?;
    let sampled = sampled_at
        .try_as_slice::<f32>()
        .map_err(|e| read_err("logprobs", e))?;
    let (top_ids, top_vals) = match &top {
        Some((i, v)) => (
            i.try_as_slice::<u32>()
                .map_err(|e| read_err("top logprobs", e))?,
            v.try_as_slice::<f32>()
                .map_err(|e| read_err("top logprobs", e))?,
        ),
        None => (&[][..], &[][..]),
    };
    Ok(chosen
        .iter()
        .enumerate()
        .map(|(r, c)| {
            let want = seqs[c.seq].top_logprobs.min(vocab);
            let top = if want > 0 {
                let mut pairs = crate::logprobs::sorted_pairs(
                    &top_ids[r * k..(r + 1) * k],
                    &top_vals[r * k..(r + 1) * k],
                );
                pairs.truncate(want);
                pairs
            } else {
                Vec::new()
            };
            (ids[r], raw[r], sampled[r], top)
        })
        .collect())
}
