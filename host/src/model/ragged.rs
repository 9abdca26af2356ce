//! The parts of a ragged-batch forward pass every architecture shares:
//! packing the rows' new tokens into one activation, splitting a packed
//! per-token tensor back into one row's heads, and running the output head
//! over only the positions whose logits were asked for.

use mlx_rs::{
    fast,
    ops::{self, indexing::IndexOp},
    Array,
};

use super::error::{ModelError, Result};
use super::llama::RowInput;

/// The rows' new tokens packed in row order.
pub struct Packed {
    /// Token ids `[N]` (uint32).
    pub ids: Array,
    /// Tokens per row.
    pub lens: Vec<usize>,
    /// Each token's position `[N]` (int32): its row's cache offset onward.
    pub positions: Array,
}

/// Packs the rows' tokens; `None` when no row has any.
///
/// Errors: [`ModelError::TokenOutOfRange`] for an id `>= vocab`.
pub fn pack(rows: &[RowInput<'_>], vocab: usize) -> Result<Option<Packed>> {
    let mut ids: Vec<u32> = Vec::new();
    let mut lens = Vec::with_capacity(rows.len());
    let mut positions: Vec<i32> = Vec::new();
    for row in rows {
        if let Some(&id) = row.tokens.iter().find(|&&id| id as usize >= vocab) {
            return Err(ModelError::TokenOutOfRange { id, vocab });
        }
        ids.extend_from_slice(row.tokens);
        lens.push(row.tokens.len());
        let o = row.cache.offset() as i32;
        positions.extend(o..o + row.tokens.len() as i32);
    }
    if ids.is_empty() {
        return Ok(None);
    }
    Ok(Some(Packed {
        ids: Array::from_slice(&ids, &[ids.len() as i32]),
        lens,
        positions: Array::from_slice(&positions, &[positions.len() as i32]),
    }))
}

/// One empty `[0, V]` logits array per row.
pub fn no_logits(rows: usize, vocab: usize) -> Vec<Array> {
    (0..rows)
        .map(|_| Array::from_slice::<f32>(&[], &[0, vocab as i32]))
        .collect()
}

/// A packed projection `[N, heads * D]` as `[N, heads, 1, D]`: each
/// token its own batch element, each head RMS-normed by `norm` (`[D]`,
/// Qwen3's and Gemma 3's q/k norms) when given, then half-split
/// (non-traditional) RoPE with base `base` at each token's own position
/// (`positions: [N]` int32).
pub fn rope_heads(
    a: &Array,
    heads: i32,
    d: i32,
    norm: Option<(&Array, f32)>,
    base: f32,
    positions: &Array,
) -> Result<Array> {
    let n = a.shape()[0];
    let a = a.reshape(&[n, heads, 1, d])?;
    let a = match norm {
        Some((w, eps)) => fast::rms_norm(&a, Some(w), eps)?,
        None => a,
    };
    Ok(fast::rope_dynamic(a, d, false, base, 1.0, positions, None)?)
}

/// Tokens `start..start + t` of a packed `[N, heads, 1, D]` tensor as one
/// row's `[1, heads, t, D]` (a single token stays `[1, heads, 1, D]`).
pub fn row_heads(a: &Array, start: i32, t: i32, heads: i32, d: i32) -> Result<Array> {
    let a = a.index(start..start + t);
    if t == 1 {
        return Ok(a);
    }
    Ok(a.reshape(&[t, heads, d])?
        .transpose_axes(&[1, 0, 2])?
        .reshape(&[1, heads, t, d])?)
}

/// The output head over each row's requested positions (`h: [N, E]`, rows'
/// tokens in order): only positions `logits_from..` of each row go through
/// `project` (final norm and head, `[M, E] -> [M, V]` float32), and all
/// rows' positions in one product, so the head's weights stream once per
/// step, not once per row. Returns per row `[n, V]`.
pub fn head(
    h: &Array,
    rows: &[RowInput<'_>],
    lens: &[usize],
    vocab: usize,
    project: impl Fn(&Array) -> Result<Array>,
) -> Result<Vec<Array>> {
    let mut picked = Vec::with_capacity(rows.len());
    let mut counts = Vec::with_capacity(rows.len());
    let mut start = 0i32;
    for (row, &t) in rows.iter().zip(lens) {
        let from = row.logits_from.min(t) as i32;
        if from < t as i32 {
            picked.push(h.index((start + from)..(start + t as i32)));
        }
        counts.push(t as i32 - from);
        start += t as i32;
    }
    if picked.is_empty() {
        return Ok(no_logits(rows.len(), vocab));
    }
    let hs = if picked.len() == 1 {
        picked.remove(0)
    } else {
        ops::concatenate(&picked, 0)?
    };
    let logits = project(&hs)?;
    let mut out = Vec::with_capacity(rows.len());
    let mut at = 0i32;
    for n in counts {
        if n == 0 {
            out.push(Array::from_slice::<f32>(&[], &[0, vocab as i32]));
        } else {
            out.push(logits.index(at..at + n));
        }
        at += n;
    }
    Ok(out)
}
