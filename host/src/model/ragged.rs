//! The parts of a ragged-batch forward pass every architecture shares:
//! packing the rows' new tokens into one activation, splitting a packed
//! per-token tensor back into one row's heads, one row's attention over its
//! own cache (full or sliding-window, optionally with gpt-oss's attention
//! sinks), and running the output head over only the positions whose
//! logits were asked for.

use mlx_rs::{
    fast::{self, ScaledDotProductAttentionMask},
    ops::{self, indexing::IndexOp},
    Array,
};

use super::error::{ModelError, Result};
use super::llama::RowInput;
use crate::cache::kv::KvView;
use crate::cache::{KvCache, LayerKind};

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
    rope_heads_with(a, heads, d, norm, &Rope::Base(base), positions)
}

/// A half-split (non-traditional) RoPE over a head's whole width.
#[derive(Debug, Clone)]
pub enum Rope {
    /// Frequencies `base^(-2i/D)`.
    Base(f32),
    /// Explicit per-pair periods `[D/2]` (position / period is the angle;
    /// an infinite period leaves its pair unrotated): Gemma 4's
    /// proportional partial RoPE.
    Periods(Array),
}

/// [`rope_heads`] with any [`Rope`].
pub fn rope_heads_with(
    a: &Array,
    heads: i32,
    d: i32,
    norm: Option<(&Array, f32)>,
    rope: &Rope,
    positions: &Array,
) -> Result<Array> {
    let n = a.shape()[0];
    let a = a.reshape(&[n, heads, 1, d])?;
    let a = match norm {
        Some((w, eps)) => fast::rms_norm(&a, Some(w), eps)?,
        None => a,
    };
    Ok(match rope {
        Rope::Base(base) => fast::rope_dynamic(a, d, false, *base, 1.0, positions, None)?,
        Rope::Periods(p) => fast::rope_dynamic(a, d, false, None, 1.0, positions, p)?,
    })
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

/// One row's attention over its own cache layer `l` of kind `kind`:
/// `q: [1, n_heads, T, D]`, `k`/`v: [1, n_kv, T, D]` (RoPE applied) ->
/// `[T, n_heads * D]`, scores scaled by `scale`. Writes k/v into the row's
/// cache at its offset; a full layer attends causally, a sliding-window
/// layer to each query's last `window` positions.
pub fn attend_row(
    l: usize,
    kind: LayerKind,
    q: &Array,
    k: &Array,
    v: &Array,
    cache: &mut KvCache,
    scale: f32,
) -> Result<Array> {
    attend_row_kv(l, kind, q, Some((k, v)), cache, scale, None)
}

/// [`attend_row`] with `kv: None`: the queries attend over what cache
/// layer `l` holds after an earlier layer of this forward wrote this
/// step's positions to it ([`KvCache::written`]; Gemma 4's KV sharing).
/// `sinks` (`[n_heads]`, in the activation dtype): gpt-oss's learned
/// per-head logit that joins every softmax and attends to nothing (MLX's
/// SDPA `sinks`).
pub fn attend_row_kv(
    l: usize,
    kind: LayerKind,
    q: &Array,
    kv: Option<(&Array, &Array)>,
    cache: &mut KvCache,
    scale: f32,
    sinks: Option<&Array>,
) -> Result<Array> {
    let (heads, t, d) = (q.shape()[1], q.shape()[2], q.shape()[3]);
    let offset = cache.offset();
    let view = match kv {
        Some((k, v)) => cache.update_view(l, k, v)?,
        None => cache.written_view(l, t as usize)?,
    };
    let (keys, values) = match view {
        // One query over a quantized (full) layer: read the packed rows
        // (mlx-lm's quantized SDPA), no dequantized copy per step.
        KvView::Quantized {
            keys,
            values,
            quant,
        } if t == 1 && sinks.is_none() => {
            // On CUDA: our split-K kernels over the layer's whole buffers
            // (a view of its written rows would be copied first).
            let rep = heads / keys.shape()[1].max(1);
            if cache.layer_start(l) == 0
                && super::cuda_split_attention::quantized_available(quant, q.dtype(), d, rep)
            {
                if let Some(Some((kb, vb))) = cache.layer_buffers().get(l) {
                    let o = super::cuda_split_attention::attend_quantized(
                        quant, q, kb, vb, offset, scale,
                    )?;
                    return Ok(o.reshape(&[1, heads * d])?);
                }
            }
            let o = crate::cache::quant::quantized_sdpa(&quant, q, &keys, &values, scale)?;
            return Ok(o.reshape(&[1, heads * d])?);
        }
        // A prefill chunk: one dequantized copy, shared by its T queries.
        view => view.float(d as usize, q.dtype())?,
    };
    let tiled = sinks.is_none() && super::prefill_attention::applies(q, &keys);
    if kind == LayerKind::Full && t > 1 && tiled {
        // A prefill chunk on the CPU: the tiled op, already token-major
        // (it has no sinks: those take MLX's SDPA).
        return super::prefill_attention::prefill_attention(q, &keys, &values, offset, scale);
    }
    let held_from = cache.layer_start(l);
    let o = attention_over(kind, q, &keys, &values, offset, held_from, scale, sinks)?;
    // SDPA gives `[1, heads, T, D]` (one query: `[1, heads, 1, D]`, already
    // in token-major order).
    let o = if t == 1 {
        o
    } else {
        o.transpose_axes(&[0, 2, 1, 3])?
    };
    Ok(o.reshape(&[t, heads * d])?)
}

/// Every row's attention at layer `l` (`q: [N, n_heads, 1, D]` packed, `kv`
/// `[N, n_kv, 1, D]` each, or `None` to read cache layer `l` as
/// [`attend_row_kv`] does; `sinks` as there) -> `[N, n_heads * D]`, each
/// row over its own cache.
#[allow(clippy::too_many_arguments)]
pub fn attend_rows(
    l: usize,
    kind: LayerKind,
    q: &Array,
    kv: Option<(&Array, &Array)>,
    rows: &mut [RowInput<'_>],
    lens: &[usize],
    (nh, nkv, d): (i32, i32, i32),
    scale: f32,
    sinks: Option<&Array>,
) -> Result<Array> {
    // One-token rows over a quantized full layer on the CPU: our batched
    // decode op reads the packed rows (MLX's quantized_matmul, the per-row
    // path below, ran Gemma 3's 16k decode 2.6x slower than its float cache).
    let decoded = match kv {
        Some((k, v))
            if kind == LayerKind::Full && sinks.is_none() && super::decode_attention::enabled() =>
        {
            decode_rows_op(l, q, k, v, rows, lens, scale, true)?
        }
        _ => None,
    };
    let mut outs = Vec::with_capacity(rows.len());
    let mut start = 0i32;
    let mut decoded_row = 0i32;
    for (row, &t) in rows.iter_mut().zip(lens) {
        let t = t as i32;
        if let (Some(out), 1) = (&decoded, t) {
            outs.push(
                out.index(decoded_row..decoded_row + 1)
                    .reshape(&[1, nh * d])?,
            );
            decoded_row += 1;
        } else if t > 0 {
            let part = |a: &Array, heads: i32| row_heads(a, start, t, heads, d);
            let row_kv = match kv {
                Some((k, v)) => Some((part(k, nkv)?, part(v, nkv)?)),
                None => None,
            };
            let row_kv = row_kv.as_ref().map(|(k, v)| (k, v));
            outs.push(attend_row_kv(
                l,
                kind,
                &part(q, nh)?,
                row_kv,
                row.cache,
                scale,
                sinks,
            )?);
        }
        start += t;
    }
    if outs.len() == 1 {
        return Ok(outs.remove(0));
    }
    Ok(ops::concatenate(&outs, 0)?)
}

/// The rows that feed one token through the batched decode op on the CPU
/// ([`super::decode_attention`]): `q: [N, n_heads, 1, D]`, `k`/`v: [N,
/// n_kv, 1, D]` packed as [`attend_rows`] takes them. Writes those rows'
/// new keys and values into their caches (quantized as written under
/// `--kv-bits`) and returns their outputs `[R, n_heads, 1, D]` in row
/// order; `None` (nothing done) when no row feeds one token, or, with
/// `only_quantized`, when layer `l`'s cache is not quantized. The caller
/// decides that the op runs here ([`super::decode_attention::enabled`]).
#[allow(clippy::too_many_arguments)]
pub fn decode_rows_op(
    l: usize,
    q: &Array,
    k: &Array,
    v: &Array,
    rows: &mut [RowInput<'_>],
    lens: &[usize],
    scale: f32,
    only_quantized: bool,
) -> Result<Option<Array>> {
    let Some(first) = rows.iter().zip(lens).position(|(_, &t)| t == 1) else {
        return Ok(None);
    };
    // Every row of a model shares its cache scheme (`--kv-bits`).
    let quant = rows[first].cache.layer_quant(l);
    if only_quantized && quant.is_none() {
        return Ok(None);
    }
    let pick = decode_rows_picker(lens);
    let (qd, kd, vd) = (pick(q)?, pick(k)?, pick(v)?);
    let like = kd.index(0..1);
    let mut caches = Vec::new();
    let mut positions = Vec::new();
    for (row, _) in rows.iter_mut().zip(lens).filter(|(_, &t)| t == 1) {
        let pos = row.cache.offset();
        caches.push(row.cache.take_layer(l, pos + 1, &like)?);
        positions.push(pos as i32);
    }
    let (out, updated) = match &quant {
        Some(quant) => super::decode_attention::decode_attention_quantized(
            quant, &qd, &kd, &vd, caches, &positions, scale,
        )?,
        None => {
            super::decode_attention::decode_attention(&qd, &kd, &vd, caches, &positions, scale)?
        }
    };
    for ((row, _), (kb, vb)) in rows
        .iter_mut()
        .zip(lens)
        .filter(|(_, &t)| t == 1)
        .zip(updated)
    {
        row.cache.put_layer(l, kb, vb);
    }
    Ok(Some(out))
}

/// Picks, out of a packed `[N, ...]` tensor, the tokens of the rows that
/// feed one token (`lens[r] == 1`), in row order (all of it when every row
/// does).
pub fn decode_rows_picker(lens: &[usize]) -> impl Fn(&Array) -> Result<Array> {
    let mut index = Vec::new();
    let mut start = 0i32;
    for &t in lens {
        if t == 1 {
            index.push(start);
        }
        start += t as i32;
    }
    let idx = (index.len() != lens.len()).then(|| Array::from_slice(&index, &[index.len() as i32]));
    move |a: &Array| match &idx {
        None => Ok(a.clone()),
        Some(idx) => Ok(a.take_axis(idx, 0)?),
    }
}

/// SDPA of `q: [1, n_heads, T, D]` (positions `offset..offset + T`) over
/// `keys`/`values` holding positions `held_from..offset + T`: causal, and
/// for a sliding-window layer only each query's last `window` positions;
/// with `sinks`, each head's sink logit in every softmax. Returns
/// `[1, n_heads, T, D]`.
#[allow(clippy::too_many_arguments)]
fn attention_over(
    kind: LayerKind,
    q: &Array,
    keys: &Array,
    values: &Array,
    offset: usize,
    held_from: usize,
    scale: f32,
    sinks: Option<&Array>,
) -> Result<Array> {
    let t = q.shape()[2] as usize;
    let window = match kind {
        LayerKind::SlidingWindow { window } => window,
        LayerKind::Recurrent => {
            return Err(ModelError::Tensor {
                name: "attention".into(),
                reason: "a recurrent-state layer has no keys to attend over".into(),
            })
        }
        LayerKind::Full => {
            let mask = (t > 1).then_some(ScaledDotProductAttentionMask::Causal);
            return Ok(fast::scaled_dot_product_attention(
                q, keys, values, scale, mask, sinks,
            )?);
        }
    };
    // Keys from the first query's window on: `(offset - W, offset + T)`.
    let from = (offset + 1).saturating_sub(window).max(held_from);
    let end = offset + t;
    let skip = (from - held_from) as i32;
    let keys = keys.index((.., .., skip.., ..));
    let values = values.index((.., .., skip.., ..));
    let o = if t == 1 {
        // One query: every key from `from` is inside its window.
        fast::scaled_dot_product_attention(q, &keys, &values, scale, None, sinks)?
    } else if end - 1 - from < window {
        // The last query still sees the first key: plain causal.
        fast::scaled_dot_product_attention(
            q,
            &keys,
            &values,
            scale,
            ScaledDotProductAttentionMask::Causal,
            sinks,
        )?
    } else {
        let mask = window_mask(offset, t, from, end, window)?;
        fast::scaled_dot_product_attention(
            q,
            &keys,
            &values,
            scale,
            ScaledDotProductAttentionMask::Array(&mask),
            sinks,
        )?
    };
    Ok(o)
}

/// `[T, K]` boolean mask: query `i` (position `offset + i`) may attend to
/// key `j` (position `from + j`, `j < end - from`) iff the key is at or
/// before it and less than `window` positions back.
fn window_mask(offset: usize, t: usize, from: usize, end: usize, window: usize) -> Result<Array> {
    let q: Vec<i32> = (offset..offset + t).map(|p| p as i32).collect();
    let k: Vec<i32> = (from..end).map(|p| p as i32).collect();
    let q = Array::from_slice(&q, &[t as i32, 1]);
    let k = Array::from_slice(&k, &[1, (end - from) as i32]);
    let causal = ops::le(&k, &q)?;
    let recent = ops::gt(&k, ops::subtract(&q, Array::from_int(window as i32))?)?;
    Ok(ops::logical_and(&causal, &recent)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::random;

    fn normal(shape: &[i32], key: u64) -> Array {
        let k = random::key(key).expect("key");
        random::normal::<f32>(shape, None, 1.0, &k).expect("normal")
    }

    /// A KV-shared layer (Gemma 4) attending over what its source layer
    /// wrote in the same step sees exactly what the source layer saw, for
    /// prefill chunks and single tokens, before and past the window.
    #[test]
    fn a_shared_layer_attends_over_its_source_layers_keys() -> Result<()> {
        for kind in [LayerKind::Full, LayerKind::SlidingWindow { window: 5 }] {
            let mut cache = KvCache::with_kinds(&[kind]);
            for (step, t) in [3, 1, 9, 1, 1].into_iter().enumerate() {
                let seed = 10 * step as u64;
                let q = normal(&[1, 4, t, 16], seed);
                let (k, v) = (
                    normal(&[1, 2, t, 16], seed + 1),
                    normal(&[1, 2, t, 16], seed + 2),
                );
                let source = attend_row(0, kind, &q, &k, &v, &mut cache, 0.25)?;
                let shared = attend_row_kv(0, kind, &q, None, &mut cache, 0.25, None)?;
                cache.advance(t as usize);
                let diff = ops::abs(ops::subtract(&source, &shared)?)?.max(None)?;
                assert_eq!(diff.item_exact::<f32>(), 0.0, "{kind:?} step {step}");
            }
        }
        Ok(())
    }

    #[test]
    fn window_mask_keeps_the_last_window_positions_causally() -> Result<()> {
        // Queries at 10, 11, 12; keys 8..13; window 3.
        let m = window_mask(10, 3, 8, 13, 3)?;
        let got: Vec<bool> = m.as_slice::<bool>().to_vec();
        #[rustfmt::skip]
        let want = vec![
            true,  true,  true,  false, false, // q=10 sees 8, 9, 10
            false, true,  true,  true,  false, // q=11 sees 9, 10, 11
            false, false, true,  true,  true,  // q=12 sees 10, 11, 12
        ];
        assert_eq!(got, want);
        Ok(())
    }
}
