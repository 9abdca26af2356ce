//! The draft-model drafter (`--draft-model`): a second, smaller model that
//! shares the target's tokenizer proposes each row's drafts by greedy
//! decoding, host-native (it is a forward, not a plugin).
//!
//! Every row that drafts with it in a step drafts together
//! ([`draft_batch`]): one ragged forward catches every row's draft cache
//! up with its history (the tokens it accepted, the target's token after
//! them, and, for a row that skipped drafting for a while, everything it
//! missed), then up to `k - 1` one-token forwards of all rows still
//! drafting, each row's greedy token fed back as its next input.
//!
//! Each row has its own draft KV cache ([`DraftRow`]) that follows the row:
//! the cache remembers which tokens it holds, and before drafting it is
//! trimmed to the longest prefix those share with the row's history (so
//! accepted drafts stay, rejected ones go) and fed the rest. A preempted
//! row drops it ([`DraftRow::reset`]) and re-prefills it when it drafts
//! again; a row that leaves frees it with itself.
//!
//! The draft KV of a row is bounded by the row's own history (it never
//! holds more positions than the row has tokens, plus the `k - 1` drafts
//! fed while drafting), and the scheduler counts it in the row's memory
//! reservation (`engine::scheduler`, `draft_kv_bytes`).

use std::time::{Duration, Instant};

use mlx_rs::{ops, transforms::eval, Array, Dtype};

use super::speculative::Drafter;
use crate::cache::KvCache;
use crate::model::{LoadedModel, ModelError, RowInput};

/// The drafter name a request (or `--drafter`) uses for the draft model.
pub const DRAFTER_NAME: &str = "draft-model";

/// Most history tokens of one row fed to the draft model in one forward
/// while catching up (bounds the attention scores of a long prompt,
/// as the target's prefill chunk does).
const CATCH_UP_CHUNK: usize = 512;

/// The most tokens a row that drafted last step catches up with: the
/// target's token after a rejection, or the last draft and the bonus token
/// after a fully accepted draft (the last draft is never fed while
/// drafting). More means the row skipped steps or drafts for the first
/// time.
const STEADY_CATCH_UP: usize = 2;

/// A draft model that cannot draft for the target.
#[derive(Debug, thiserror::Error)]
pub enum DraftModelError {
    /// The two tokenizers give some id of their shared range different
    /// tokens.
    #[error(
        "--draft-model {draft}: its vocabulary differs from the target's: token id {id} is {draft_token:?} in the draft model and {target_token:?} in the target ({target}); the draft model must share the target's tokenizer"
    )]
    VocabMismatch {
        /// The draft model's path.
        draft: String,
        /// The target's path.
        target: String,
        /// The first id that differs.
        id: u32,
        /// Its token in the draft's vocabulary (`None`: no such id).
        draft_token: Option<String>,
        /// Its token in the target's.
        target_token: Option<String>,
    },
    /// Its cache cannot drop positions (recurrent layers): rejected drafts
    /// could not be trimmed.
    #[error(
        "--draft-model {0}: its architecture keeps a recurrent state that cannot drop rejected drafts; use a transformer-only model"
    )]
    NotTrimmable(String),
}

/// Checks that `draft` can draft for `target`: the same token for every id
/// both tokenizers have (the draft's ids are fed to the target as they
/// are), and a KV cache that can drop positions.
///
/// Errors: [`DraftModelError::VocabMismatch`] naming the first id that
/// differs; [`DraftModelError::NotTrimmable`].
pub fn check_compatible(target: &LoadedModel, draft: &LoadedModel) -> Result<(), DraftModelError> {
    let shared = target
        .tokenizer
        .vocab_size()
        .min(draft.tokenizer.vocab_size());
    let mismatch = |id: u32, d: Option<String>, t: Option<String>| DraftModelError::VocabMismatch {
        draft: draft.path.display().to_string(),
        target: target.path.display().to_string(),
        id,
        draft_token: d,
        target_token: t,
    };
    if shared == 0 {
        return Err(mismatch(0, None, None));
    }
    for id in 0..shared as u32 {
        let (t, d) = (
            target.tokenizer.id_to_token(id),
            draft.tokenizer.id_to_token(id),
        );
        if t != d {
            return Err(mismatch(id, d, t));
        }
    }
    if !draft.model.new_cache().trimmable() {
        return Err(DraftModelError::NotTrimmable(
            draft.path.display().to_string(),
        ));
    }
    Ok(())
}

/// Makes `draft` the target's draft model after [`check_compatible`].
///
/// Errors: as [`check_compatible`].
pub fn attach(target: &mut LoadedModel, draft: LoadedModel) -> Result<(), DraftModelError> {
    check_compatible(target, &draft)?;
    tracing::info!(
        draft = %draft.path.display(),
        layers = draft.model.config().num_hidden_layers,
        "draft model loaded (the `draft-model` drafter)"
    );
    target.draft = Some(Box::new(draft));
    Ok(())
}

/// One row's draft state: its draft KV cache and the tokens it holds.
#[derive(Default)]
pub struct DraftRow {
    /// `None` until the row first drafts, and after [`DraftRow::reset`].
    cache: Option<KvCache>,
    /// The tokens whose KV `cache` holds, in order (its `offset()` of
    /// them).
    held: Vec<u32>,
    /// This row's share of the batched draft forwards' time.
    time: Duration,
}

impl DraftRow {
    /// Drops the draft KV (a preempted row gives its memory back); the
    /// next draft re-feeds the whole history.
    pub fn reset(&mut self) {
        self.cache = None;
        self.held.clear();
    }

    /// Positions the draft cache holds.
    pub fn positions(&self) -> usize {
        self.cache.as_ref().map_or(0, KvCache::offset)
    }

    /// Trims the cache to the longest prefix of `history` it holds, at
    /// least one token short of `history` (the last token is fed to get
    /// the next token's logits), creating it from `draft` when the row has
    /// none. Returns the tokens left to feed.
    fn align<'h>(&mut self, draft: &LoadedModel, history: &'h [u32]) -> &'h [u32] {
        let cache = self.cache.get_or_insert_with(|| draft.model.new_cache());
        let shared = crate::cache::common_prefix(&self.held, history)
            .min(history.len().saturating_sub(1))
            .min(cache.offset());
        if shared < cache.offset() {
            cache.truncate(shared);
        }
        // A truncation the cache cannot do exactly empties it.
        self.held.truncate(cache.offset());
        &history[self.held.len()..]
    }
}

/// A row's draft-model drafter, as its [`super::speculative::RowSpec`]
/// holds it: the row's [`DraftRow`]. The scheduler drafts every such row
/// together ([`draft_batch`]); [`Drafter::draft`] alone is not used.
pub struct DraftModelDrafter {
    /// The row's draft cache.
    pub row: DraftRow,
}

impl Drafter for DraftModelDrafter {
    fn draft(&mut self, _: &[u32], _: usize) -> Result<Vec<u32>, String> {
        Err("the draft model drafts its rows together (engine::draft_model::draft_batch)".into())
    }
    fn name(&self) -> &str {
        DRAFTER_NAME
    }
    fn time(&self) -> Duration {
        self.row.time
    }
    fn draft_row(&mut self) -> Option<&mut DraftRow> {
        Some(&mut self.row)
    }
}

/// One row's request to [`draft_batch`].
pub struct DraftAsk<'a> {
    /// The row's history (prompt and accepted tokens, the last one not
    /// yet verified).
    pub history: &'a [u32],
    /// The row's draft cache.
    pub row: &'a mut DraftRow,
    /// Tokens to draft (at least 1).
    pub k: usize,
}

/// What [`draft_batch`] did.
#[derive(Debug, Clone, Default)]
pub struct DraftBatch {
    /// Per row, its drafts (at most its `k`; shorter where the draft
    /// model proposed an id outside the target's vocabulary).
    pub drafts: Vec<Vec<u32>>,
    /// Wall time of the draft forwards and reads.
    pub took: Duration,
    /// Per row, whether it caught up with more than a step's tokens (a
    /// first draft prefills the prompt): its share of `took` then says
    /// nothing about steady drafting.
    pub long: Vec<bool>,
}

/// Drafts for every row in `asks` with `draft`, greedily, as one batch
/// (see the module doc). Ids `>= target_vocab` end a row's drafts.
///
/// Errors: an MLX error in a draft forward (the caller drops the rows'
/// draft-model drafters; their rows decode without drafts).
pub fn draft_batch(
    draft: &LoadedModel,
    target_vocab: usize,
    asks: &mut [DraftAsk<'_>],
) -> Result<DraftBatch, ModelError> {
    let started = Instant::now();
    let mut out = DraftBatch {
        drafts: vec![Vec::new(); asks.len()],
        ..Default::default()
    };
    let max_k = asks.iter().map(|a| a.k).max().unwrap_or(0);
    // What each row still feeds to catch up (at least its last token).
    let mut pending: Vec<&[u32]> = asks
        .iter_mut()
        .map(|a| a.row.align(draft, a.history))
        .collect();
    out.long = pending.iter().map(|p| p.len() > STEADY_CATCH_UP).collect();
    // Each row's latest greedy token `[1]` (lazy), once its catch-up ends.
    let mut next: Vec<Option<Array>> = vec![None; asks.len()];
    while pending.iter().any(|p| !p.is_empty()) {
        let mut members = Vec::new();
        let mut rows: Vec<RowInput<'_>> = Vec::new();
        for (r, (ask, feed)) in asks.iter_mut().zip(&mut pending).enumerate() {
            if feed.is_empty() {
                continue;
            }
            let n = feed.len().min(CATCH_UP_CHUNK);
            let (now, rest) = feed.split_at(n);
            *feed = rest;
            let Some(cache) = ask.row.cache.as_mut() else {
                continue;
            };
            ask.row.held.extend_from_slice(now);
            rows.push(RowInput {
                tokens: now,
                cache,
                logits_from: if rest.is_empty() { n - 1 } else { n },
                lora: None,
            });
            members.push((r, rest.is_empty()));
        }
        let logits = draft.model.forward(&mut rows)?;
        drop(rows);
        let mut wanted: Vec<Array> = Vec::new();
        for ((r, done), l) in members.iter().zip(logits) {
            if *done {
                let t = greedy(&l)?;
                wanted.push(t.clone());
                next[*r] = Some(t);
            }
        }
        let caches = members
            .iter()
            .flat_map(|&(r, _)| asks[r].row.cache.iter().flat_map(KvCache::arrays));
        eval(wanted.iter().chain(caches))?;
    }
    // Autoregressive steps: every row still drafting feeds its last token.
    let mut live: Vec<usize> = (0..asks.len()).collect();
    for step in 0..max_k {
        let tokens = read_tokens(&live, &next)?;
        let mut still = Vec::new();
        for (&r, t) in live.iter().zip(tokens) {
            if (t as usize) >= target_vocab {
                continue;
            }
            out.drafts[r].push(t);
            if out.drafts[r].len() < asks[r].k {
                still.push(r);
            }
        }
        live = still;
        if live.is_empty() || step + 1 == max_k {
            break;
        }
        let fed: Vec<[u32; 1]> = live
            .iter()
            .map(|&r| [out.drafts[r].last().copied().unwrap_or(0)])
            .collect();
        let mut by_row: Vec<Option<&mut DraftAsk<'_>>> = asks.iter_mut().map(Some).collect();
        let mut rows: Vec<RowInput<'_>> = Vec::with_capacity(live.len());
        for (&r, tok) in live.iter().zip(&fed) {
            let Some(ask) = by_row[r].take() else {
                continue;
            };
            let Some(cache) = ask.row.cache.as_mut() else {
                continue;
            };
            ask.row.held.push(tok[0]);
            rows.push(RowInput {
                tokens: tok,
                cache,
                logits_from: 0,
                lora: None,
            });
        }
        let logits = draft.model.forward(&mut rows)?;
        drop(rows);
        for (&r, l) in live.iter().zip(logits) {
            next[r] = Some(greedy(&l)?);
        }
        let caches = live
            .iter()
            .flat_map(|&r| asks[r].row.cache.iter().flat_map(KvCache::arrays));
        let wanted: Vec<&Array> = live.iter().filter_map(|&r| next[r].as_ref()).collect();
        eval(wanted.into_iter().chain(caches))?;
    }
    out.took = started.elapsed();
    let share = out.took / asks.len().max(1) as u32;
    for a in asks.iter_mut() {
        a.row.time += share;
    }
    Ok(out)
}

/// The greedy token of logits `[1, V]`, `[1]` uint32 (lazy).
fn greedy(logits: &Array) -> Result<Array, ModelError> {
    Ok(ops::indexing::argmax_axis(logits, -1, None)?
        .as_dtype(Dtype::Uint32)?
        .reshape(&[1])?)
}

/// The host values of rows `live`'s latest greedy tokens (evaluated).
fn read_tokens(live: &[usize], next: &[Option<Array>]) -> Result<Vec<u32>, ModelError> {
    live.iter()
        .map(|&r| {
            let t = next[r].as_ref().ok_or_else(|| {
                ModelError::Mlx(mlx_rs::error::Exception::custom(
                    "a draft row ended its catch-up without logits",
                ))
            })?;
            t.try_item_exact::<u32>().map_err(|e| {
                ModelError::Mlx(mlx_rs::error::Exception::custom(format!(
                    "reading a draft token: {e}"
                )))
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reset_row_holds_nothing() {
        let mut row = DraftRow {
            cache: Some(KvCache::new(1)),
            held: vec![1, 2, 3],
            time: Duration::ZERO,
        };
        row.reset();
        assert_eq!(row.positions(), 0);
        assert!(row.held.is_empty() && row.cache.is_none());
    }
}
